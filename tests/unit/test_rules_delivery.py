"""The delivery service's fan-in rules, run in memory (``choreo.testing``): each part's
handler records its result (``join_record``), whose answer, the join's decision, the test
scripts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from choreo.envelope import derived_id
from choreo.errors import DeadLetterReason, Rejected, Retryable
from choreo.service import Service
from choreo.state import delivery_key
from choreo.join import result_text
from choreo.testing import LATE, WAIT, Raw, complete, failed, run
from consumers import delivery
from consumers.agents import Agent
from schemas.models import DeliveryFailed, DeliveryShipped, DroneFailed, DroneScheduled, PackageFailed, PackageReady

NOW = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def reliable_flight(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents read failure rates from the environment at import: pin them to none."""
    monkeypatch.setattr(delivery, "flight", Agent("flight"))
    yield


def ready(delivery_id: str) -> PackageReady:
    return PackageReady(delivery_id=delivery_id, package_id=f"pkg-{delivery_id}", package_size="SMALL",
                        weight_kg=1.0, ready_at=NOW)


def scheduled(delivery_id: str) -> DroneScheduled:
    return DroneScheduled(delivery_id=delivery_id, drone_id="drone-7", scheduled_at=NOW)


def both(delivery_id: str) -> dict[str, PackageReady | DroneScheduled]:
    return {"package": ready(delivery_id), "drone": scheduled(delivery_id)}


def test_each_part_records_its_result_in_the_join() -> None:
    outcome = run(delivery.service, scheduled("d-1"), answers={"join_record": WAIT})
    [record] = outcome.effects
    assert record.matches(delivery.delivery.record("d-1", "drone", True, scheduled("d-1")))
    assert record.keys == (delivery_key("d-1"),)  # the delivery's own hash
    assert record.args[:3] == ("drone", "ok", result_text(scheduled("d-1")))


def test_a_part_too_large_to_keep_is_refused_before_it_is_recorded() -> None:
    """A part is kept as JSON in the delivery's hash for hours and copied into the decision:
    half a megabyte of control characters would be three megabytes there (six characters each)."""
    forged = PackageFailed(delivery_id="d-1", reason="X", detail="\x01" * 3_000, failed_at=NOW)
    outcome = run(delivery.service, forged)
    assert isinstance(outcome.error, Rejected) and outcome.error.reason is DeadLetterReason.OVERSIZED
    assert "kept as 18" in str(outcome.error) and outcome.effects == [] and outcome.emitted == []
    assert run(delivery.service, forged.model_copy(update={"detail": "x" * 3_000}),
               answers={"join_record": WAIT}).error is None


def test_a_complete_join_ships_with_the_package_and_the_drone() -> None:
    outcome = run(delivery.service, ready("d-2"),
                  answers={"join_record": complete(delivery.delivery, both("d-2"))})

    shipped = outcome.only(DeliveryShipped)
    assert (shipped.delivery_id, shipped.package_id, shipped.drone_id) == ("d-2", "pkg-d-2", "drone-7")
    assert outcome.topics == ["delivery.shipped"]
    # one shipment per delivery, whichever part's event decided it
    assert outcome.emitted[0].event_id == derived_id("d-2", "delivery.shipped")
    assert [a.name for a in outcome.effects] == ["join_record"]
    assert not outcome.kept_open


def test_the_shipment_id_is_the_same_whichever_part_decides() -> None:
    decision = complete(delivery.delivery, both("d-3"))
    by_package = run(delivery.service, ready("d-3"), answers={"join_record": decision})
    by_drone = run(delivery.service, scheduled("d-3"), answers={"join_record": decision})
    assert by_package.emitted[0].event_id == by_drone.emitted[0].event_id


def test_the_join_scripts_own_answer_decodes_to_a_shipment() -> None:
    answer = json.dumps({"d": "complete", "order": "drone,package,", "results": {
        "package": result_text(ready("d-4")), "drone": result_text(scheduled("d-4"))}})
    outcome = run(delivery.service, scheduled("d-4"), answers={"join_record": Raw(answer)})
    shipped = outcome.only(DeliveryShipped)
    assert (shipped.package_id, shipped.drone_id) == ("pkg-d-4", "drone-7")
    assert outcome.effects[0].answer.joined.completed == ("drone", "package")


@pytest.mark.parametrize("kept", ["pkg-7", "123", '{"package_id": "p"}'],
                         ids=["a bare id (another layout)", "a number", "an event the model refuses"])
