"""Drone-scheduler service: reserves a suitable drone per delivery, releases it on failure,
and takes it back when the flight is over.

Asking twice for the same delivery returns the same drone; one drone is never booked for
two deliveries at once (both hold by construction of ``consumers.fleet``).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

import redis

from choreo.errors import Retryable
from choreo.service import Context, Effects, Service
from consumers import fleet
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryFailed, DeliveryRequested, DeliveryShipped, DroneFailed, DroneReleased, DroneScheduled,
)

service = Service("drone-scheduler")
dispatch = Agent.from_env("dispatch")
dispatch_release = Agent.from_env("dispatch-release")  # compensation fails on its own terms
# at least the ingestion in-flight cap, so a burst waits on admission, not on a drone
FLEET_SIZE = int(os.environ.get("DRONE_FLEET_SIZE", "10000"))


@service.on_start
def seed_fleet(client: redis.Redis) -> None:
    fleet.seed(client, FLEET_SIZE)


@service.on("delivery.requested", step="drone", deadline_s=30,
            produces=[DroneScheduled, DroneFailed])
def reserve(request: DeliveryRequested, ctx: Context) -> Effects[DroneScheduled | DroneFailed]:
    try:
        dispatch.call("reserve", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        return DroneFailed(delivery_id=request.delivery_id, reason="DISPATCH_REFUSED",
                           detail=str(refusal), failed_at=datetime.now(UTC))
    drone = yield ctx.effect(fleet.RESERVE, keys=fleet.KEYS, args=[request.delivery_id, request.weight_kg])
    if drone is None:
        raise Retryable("no drone free right now")
    if drone == fleet.NO_FIT:
        return DroneFailed(delivery_id=request.delivery_id, reason=fleet.NO_FIT,
                           detail=f"no drone carries {request.weight_kg} kg",
                           failed_at=datetime.now(UTC))
    return DroneScheduled(delivery_id=request.delivery_id, drone_id=drone,
                          scheduled_at=datetime.now(UTC))


@service.on("delivery.failed", step="release_drone", deadline_s=30, produces=[DroneReleased])
def release(failure: DeliveryFailed, ctx: Context) -> Effects[DroneReleased | None]:
    if "drone" not in failure.compensate:
        return None
    try:
        dispatch_release.call("release", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:  # compensation must be retried, then alerted on
        raise Retryable(f"release refused: {refusal}") from refusal
    drone = yield ctx.effect(fleet.RELEASE, keys=fleet.KEYS, args=[failure.delivery_id, "release"])
    return DroneReleased(delivery_id=failure.delivery_id, drone_id=drone or None,
                         released_at=datetime.now(UTC))


@service.on("delivery.shipped")
def flight_over(shipment: DeliveryShipped, ctx: Context) -> Effects[None]:
    """The simulated flight ends when the shipment is recorded: the drone is free again."""
    yield ctx.effect(fleet.RELEASE, keys=fleet.KEYS, args=[shipment.delivery_id, "return"])
