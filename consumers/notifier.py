"""Notifier: the template for a service added later. It reacts to the public fact
``delivery.shipped`` and records one notification per delivery, without touching any
other service. Copy this file to subscribe a new service.
"""

from __future__ import annotations

from choreo.effects import OnceEffect
from choreo.service import Context, Effects, Service
from schemas.models import DeliveryShipped

service = Service("notifier")

RECORD = OnceEffect("notify", """
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return 'sent'
""")


@service.on("delivery.shipped")
def notify(shipment: DeliveryShipped, ctx: Context) -> Effects[None]:
    yield ctx.effect(RECORD, keys=["notifications"], args=[shipment.delivery_id, shipment.drone_id])
    ctx.log.debug("customer.notified", drone_id=shipment.drone_id)  # per event: debug, not info
