"""The drone scheduler's rules, run in memory (``choreo.testing``): no broker, no Redis."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from choreo.errors import Retryable
from choreo.pool import Reservation
from choreo.runtime_events import UndoRequested, undo_topic
from choreo.service import retry_topic
from choreo.testing import Raw, run
from consumers import drone_scheduler as drones
from consumers.agents import Agent
from schemas.models import DeliveryFailed, DroneFailed, DroneReleased, DroneScheduled
from tests.factories import delivery_request

NOW = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def reliable_agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents read failure rates from the environment at import: pin them to none."""
    monkeypatch.setattr(drones, "dispatch", Agent("dispatch"))
    monkeypatch.setattr(drones, "dispatch_release", Agent("dispatch-release"))
    yield


def undo(delivery_id: str) -> UndoRequested:
    return UndoRequested(delivery_id=delivery_id, step="drone", reason="WAREHOUSE_REFUSED", requested_at=NOW)


def test_reserve_books_a_drone_from_the_fleet_for_the_delivery_and_its_weight() -> None:
    outcome = run(drones.service, delivery_request("d-1", weight_kg=2.5),
                  answers={"pool_reserve": Reservation("drone-7")})

    [reserve] = outcome.effects
    assert reserve.matches(drones.fleet.reserve("d-1", 2.5))
    assert reserve.args == ("d-1", 2.5) and reserve.keys[0] == "fleet:{fleet}:free"
    scheduled = outcome.only(DroneScheduled)
    assert (scheduled.delivery_id, scheduled.drone_id) == ("d-1", "drone-7")
    assert outcome.topics == ["drone.scheduled"]


def test_a_request_whose_body_names_another_delivery_than_its_envelope_reserves_nothing() -> None:
    """The runtime fences, dedupes and remembers by the envelope's delivery, the rule books by
    the body's: such a record is refused unread, or it would book a drone for a delivery
    (say one already shipped) that nothing gives back."""
    outcome = run(drones.service, delivery_request("d-shipped", weight_kg=2.5), delivery_id="d-new")
    assert outcome.refused and outcome.effects == []
    assert run(drones.service, delivery_request("d-new", weight_kg=2.5),
               answers={"pool_reserve": Reservation("drone-7")}).refused == ""


def test_a_load_no_drone_can_carry_fails_the_drone_step() -> None:
    outcome = run(drones.service, delivery_request("d-2", weight_kg=40.0),
                  answers={"pool_reserve": Reservation(None, fits=False)})
    refused = outcome.only(DroneFailed)
    assert (refused.reason, refused.detail) == (drones.NO_DRONE_FITS, "no drone carries 40.0 kg")


def test_no_drone_free_right_now_is_retried() -> None:
    outcome = run(drones.service, delivery_request("d-3"), answers={"pool_reserve": Reservation(None)})
    assert isinstance(outcome.error, Retryable)
    assert str(outcome.error) == "no drone free right now"
    assert outcome.emitted == []


@pytest.mark.parametrize("raw, expected", [
    ("drone-00003", "scheduled"), ("NO_FIT", drones.NO_DRONE_FITS), (None, "retry"),
])
def test_the_pools_own_answers_decode_to_the_same_rules(raw: str | None, expected: str) -> None:
    outcome = run(drones.service, delivery_request("d-4"), answers={"pool_reserve": Raw(raw)})
    if expected == "scheduled":
        assert outcome.only(DroneScheduled).drone_id == "drone-00003"
    elif expected == "retry":
        assert isinstance(outcome.error, Retryable)
    else:
        assert outcome.only(DroneFailed).reason == expected
    assert outcome.effects[0].answer == Reservation(raw if raw != "NO_FIT" else None, fits=raw != "NO_FIT")


def test_a_dispatch_refusal_gives_the_held_drone_back_and_fails_the_drone_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step completes (with drone.failed), so it may be listed for an undo that is never
    asked: the drone goes back here."""
    monkeypatch.setattr(drones, "dispatch", Agent("dispatch", permanent_rate=1.0))
    outcome = run(drones.service, delivery_request("d-5"),
                  answers={"pool_reserve": Reservation("drone-7"), "pool_release": "drone-7"})
    assert outcome.only(DroneFailed).reason == "DISPATCH_REFUSED"
    reserve, release = outcome.effects
    assert reserve.matches(drones.fleet.reserve("d-5", 1.0))
    assert release.matches(drones.fleet.release("d-5"))


def test_dispatch_is_not_asked_without_a_drone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drones, "dispatch", Agent("dispatch", permanent_rate=1.0))
    outcome = run(drones.service, delivery_request("d-11", weight_kg=40.0),
                  answers={"pool_reserve": Reservation(None, fits=False)})
    assert outcome.only(DroneFailed).reason == drones.NO_DRONE_FITS  # not DISPATCH_REFUSED
    assert len(outcome.effects) == 1


def test_a_requeued_request_books_through_the_same_rule() -> None:
    outcome = run(drones.service, delivery_request("d-6"), attempt=2,
                  topic=retry_topic("drone-scheduler", "delivery.requested"),
                  answers={"pool_reserve": Reservation("drone-9")})
    assert outcome.only(DroneScheduled).drone_id == "drone-9"


def test_release_is_the_undo_of_the_drone_step_and_runs_only_when_asked() -> None:
    [spec] = [s for s in drones.service.steps() if s.undoes]
    assert (spec.name, spec.undoes, spec.confirmed_by, spec.triggers) == (
        "release_drone", "drone", DroneReleased, (undo_topic("drone"),))
    assert DeliveryFailed.topic not in drones.service.topics  # the supervisor asks, not the failure


def test_release_frees_the_deliverys_drone_and_names_it() -> None:
    outcome = run(drones.service, undo("d-8"), answers={"pool_release": "drone-7"})
    [release] = outcome.effects
    assert release.matches(drones.fleet.release("d-8"))
    assert release.args == ("d-8", "release")
    released = outcome.only(DroneReleased)
    assert (released.delivery_id, released.drone_id) == ("d-8", "drone-7")


def test_releasing_when_no_drone_was_held_confirms_with_no_drone() -> None:
    outcome = run(drones.service, undo("d-9"), answers={"pool_release": Raw("")})
    assert outcome.only(DroneReleased).drone_id is None


def test_a_refused_release_is_retried_and_the_drone_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drones, "dispatch_release", Agent("dispatch-release", permanent_rate=1.0))
    outcome = run(drones.service, undo("d-10"))
    assert isinstance(outcome.error, Retryable)
    assert str(outcome.error) == "release refused: dispatch-release refused release"
    assert outcome.effects == [] and outcome.emitted == []
