"""Delivery service: the fan-in. It acts once both the package and the drone are ready.

The runtime's join records each result and decides exactly once, in whatever order they
arrive and on whichever instance reads them (``choreo.join``); a failure waits for both
results, so the compensation list names every step that completed, newest first.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from choreo import Context, Effects, Event, Joined, JoinFailed, Part, Service, derived_id
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryFailed, DeliveryShipped, DroneFailed, DroneScheduled, PackageFailed, PackageReady,
)

service = Service("delivery")
flight = Agent.from_env("flight")
DEADLINE_S = 60.0
# a decided delivery's state stays this long (compensation and status reads), then expires:
# Kafka stays the record, and rebuild-state can restore it
RETENTION_S = int(os.environ.get("CHOREO_RETENTION_S", "3600"))
OUTCOMES: dict[type[Event], str] = {DeliveryShipped: "shipped", DeliveryFailed: "failed"}
# each part is named after the step that produces it
PARTS = {"package": Part(PackageReady, failed=PackageFailed),
         "drone": Part(DroneScheduled, failed=DroneFailed)}

delivery = service.join("delivery", parts=PARTS, outcomes=OUTCOMES, deadline_s=DEADLINE_S,
                        retention_s=RETENTION_S)


@delivery.on_complete
def ship(ready: Joined, ctx: Context) -> Effects[None]:
    try:
        flight.call("depart", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        yield delivery.refuse(ctx.delivery_id)
        fail(ctx, "FLIGHT_REFUSED", str(refusal), "delivery", list(ready.completed))
        return
    ctx.emit(
        DeliveryShipped(delivery_id=ctx.delivery_id, package_id=ready.of("package", PackageReady).package_id,
                        drone_id=ready.of("drone", DroneScheduled).drone_id, shipped_at=datetime.now(UTC)),
        event_id=derived_id(ctx.delivery_id, "delivery.shipped"),
    )


@delivery.on_failure
def refuse(failed: JoinFailed, ctx: Context) -> None:
    reason = getattr(failed.failure, "reason", "FAILED")
    fail(ctx, reason, f"{failed.part} step failed", failed.part, list(failed.completed))


def fail(ctx: Context, reason: str, detail: str, failed_step: str, compensate: list[str]) -> None:
    ctx.emit(
        DeliveryFailed(delivery_id=ctx.delivery_id, reason=reason, detail=detail,
                       failed_step=failed_step, compensate=compensate, failed_at=datetime.now(UTC)),
        event_id=derived_id(ctx.delivery_id, "delivery.failed"),
    )
