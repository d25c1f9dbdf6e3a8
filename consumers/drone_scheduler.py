"""Drone-scheduler service: reserves a suitable drone per delivery and releases it on failure.
A shipped delivery's drone is back in the fleet as soon as the shipment is recorded: the
flight is over (the fleet is declared ``returned_on_success``, and the supervisor's record
of the shipment gives it back). A failed delivery's drone comes back with the undo of its
completed step, or, when no undo will give it back, in the supervisor's reading of the
failure.

Asking twice for the same delivery returns the same drone; one drone is never booked for
two deliveries at once (both hold by construction of the runtime's pool).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from choreo import Context, Effects, Pool, Retryable, Service, UndoRequested
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryRequested, DeliveryShipped, DroneFailed, DroneReleased, DroneScheduled,
)

service = Service("drone-scheduler")
dispatch = Agent.from_env("dispatch")
dispatch_release = Agent.from_env("dispatch-release")  # compensation fails on its own terms
CAPACITIES_KG = (2.0, 5.0, 10.0, 25.0)
NO_DRONE_FITS = "NO_DRONE_FITS"


def drones() -> dict[str, float]:
    """The fleet: drone-00000, drone-00001, ... with capacities taking turns. At least the
    ingestion's in-flight cap (``DRONE_FLEET_SIZE``), so a burst waits on admission, not on
    a drone."""
    size = int(os.environ.get("DRONE_FLEET_SIZE", "10000"))
    return {f"drone-{n:05d}": CAPACITIES_KG[n % len(CAPACITIES_KG)] for n in range(size)}


fleet = service.pool(Pool("fleet", seed=drones, returned_on_success=True))
# a booking is proven by drone.scheduled; it ends when the drone is released, or with the
# shipment (the flight is over)
fleet.rebuilt_from(DroneScheduled, member=lambda scheduled: scheduled.drone_id,
                   freed_by={DroneReleased: False, DeliveryShipped: False})


@service.on("delivery.requested", step="drone", deadline_s=30,
            produces=[DroneScheduled, DroneFailed], first_op_in_begin=True)
def reserve(request: DeliveryRequested, ctx: Context) -> Effects[DroneScheduled | DroneFailed]:
    # the drone is held before dispatch is asked (on one Redis node the hold rides in the
    # step's begin) and through dispatch's retries: the supervisor gives back the drone of a
    # delivery that fails with this step not completed. A refusal gives it back here, since
    # the step completes (with drone.failed) and its undo may never be asked; a replay is
    # told the same drone, and dispatch refuses the same call id again
    booking = yield fleet.reserve(request.delivery_id, request.weight_kg)
    if not booking.fits:
        return DroneFailed(delivery_id=request.delivery_id, reason=NO_DRONE_FITS,
                           detail=f"no drone carries {request.weight_kg} kg",
                           failed_at=datetime.now(UTC))
    if booking.member is None:
        raise Retryable("no drone free right now")
    try:
        dispatch.call("reserve", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        yield fleet.release(request.delivery_id)
        return DroneFailed(delivery_id=request.delivery_id, reason="DISPATCH_REFUSED",
                           detail=str(refusal), failed_at=datetime.now(UTC))
    return DroneScheduled(delivery_id=request.delivery_id, drone_id=booking.member,
                          scheduled_at=datetime.now(UTC))


@service.undo("drone", step="release_drone", confirmed_by=DroneReleased)
def release(request: UndoRequested, ctx: Context) -> Effects[DroneReleased]:
    try:
        dispatch_release.call("release", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:  # compensation must be retried, then alerted on
        raise Retryable(f"release refused: {refusal}") from refusal
    drone = yield fleet.release(request.delivery_id)
    return DroneReleased(delivery_id=request.delivery_id, drone_id=drone,
                         released_at=datetime.now(UTC))