def test_a_recorded_result_the_join_cannot_read_dead_letters_the_input(kept: str) -> None:
    """Replayed, the same answer comes back: a crash would come back with it for ever."""
    answer = json.dumps({"d": "complete", "order": "drone,package,", "results": {
        "package": kept, "drone": result_text(scheduled("d-5"))}})
    outcome = run(delivery.service, scheduled("d-5"), answers={"join_record": Raw(answer)})
    assert isinstance(outcome.error, Rejected) and "cannot be read" in str(outcome.error)
    assert outcome.emitted == []


def test_a_part_cannot_be_named_like_the_joins_own_fields() -> None:
    with pytest.raises(ValueError, match="order"):
        Service("x").join("x", parts={"order": delivery.PARTS["package"], "drone": delivery.PARTS["drone"]},
                          outcomes=delivery.OUTCOMES)


@pytest.mark.parametrize("completed", [("drone", "package"), ("package", "drone")])
def test_a_flight_refusal_refuses_the_join_and_undoes_both_parts_newest_first(
        monkeypatch: pytest.MonkeyPatch, completed: tuple[str, str]) -> None:
    monkeypatch.setattr(delivery, "flight", Agent("flight", permanent_rate=1.0))
    outcome = run(delivery.service, ready("d-5"), answers={
        "join_record": complete(delivery.delivery, both("d-5"), completed=completed), "join_refuse": None})

    assert [a.name for a in outcome.effects] == ["join_record", "join_refuse"]
    assert outcome.effects[1].matches(delivery.delivery.refuse("d-5"))
    refused = outcome.only(DeliveryFailed)
    assert (refused.reason, refused.failed_step, refused.compensate) == (
        "FLIGHT_REFUSED", "delivery", list(completed))
    assert refused.detail == "flight refused depart"
    assert outcome.emitted[0].event_id == derived_id("d-5", "delivery.failed")
    assert outcome.topics == ["delivery.failed"]


def test_a_flight_timeout_is_retried_without_refusing_the_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delivery, "flight", Agent("flight", transient_rate=1.0))
    outcome = run(delivery.service, ready("d-6"),
                  answers={"join_record": complete(delivery.delivery, both("d-6"))})
    assert isinstance(outcome.error, Retryable)
    assert [a.name for a in outcome.effects] == ["join_record"]
    assert outcome.emitted == []


def test_a_failed_part_fails_the_delivery_and_undoes_the_parts_that_completed() -> None:
    no_drone = DroneFailed(delivery_id="d-7", reason="NO_DRONE_FITS", detail="40 kg", failed_at=NOW)
    outcome = run(delivery.service, no_drone,
                  answers={"join_record": failed(delivery.delivery, "drone", no_drone, completed=["package"])})

    [record] = outcome.effects
    assert record.args[:2] == ("drone", "fail")
    lost = outcome.only(DeliveryFailed)
    assert (lost.delivery_id, lost.reason, lost.failed_step, lost.compensate) == (
        "d-7", "NO_DRONE_FITS", "drone", ["package"])
    assert lost.detail == "drone step failed"
    assert outcome.emitted[0].event_id == derived_id("d-7", "delivery.failed")


def test_the_compensations_keep_the_joins_newest_first_order() -> None:
    refused = PackageFailed(delivery_id="d-8", reason="WAREHOUSE_REFUSED", failed_at=NOW)
    answer = json.dumps({"d": "fail", "part": "package", "result": result_text(refused), "order": "drone,"})
    outcome = run(delivery.service, scheduled("d-8"), answers={"join_record": Raw(answer)})
    lost = outcome.only(DeliveryFailed)
    assert (lost.reason, lost.failed_step, lost.compensate) == ("WAREHOUSE_REFUSED", "package", ["drone"])


def test_a_failure_with_nothing_completed_has_nothing_to_undo() -> None:
    refused = PackageFailed(delivery_id="d-9", reason="WAREHOUSE_REFUSED", failed_at=NOW)
    outcome = run(delivery.service, refused,
                  answers={"join_record": failed(delivery.delivery, "package", refused)})
    assert outcome.only(DeliveryFailed).compensate == []


def test_waiting_for_the_other_part_keeps_the_step_open_and_emits_nothing() -> None:
    outcome = run(delivery.service, ready("d-10"), answers={"join_record": WAIT})
    assert outcome.kept_open
    assert outcome.emitted == [] and outcome.error is None


def test_a_result_after_the_decision_emits_nothing_and_is_logged() -> None:
    outcome = run(delivery.service, scheduled("d-11"), answers={"join_record": LATE})
    assert outcome.emitted == [] and not outcome.kept_open and outcome.error is None
    assert [(log.event, log.fields["part"]) for log in outcome.logs] == [("result.late", "drone")]
