"""A subscriber that writes an output for every other input only, one input per batch: its
batches take turns committing their offsets in a transaction (with the output) and plainly
(without any)."""

import os

from choreo.service import Context, Service
from schemas.models import DeliveryShipped, DroneReleased

TOPIC = os.environ["PROBE_TOPIC"]
service = Service(f"sometimes-{TOPIC}", batch_size=1)


@service.on(TOPIC)
def on_shipped(event: DeliveryShipped, ctx: Context) -> None:
    if int(event.drone_id.rsplit("-", 1)[1]) % 2 == 0:
        ctx.emit(DroneReleased(delivery_id=event.delivery_id, drone_id=event.drone_id,
                               released_at=event.shipped_at), topic=f"{TOPIC}.out")
