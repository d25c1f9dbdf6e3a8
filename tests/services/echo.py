"""A subscriber outside the workflow that declares an output on a topic nothing created:
``choreo run`` must create it (tests/integration/test_run_ensures_topics.py). It reads
``ECHO_SOURCE`` and emits one event per input to ``ECHO_TARGET``."""

from __future__ import annotations

import os
from typing import ClassVar

from choreo.service import Context, Service
from schemas.models import DeliveryShipped, DroneReleased

SOURCE, TARGET = os.environ["ECHO_SOURCE"], os.environ["ECHO_TARGET"]


class Echoed(DroneReleased):
    """DroneReleased's contract on a topic of its own: a declared output (``produces=``), so
    the runtime knows the topic before anything is emitted."""

    topic: ClassVar[str] = TARGET


service = Service(f"echo-{TARGET}")


@service.on(SOURCE, produces=[Echoed])
def echo(shipment: DeliveryShipped, ctx: Context) -> Echoed:
    return Echoed(delivery_id=shipment.delivery_id, drone_id=shipment.drone_id, released_at=shipment.shipped_at)
