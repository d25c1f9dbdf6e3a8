"""Customs: a step added in the middle of the workflow by the acceptance test, as a new team
would add it: its contracts (the ``.avsc`` beside this file and their mirrors below), this
service, one line in a workflow list and the join naming it (``tests/customs/workflow.py``).
Nothing of the runtime, the supervisor or the tools is told about it.

``CUSTOMS_SLOW_FIRST_MS`` makes a delivery's first attempt sleep that long before working
(past its deadline, so the supervisor requeues it).
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

from choreo import Context, Effects, Event, Service, UndoRequested, derived_id
from consumers.agents import Agent, PermanentFailure
from schemas.models import DeliveryRequested

HERE = Path(__file__).parent


class CustomsCleared(Event):
    schema_file: ClassVar[Path] = HERE / "CustomsCleared.avsc"
    topic: ClassVar[str] = "customs.cleared"

    delivery_id: str
    declaration_id: str
    cleared_at: datetime


class CustomsRefused(Event):
    schema_file: ClassVar[Path] = HERE / "CustomsRefused.avsc"
    topic: ClassVar[str] = "customs.refused"

    delivery_id: str
    reason: str
    refused_at: datetime


class CustomsRevoked(Event):
    schema_file: ClassVar[Path] = HERE / "CustomsRevoked.avsc"
    topic: ClassVar[str] = "customs.revoked"

    delivery_id: str
    declaration_id: str | None = None
    revoked_at: datetime


service = Service("customs")
office = Agent.from_env("customs")
SLOW_FIRST_MS = float(os.environ.get("CUSTOMS_SLOW_FIRST_MS", "0"))

clearances = service.record("clearance", ttl_s=24 * 3600)
clearances.rebuilt_from(CustomsCleared, lambda cleared: {"declaration": cleared.declaration_id,
                                                         "status": "cleared"})
clearances.rebuilt_from(CustomsRevoked, lambda _: {"status": "revoked"})


# a short deadline, so the acceptance test sees its expiry requeue the step within seconds
@service.on("delivery.requested", step="customs", deadline_s=5, produces=[CustomsCleared, CustomsRefused])
def clear(request: DeliveryRequested, ctx: Context) -> Effects[CustomsCleared | CustomsRefused]:
    if SLOW_FIRST_MS and ctx.attempt == 1:
        time.sleep(SLOW_FIRST_MS / 1000)
    try:
        office.call("clear", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        return CustomsRefused(delivery_id=request.delivery_id, reason=str(refusal), refused_at=datetime.now(UTC))
    declaration = derived_id(request.delivery_id, "customs")
    yield clearances.put(request.delivery_id, declaration=declaration, status="cleared")
    return CustomsCleared(delivery_id=request.delivery_id, declaration_id=declaration,
                          cleared_at=datetime.now(UTC))


@service.undo("customs", step="revoke_customs", confirmed_by=CustomsRevoked)
def revoke(request: UndoRequested, ctx: Context) -> Effects[CustomsRevoked]:
    declaration = yield clearances.update(request.delivery_id, answer="declaration", status="revoked")
    return CustomsRevoked(delivery_id=request.delivery_id, declaration_id=declaration,
                          revoked_at=datetime.now(UTC))
