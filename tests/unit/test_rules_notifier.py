"""The notifier's rule, run in memory (``choreo.testing``): no broker, no Redis."""

from __future__ import annotations

from datetime import UTC, datetime

from choreo.keys import of_delivery
from choreo.testing import Records, run
from consumers import notifier
from schemas.models import DeliveryShipped

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def shipped(delivery_id: str, drone_id: str) -> DeliveryShipped:
    return DeliveryShipped(delivery_id=delivery_id, package_id="p-1", drone_id=drone_id, shipped_at=NOW)


def test_a_shipment_sets_the_deliverys_notification_once() -> None:
    outcome = run(notifier.service, shipped("d-1", "drone-7"), answers={"record_set_once": "drone-7"})
    [notify] = outcome.effects
    assert notify.matches(notifier.notified.set_once("d-1", "drone", "drone-7"))
    assert notify.keys == (of_delivery("notified", "d-1"),)
    assert outcome.emitted == [] and outcome.error is None
    assert [(log.level, log.event) for log in outcome.logs] == [("debug", "customer.notified")]


def test_the_first_notification_of_a_delivery_stands() -> None:
    records = Records()
    run(notifier.service, shipped("d-2", "drone-7"), answers=records.answers)
    again = run(notifier.service, shipped("d-2", "drone-9"), answers=records.answers, event_id="other")
    assert again.effects[0].answer == "drone-7"
    assert records.hashes == {of_delivery("notified", "d-2"): {"drone": "drone-7"}}
