"""The package service's rules, run in memory (``choreo.testing``): no broker, no Redis."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from choreo.envelope import derived_id
from choreo.errors import Retryable
from choreo.keys import of_delivery
from choreo.runtime_events import UndoRequested, undo_topic
from choreo.testing import Records, run
from consumers import package
from consumers.agents import Agent
from schemas.models import DeliveryFailed, PackageCancelled, PackageFailed, PackageReady
from tests.factories import delivery_request

NOW = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture(autouse=True)
def reliable_agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Agents read failure rates from the environment at import: pin them to none."""
    monkeypatch.setattr(package, "warehouse", Agent("warehouse"))
    monkeypatch.setattr(package, "warehouse_cancel", Agent("warehouse-cancel"))
    yield


def undo(delivery_id: str) -> UndoRequested:
    return UndoRequested(delivery_id=delivery_id, step="package", reason="NO_DRONE_FITS", requested_at=NOW)


def test_prepare_upserts_the_derived_package_and_reports_it_ready() -> None:
    request = delivery_request("d-1", weight_kg=2.5, package_size="MEDIUM")
    outcome = run(package.service, request, answers={"record_put": None})

    package_id = derived_id("d-1", "package")
    [put] = outcome.effects
    assert put.matches(package.packages.put("d-1", package_id=package_id, size="MEDIUM",
                                            weight_kg=2.5, status="ready"))
    assert put.keys == (of_delivery("pkg", "d-1"),)
    ready = outcome.only(PackageReady)
    assert (ready.delivery_id, ready.package_id, ready.package_size, ready.weight_kg) == (
        "d-1", package_id, "MEDIUM", 2.5)
    assert outcome.topics == ["package.ready"]
    assert outcome.error is None and not outcome.kept_open


def test_a_redo_prepares_the_same_package_under_the_same_output_id() -> None:
    request = delivery_request("d-1")
    first = run(package.service, request, answers={"record_put": None}, event_id="e-1")
    again = run(package.service, request, answers={"record_put": None}, event_id="e-1", attempt=2)
    assert first.only(PackageReady).package_id == again.only(PackageReady).package_id
    assert first.emitted[0].event_id == again.emitted[0].event_id == derived_id(
        "e-1", "package", "package.ready", "0")


def test_a_warehouse_refusal_fails_the_package_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(package, "warehouse", Agent("warehouse", permanent_rate=1.0))
    outcome = run(package.service, delivery_request("d-2"))

    refused = outcome.only(PackageFailed)
    assert (refused.delivery_id, refused.reason) == ("d-2", "WAREHOUSE_REFUSED")
    assert refused.detail == "warehouse refused prepare"
    assert outcome.topics == ["package.failed"]
    assert outcome.effects == []


def test_a_warehouse_timeout_is_retried_with_nothing_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(package, "warehouse", Agent("warehouse", transient_rate=1.0))
    outcome = run(package.service, delivery_request("d-3"))
    assert isinstance(outcome.error, Retryable)
    assert str(outcome.error) == "warehouse prepare timed out"
    assert outcome.emitted == [] and outcome.effects == []


def test_cancel_is_the_undo_of_the_package_step_and_runs_only_when_asked() -> None:
    [spec] = [s for s in package.service.steps() if s.undoes]
    assert (spec.name, spec.undoes, spec.confirmed_by, spec.triggers) == (
        "cancel_package", "package", PackageCancelled, (undo_topic("package"),))
    assert DeliveryFailed.topic not in package.service.topics  # the supervisor asks, not the failure


def test_cancel_marks_the_package_cancelled_and_names_it() -> None:
    outcome = run(package.service, undo("d-5"),
                  answers={"record_update": "pkg-77"})

    [update] = outcome.effects
    assert update.matches(package.packages.update("d-5", answer="package_id", status="cancelled"))
    cancelled = outcome.only(PackageCancelled)
    assert (cancelled.delivery_id, cancelled.package_id) == ("d-5", "pkg-77")
    assert outcome.topics == ["package.cancelled"]


def test_cancelling_a_package_never_prepared_confirms_with_no_package_id() -> None:
    outcome = run(package.service, undo("d-6"), answers={"record_update": None})
    assert outcome.only(PackageCancelled).package_id is None


def test_a_refused_cancel_is_retried_and_the_record_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(package, "warehouse_cancel", Agent("warehouse-cancel", permanent_rate=1.0))
    outcome = run(package.service, undo("d-7"))
    assert isinstance(outcome.error, Retryable)
    assert str(outcome.error) == "cancel refused: warehouse-cancel refused cancel"
    assert outcome.emitted == [] and outcome.effects == []


def test_a_prepared_package_is_the_one_cancelled() -> None:
    records = Records()
    ready = run(package.service, delivery_request("d-8", weight_kg=4.0), answers=records.answers)
    cancelled = run(package.service, undo("d-8"), answers=records.answers)

    package_id = ready.only(PackageReady).package_id
    assert cancelled.only(PackageCancelled).package_id == package_id
    assert records.hashes[of_delivery("pkg", "d-8")] == {"package_id": package_id, "size": "SMALL",
                                           "weight_kg": "4.0", "status": "cancelled"}
