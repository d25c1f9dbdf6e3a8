"""The drone-delivery workflow with customs: the production list with one line added, and
the delivery join naming customs (in production, one more entry in ``consumers.delivery``'s
``PARTS``; here a join of its own, so the production workflow stays as it is)."""

from __future__ import annotations

from choreo import Part, Service, Workflow
from consumers import delivery as delivery_rules
from consumers.workflow import WORKFLOW as PRODUCTION
from tests.customs.service import CustomsCleared, CustomsRefused

delivery = Service("delivery")
join = delivery.join("delivery", parts={**delivery_rules.PARTS, "customs": Part(CustomsCleared, failed=CustomsRefused)},
                     outcomes=delivery_rules.OUTCOMES, deadline_s=delivery_rules.DEADLINE_S,
                     retention_s=delivery_rules.RETENTION_S)
join.on_complete(delivery_rules.ship)
join.on_failure(delivery_rules.refuse)

WORKFLOW = Workflow(
    "drone-delivery-with-customs",
    service_refs=[
        "consumers.package:service",
        "consumers.drone_scheduler:service",
        "tests.customs.workflow:delivery",
        "tests.customs.service:service",
        "consumers.notifier:service",
        "choreo.supervisor:service",
    ],
    extra_producers=PRODUCTION.extra_producers,
)
