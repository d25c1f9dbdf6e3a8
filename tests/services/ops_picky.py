"""Two subscribers of one test topic (``OPS_TOPIC``), for the dead-letter redrive test.

* ``picky`` rejects 13 kg requests until the cause is fixed (Redis flag
  ``ops:<topic>:fixed``), and emits one event per request it accepts to ``<topic>.out``;
* ``other`` accepts everything and emits to ``<topic>.other``: a redriven copy on the shared
  topic must not be handled by it a second time.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from choreo.errors import Rejected
from choreo.service import Context, Service
from schemas.models import DeliveryRequested, PackageReady

TOPIC = os.environ.get("OPS_TOPIC", "t.ops.unset")
picky = Service(f"ops-picky-{TOPIC}")
other = Service(f"ops-other-{TOPIC}")


def _ready(request: DeliveryRequested) -> PackageReady:
    return PackageReady(delivery_id=request.delivery_id, package_id=f"p-{request.delivery_id}",
                        package_size=request.package_size, weight_kg=request.weight_kg,
                        ready_at=datetime.now(UTC))


@picky.on(TOPIC)
def accept_if_fixed(request: DeliveryRequested, ctx: Context) -> None:
    if request.weight_kg == 13 and not ctx.redis.exists(f"ops:{TOPIC}:fixed"):
        raise Rejected("13 kg is refused until the scale is fixed")
    ctx.emit(_ready(request), topic=f"{TOPIC}.out")


@other.on(TOPIC)
def accept(request: DeliveryRequested, ctx: Context) -> None:
    ctx.emit(_ready(request), topic=f"{TOPIC}.other")
