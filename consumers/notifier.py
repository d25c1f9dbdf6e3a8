"""Notifier: the template for a service added later. It reacts to the public fact
``delivery.shipped`` and records one notification per delivery, without touching any
other service. Copy this file to subscribe a new service.
"""

from __future__ import annotations

from choreo import Context, Effects, Service
from schemas.models import DeliveryShipped

service = Service("notifier")

# what the customer was told, once per delivery (a replay finds it sent); gone with the
# delivery's state, whose tombstone then refuses a replay (Kafka keeps the shipment): the
# service runs in its workflow, whose services refuse a released delivery's events
notified = service.record("notified", ttl_s=24 * 3600, released_with_delivery=True)
notified.rebuilt_from(DeliveryShipped, lambda shipment: {"drone": shipment.drone_id}, when_consumed=True)


# it does nothing before recording the notification: that runs with the input's dedupe
@service.on("delivery.shipped", first_op_in_begin=True)
def notify(shipment: DeliveryShipped, ctx: Context) -> Effects[None]:
    yield notified.set_once(shipment.delivery_id, "drone", shipment.drone_id)
    ctx.log.debug("customer.notified", drone_id=shipment.drone_id)  # per event: debug, not info
