"""The supervisor's rules that need no Redis: the policies it derives from the services'
declarations, and what its recording handlers log once the state table has answered
(``ctx.once``, scripted by ``choreo.testing``). The scans and the reports need Redis
itself: the integration tests cover them."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from prometheus_client import REGISTRY

from choreo.envelope import Envelope, derived_id
from choreo.logs import get_logger
from choreo.outcomes import told
from choreo.events import Event
from choreo.release import awaiting_key
from choreo.runner import RECOVERY_TOPIC
from choreo.service import Context, deadline_scale
from choreo.supervision import COMPENSATION, FORWARD, Action, Unrecorded
from choreo.runtime_events import CompensationRecord, StepReport, UndoByOperator, UndoRequested, undo_topic
from choreo.testing import HarnessError, Outcome, run
from choreo import supervisor
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryFailed, DeliveryShipped, DroneReleased, PackageCancelled

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def ms(seconds: float) -> int:
    return int(seconds * deadline_scale() * 1000)


def test_each_step_gets_its_role_service_budget_and_deadline_from_the_declarations() -> None:
    policies = supervisor.policies_of(WORKFLOW)
    got = {name: (p.role, p.service, p.budget, p.deadline_ms, p.target, p.waits_for)
           for name, p in policies.steps.items()}
    assert got == {
        "package": (FORWARD, "package", 10, ms(30), "", ()),
        "drone": (FORWARD, "drone-scheduler", 10, ms(30), "", ()),
        "delivery": (FORWARD, "delivery", 10, ms(60), "", ("package", "drone")),
        "cancel_package": (COMPENSATION, "package", 10, ms(30), "package", ()),
        "release_drone": (COMPENSATION, "drone-scheduler", 10, ms(30), "drone", ()),
    }


def test_the_steps_to_undo_and_the_decider_come_from_the_workflow() -> None:
    policies = supervisor.policies_of(WORKFLOW)
    assert set(policies.compensable) == {"package", "drone"}
    assert policies.decider == "delivery"
    expected: dict[str, tuple[str, type[Event]]] = {"package": ("cancel_package", PackageCancelled),
                                                     "drone": ("release_drone", DroneReleased)}
    assert WORKFLOW.compensations() == expected


def failure(reason: str, failed_step: str, compensate: list[str]) -> DeliveryFailed:
    return DeliveryFailed(delivery_id="d-1", reason=reason, detail="it broke", failed_step=failed_step,
                          compensate=compensate, failed_at=NOW)


def log_of(outcome: Outcome) -> list[tuple[str, str, int]]:
    """The compensation log records emitted: (step, status, attempt)."""
    return [(e.step, e.status, e.attempt) for e in outcome.events if isinstance(e, CompensationRecord)]


def undos_of(outcome: Outcome) -> list[tuple[str, str, str, str]]:
    """The undo requests emitted: (topic, step, reason, event id)."""
    return [(e.topic, e.event.step, e.event.reason, e.event_id) for e in outcome.emitted
            if isinstance(e.event, UndoRequested)]


def test_a_failed_delivery_marks_its_steps_logs_them_and_asks_the_newest_to_undo() -> None:
    marked = json.dumps({"next": "drone", "marked": [{"step": "drone", "before": "completed", "attempt": 1},
                                                     {"step": "package", "before": "completed", "attempt": 2}]})
    outcome = run(supervisor.service, failure("FLIGHT_REFUSED", "delivery", ["drone", "package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": marked})

    [mark] = outcome.effects
    assert mark.name == "mark_compensating"
    # after the time: the delivery, the failed step, the reason, the workflow's retention (the
    # failed delivery's state has it from this reading), the steps with an undo (closed while
    # pending when not listed), then the steps to undo newest first
    assert mark.args[1:] == ("d-1", "delivery", "FLIGHT_REFUSED: it broke", 3600, "package,drone",
                             "drone", "package")
    assert log_of(outcome) == [("drone", "COMPENSATING", 1), ("package", "COMPENSATING", 2)]
    assert [e.event.key for e in outcome.emitted[:2]] == ["d-1|drone", "d-1|package"]  # one per step
    assert [e.event_id for e in outcome.emitted[:2]] == [
        derived_id("d-1", "drone", "COMPENSATING"), derived_id("d-1", "package", "COMPENSATING")]
    assert undos_of(outcome) == [(supervisor.topic(undo_topic("drone")), "drone", "FLIGHT_REFUSED: it broke",
                                  derived_id("d-1", "undo", "drone"))]


def test_a_failed_step_that_is_no_step_of_the_workflow_names_no_deadline_entry() -> None:
    """Its deadline entry is ``<delivery>|<step>``: a step ``B|package`` of delivery ``A``
    would name delivery ``A|B``'s entry."""
    outcome = run(supervisor.service, failure("X", "B|package", ["package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": "{}", "pool_release": "0"})
    mark = outcome.effects[0]
    assert mark.name == "mark_compensating" and mark.args[1:3] == ("d-1", "")


def test_a_failure_that_undoes_no_drone_step_gives_the_drone_back_itself() -> None:
    """The drone step holds its drone before dispatch answers: failed, closed or refused by
    dispatch, it is not in the list, and no undo would give the drone back."""
    outcome = run(supervisor.service, failure("RETRY_BUDGET_SPENT", "drone", ["package"]),
                  topic=supervisor.watched().failed_topic,
                  answers={"mark_compensating": '{"next": "package", "outcome": "failed"}',
                           "pool_release": "drone-7"})
    mark, give_back = outcome.effects
    assert mark.name == "mark_compensating"
    assert give_back.matches(fleet.release("d-1", "failed"))
    assert [step for _, step, _, _ in undos_of(outcome)] == ["package"]


def test_a_failure_that_undoes_a_completed_drone_step_leaves_its_drone_to_the_undo() -> None:
    marked = json.dumps({"next": "drone", "outcome": "failed",
                         "marked": [{"step": "drone", "before": "completed", "attempt": 1}]})
    outcome = run(supervisor.service, failure("FLIGHT_REFUSED", "delivery", ["drone", "package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": marked})
    assert [effect.name for effect in outcome.effects] == ["mark_compensating"]


def test_an_abandoned_drone_step_has_its_drone_given_back_before_its_undo() -> None:
    """Its attempt took the drone and still runs; its undo waits behind the package's, which
    may fail for good."""
    marked = json.dumps({"next": "package", "outcome": "failed",
                         "marked": [{"step": "package", "before": "processing", "attempt": 1},
                                    {"step": "drone", "before": "processing", "attempt": 1}]})
    outcome = run(supervisor.service, failure("DEADLINE_MISSED", "package", ["package", "drone"]),
                  topic=supervisor.watched().failed_topic,
                  answers={"mark_compensating": marked, "pool_release": "drone-7"})
    assert outcome.effects[1].matches(fleet.release("d-1", "failed"))
    assert [step for _, step, _, _ in undos_of(outcome)] == ["package"]


def test_a_failure_of_a_delivery_that_shipped_gives_nothing_back() -> None:
    outcome = run(supervisor.service, failure("X", "drone", ["package"]),
                  topic=supervisor.watched().failed_topic,
                  answers={"mark_compensating": '{"outcome": "shipped"}'})
    assert [effect.name for effect in outcome.effects] == ["mark_compensating"]


def test_a_failure_whose_body_names_another_delivery_than_its_envelope_is_refused_unread() -> None:
    """A forged failure: the state it would change is the body's delivery, its remembered
    answer the envelope's. The runtime dead-letters it before the supervisor reads it."""
    outcome = run(supervisor.service, failure("X", "delivery", ["drone", "package"]),
                  topic=supervisor.watched().failed_topic, delivery_id="d-2")
    assert outcome.refused == "its body names another delivery than its envelope (3 characters)"


def test_a_report_whose_body_names_another_delivery_than_its_envelope_is_refused_unread() -> None:
    """The runner names the same delivery in both; a report that does not is dead-lettered."""
    report = StepReport(delivery_id="d-1", step="drone", kind="FAILED", attempt=1, service="drone-scheduler",
                        source_topic="delivery.requested", source_event_id="e-1", error="x",
                        reported_at=datetime.now(UTC))
    outcome = run(supervisor.service, report, topic=RECOVERY_TOPIC, delivery_id="d-2")
    assert outcome.refused


def test_only_declared_compensations_are_marked() -> None:
    outcome = run(supervisor.service, failure("X", "delivery", ["delivery", "drone", "unknown"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": "{}"})
    assert outcome.effects[0].args[6:] == ("drone",)


@pytest.mark.parametrize("answer", ["{}", '{"next": ""}'])
def test_nothing_marked_and_nothing_due_emits_nothing(answer: str) -> None:
    outcome = run(supervisor.service, failure("NO_DRONE_FITS", "drone", ["package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": answer,
                                                                    "pool_release": ""})
    assert outcome.emitted == []


def test_a_failure_seen_again_asks_again_for_the_undo_still_due() -> None:
    outcome = run(supervisor.service, failure("NO_DRONE_FITS", "drone", ["package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": '{"next": "package"}',
                                                                    "pool_release": ""})
    assert log_of(outcome) == []
    assert [step for _, step, _, _ in undos_of(outcome)] == ["package"]


def cancelled() -> PackageCancelled:
    return PackageCancelled(delivery_id="d-1", package_id="p-1", cancelled_at=NOW)


def test_a_confirmed_undo_logs_the_step_compensated_and_asks_the_next() -> None:
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:compensating:3:drone:FLIGHT_REFUSED: a: b\x1f\x1f"})
    assert outcome.effects[0].args[0] == "package"
    assert log_of(outcome) == [("package", "COMPENSATED", 3)]
    assert outcome.emitted[0].event_id == derived_id("d-1", "package", "COMPENSATED")
    assert undos_of(outcome) == [(supervisor.topic(undo_topic("drone")), "drone", "FLIGHT_REFUSED: a: b",
                                  derived_id("d-1", "undo", "drone"))]


def test_the_last_confirmed_undo_asks_for_nothing_more() -> None:
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:compensating:1::"})
    assert log_of(outcome) == [("package", "COMPENSATED", 1)]
    assert undos_of(outcome) == []


def test_the_undo_that_ends_the_compensation_tells_the_outcome_on_its_record() -> None:
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:compensating:1::NO_DRONE: x\x1fcompensated\x1fdrone,package"})
    [record] = [e for e in outcome.emitted if isinstance(e.event, CompensationRecord)]
    assert isinstance(record.event, CompensationRecord)
    assert (record.event.status, record.event.outcome, record.event.undone, record.event.reason) == (
        "COMPENSATED", "compensated", ["drone", "package"], "NO_DRONE: x")
    # an id of its own: apart from a COMPENSATED record of the step written without the outcome
    assert record.event_id == derived_id("d-1", "package", "COMPENSATED", "compensated")
    assert told(record.event, None) == "compensated"


@pytest.mark.parametrize("ended, status", [("compensated", "COMPENSATED"), ("failed", "COMPENSATION_FAILED")])
def test_a_failure_read_after_its_compensation_ended_tells_the_outcome(ended: str, status: str) -> None:
    outcome = run(supervisor.service, failure("NO_DRONE_FITS", "drone", ["package"]),
                  topic=supervisor.watched().failed_topic, answers={"mark_compensating": json.dumps({"told": ended}),
                                                                    "pool_release": ""})
    [record] = [e.event for e in outcome.emitted if isinstance(e.event, CompensationRecord)]
    assert isinstance(record, CompensationRecord)
    assert (record.step, record.status, record.outcome, record.undone) == ("package", status, ended, ["package"])


def test_an_answer_remembered_by_the_version_before_reads_as_nothing_told() -> None:
    """'compensated:<before>:<attempt>:<next>:<reason>', remembered before the told outcome
    was appended, and replayed now: the reason stays whole, nothing is told."""
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:compensating:1::NO_DRONE_FITS: no drone carries 99.0 kg"})
    [record] = [e.event for e in outcome.emitted if isinstance(e.event, CompensationRecord)]
    assert isinstance(record, CompensationRecord)
    assert (record.status, record.outcome, record.undone) == ("COMPENSATED", "", [])


def test_an_undo_seen_before_its_request_logs_the_request_first() -> None:
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:completed:1::"})
    assert log_of(outcome) == [("package", "COMPENSATING", 1), ("package", "COMPENSATED", 1)]


def test_an_undo_after_its_alert_says_the_alert_may_close() -> None:
    outcome = run(supervisor.service, cancelled(), topic=supervisor.topic("package.cancelled"),
                  answers={"mark_compensated": "compensated:compensation_failed:2::"})
    assert log_of(outcome) == [("package", "COMPENSATED", 2)]
    assert [(log.level, log.event) for log in outcome.logs] == [("warning", "compensation.recovered")]


def test_an_undo_already_logged_logs_nothing() -> None:
    released = DroneReleased(delivery_id="d-1", drone_id="drone-7", released_at=NOW)
    outcome = run(supervisor.service, released, topic=supervisor.topic("drone.released"),
                  answers={"mark_compensated": "ignored:compensated"})
    assert outcome.effects[0].args[0] == "drone"
    assert outcome.emitted == []


def decision(step: str, action: str = "DONE_BY_HAND") -> UndoByOperator:
    return UndoByOperator(delivery_id="d-1", step=step, action=action, note="done in the warehouse", by="op",
                          decided_at=NOW)


def test_an_undo_marked_done_by_hand_goes_on_with_the_chain() -> None:
    """The package's undo failed for good; the operator cancelled it by hand: the step is
    compensated from compensation_failed alone, and the drone's undo is asked next."""
    outcome = run(supervisor.service, decision("package"), topic=supervisor.topic(UndoByOperator.topic),
                  answers={"mark_compensated": "compensated:compensation_failed:2:drone:NO_PACKAGE: x\x1f\x1f"})
    [mark] = outcome.effects  # the package's service holds nothing in a pool
    # the state's retention, which it has again once the step leaves compensation_failed
    assert (mark.name, mark.args[0], mark.args[2:]) == ("mark_compensated", "package",
                                                        ("compensation_failed", 3600, "d-1|package"))
    assert log_of(outcome) == [("package", "COMPENSATED", 2)]
    assert [step for _, step, _, _ in undos_of(outcome)] == ["drone"]
    assert ("warning", "compensation.marked_by_hand") in [(log.level, log.event) for log in outcome.logs]


def test_a_drone_undo_marked_done_by_hand_gives_the_drone_back() -> None:
    outcome = run(supervisor.service, decision("drone"), topic=supervisor.topic(UndoByOperator.topic),
                  answers={"mark_compensated": "compensated:compensation_failed:1::", "pool_release": "drone-7"})
    _, give_back = outcome.effects
    assert give_back.matches(fleet.release("d-1", "by_hand"))
    assert log_of(outcome) == [("drone", "COMPENSATED", 1)] and undos_of(outcome) == []


def test_a_mark_by_hand_of_a_field_that_is_no_step_asks_nothing_of_the_state() -> None:
    """The state table's hash holds plain fields beside the steps' records: a mark naming
    one (``outcome``) must never reach the script, which would read it as a step record."""
    outcome = run(supervisor.service, decision("outcome"), topic=supervisor.topic(UndoByOperator.topic))
    assert outcome.effects == [] and outcome.emitted == []
    assert ("warning", "compensation.operator_ignored") in [(log.level, log.event) for log in outcome.logs]


def test_a_mark_by_hand_of_a_step_not_compensation_failed_changes_nothing() -> None:
    outcome = run(supervisor.service, decision("drone"), topic=supervisor.topic(UndoByOperator.topic),
                  answers={"mark_compensated": "ignored:compensating"})
    assert [effect.name for effect in outcome.effects] == ["mark_compensated"]
    assert outcome.emitted == []
    assert ("warning", "compensation.operator_ignored") in [(log.level, log.event) for log in outcome.logs]


def test_an_undo_asked_again_by_an_operator_is_a_new_attempt_of_the_same_request() -> None:
    """A request of its own (its service runs it afresh, with a new call id for its remote),
    at the new attempt its undo step waits for, and a compensation record of its own."""
    outcome = run(supervisor.service, decision("package", "ASK_AGAIN"), topic=supervisor.topic(UndoByOperator.topic),
                  answers={"ask_undo_again": "asked:4:NO_DRONE: x"})
    [ask] = outcome.effects
    assert (ask.name, ask.args[:2]) == ("ask_undo_again", ("package", "cancel_package"))
    assert log_of(outcome) == [("package", "COMPENSATING", 4)]
    assert outcome.emitted[0].event_id == derived_id("d-1", "package", "COMPENSATING", "again", "4")
    [request] = [e for e in outcome.emitted if isinstance(e.event, UndoRequested)]
    assert (request.topic, request.event_id, request.attempt) == (
        supervisor.topic(undo_topic("package")), derived_id("d-1", "undo", "package", "again", "4"), 4)
    assert request.event.reason == "NO_DRONE: x"


def test_an_undo_asked_again_of_a_step_not_compensation_failed_asks_nothing() -> None:
    outcome = run(supervisor.service, decision("drone", "ASK_AGAIN"), topic=supervisor.topic(UndoByOperator.topic),
                  answers={"ask_undo_again": "ignored:compensated"})
    assert outcome.emitted == [] and undos_of(outcome) == []


def test_a_shipment_awaits_the_release_of_its_delivery_at_its_position_and_its_drone_comes_back() -> None:
    """One effect on one node: the record for the release and the fleet's give-back."""
    shipped = DeliveryShipped(delivery_id="d-1", package_id="p-1", drone_id="drone-7", shipped_at=NOW)
    outcome = run(supervisor.service, shipped, topic=supervisor.watched().shipped_topic, partition=3, offset=42,
                  answers={"await_release": "awaiting"})
    [awaiting] = outcome.effects
    assert (awaiting.name, awaiting.keys, awaiting.args) == (
        "await_release", (awaiting_key(supervisor.watched().shipped_topic, 3), *fleet.give_back_keys), (42, "d-1"))
    assert outcome.emitted == []


def test_on_a_redis_cluster_the_drone_comes_back_in_an_effect_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet's keys are in a slot of their own there: no script may take them with the
    release set."""
    monkeypatch.setattr(supervisor, "is_cluster", lambda client: True)
    shipped = DeliveryShipped(delivery_id="d-1", package_id="p-1", drone_id="drone-7", shipped_at=NOW)
    outcome = run(supervisor.service, shipped, topic=supervisor.watched().shipped_topic, partition=3, offset=42,
                  answers={"await_release": "awaiting", "pool_release": "drone-7"})
    awaiting, back = outcome.effects
    assert (awaiting.name, awaiting.keys) == ("await_release", (awaiting_key(supervisor.watched().shipped_topic, 3),))
    assert back.matches(fleet.release("d-1", "return"))
    assert outcome.emitted == [] and outcome.error is None


def test_a_report_needs_the_state_table_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "_runtime", None)
    report = StepReport(delivery_id="d-1", step="drone", kind="FAILED", attempt=1, service="drone-scheduler",
                        source_topic="delivery.requested", source_event_id="e-1", error="boom",
                        reported_at=NOW)
    with pytest.raises(HarnessError, match="ctx.redis"):
        run(supervisor.service, report, topic="recovery")


def test_an_undo_failure_written_again_has_the_first_ones_ids_and_raises_no_second_alert() -> None:
    """The scan writes an undo's failure record again while its first transaction is not
    known committed: the same record under the same id, watched the same way, alerted once."""
    data = {"target": "drone", "before": "compensating", "attempt": 1, "tries": 6, "detail": "refused",
            "told": "", "undone": "drone"}
    alerts = REGISTRY.get_sample_value("choreo_supervisor_compensation_failures_total", {"step": "drone"}) or 0.0
    runs = []
    for kind in ("comp_failed", "comp_failed_again"):
        ctx = Context("supervisor", Envelope.first("tick", "", "Tick", "supervisor"), "", -1, -1,
                      None, get_logger(), periodic=True)  # type: ignore[arg-type]
        recorded: list[Unrecorded] = []
        action = Action(kind, "d-1", "release_drone", dict(data))
        supervisor._carry_out(ctx, None, action, recorded)  # type: ignore[arg-type]
        runs.append(([(e.topic, e.event_id, e.event.status) for e in ctx.emitted], recorded))
    assert runs[0] == runs[1]
    assert [status for _, _, status in runs[0][0]] == ["COMPENSATION_FAILED"]
    assert runs[0][1] == [Unrecorded("d-1", "drone", "release_drone", 1)]
    assert REGISTRY.get_sample_value("choreo_supervisor_compensation_failures_total", {"step": "drone"}) == alerts + 1
