"""The 10-line subscriber of the runtime test: typed event in, derived event out."""

import os

from choreo.service import Context, Service
from schemas.models import DeliveryShipped, DroneReleased

TOPIC = os.environ["PROBE_TOPIC"]
service = Service(f"subscriber-{TOPIC}")


@service.on(TOPIC)
def on_shipped(event: DeliveryShipped, ctx: Context) -> None:
    ctx.emit(DroneReleased(delivery_id=event.delivery_id, drone_id=event.drone_id,
                           released_at=event.shipped_at), topic=f"{TOPIC}.out")
