"""The reply topic travels in the envelope; only a topic the policy allows receives outcomes."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from choreo.envelope import Envelope
from choreo.outcomes import ReplyTopics, outcome_of, refusal, told, told_in_state
from choreo.runtime_events import CompensationRecord
from choreo.supervision import KeyedCompensationRecord
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryFailed, DeliveryShipped


def test_reply_topic_and_owner_travel_to_every_later_hop() -> None:
    first = Envelope.first("e1", "d1", "DeliveryRequested", "ingestion", reply_to="replies.acme", owner="acme")
    hop = first.child("e2", "PackageReady", "package").child("e3", "DeliveryShipped", "delivery")
    assert (hop.reply_to, hop.owner) == ("replies.acme", "acme")
    parsed = Envelope.from_headers(hop.to_headers())
    assert parsed is not None and (parsed.reply_to, parsed.owner) == ("replies.acme", "acme")


def test_an_envelope_without_reply_topic_writes_no_such_header() -> None:
    headers = dict(Envelope.first("e1", "d1", "X", "p").to_headers())
    assert "reply_to" not in headers and "owner_id" not in headers


@pytest.mark.parametrize("topic", [
    "delivery.shipped", "recovery", "__consumer_offsets", "replies.", "acme.replies",
    "replies.a b", "replies." + "x" * 250, "replies.ü",
])
def test_topics_outside_the_prefix_or_illegal_are_refused(topic: str) -> None:
    assert refusal(topic, "replies.") is not None


def test_an_allowed_topic_must_also_exist_and_is_asked_about_once() -> None:
    asked: list[str] = []

    def exists(topic: str) -> bool:
        asked.append(topic)
        return topic == "replies.there"

    topics = ReplyTopics(exists, "replies.")
    assert topics.refusal("replies.there") is None
    assert topics.refusal("replies.missing") is not None
    assert topics.refusal("replies.there") is None and topics.refusal("delivery.failed") is not None
    assert asked == ["replies.there", "replies.missing"]  # remembered; a refused name never asked


def test_the_outcome_of_a_failure_names_its_reason_and_undos() -> None:
    failed = DeliveryFailed(delivery_id="d1", reason="NO_DRONE", detail="x", failed_step="drone",
                            compensate=["package"], failed_at=datetime.now(UTC))
    env = Envelope.first("e9", "d1", "DeliveryFailed", "delivery")
    out = outcome_of(failed, "failed", env)
    assert (out.delivery_id, out.outcome, out.reason, out.compensate, out.event_id) == (
        "d1", "failed", "NO_DRONE", ["package"], "e9")
    assert out.trace_id == env.trace_id


def failure(compensate: list[str]) -> DeliveryFailed:
    return DeliveryFailed(delivery_id="d1", reason="NO_DRONE", detail="x", failed_step="drone",
                          compensate=compensate, failed_at=datetime.now(UTC))


def test_a_failure_tells_failed_at_once_only_when_it_leaves_nothing_to_undo() -> None:
    assert told(failure([]), WORKFLOW) == "failed"
    assert told(failure(["delivery"]), WORKFLOW) == "failed"  # no compensation declared for it
    assert told(failure(["package"]), WORKFLOW) is None  # told when its compensation ends
    shipped = DeliveryShipped(delivery_id="d1", package_id="p", drone_id="x", shipped_at=datetime.now(UTC))
    assert told(shipped, WORKFLOW) == "shipped"


def test_only_the_compensation_record_that_ends_it_tells_an_outcome() -> None:
    def record(status: str, outcome: str = "") -> KeyedCompensationRecord:
        return KeyedCompensationRecord.model_validate({  # keyed by delivery and step, as logged
            "delivery_id": "d1", "step": "package", "status": status, "attempt": 1,
            "reason": "NO_DRONE: drone step failed", "recorded_at": datetime.now(UTC),
            "outcome": outcome, "undone": ["drone", "package"] if outcome else []})

    assert told(record("COMPENSATING"), WORKFLOW) is None and told(record("COMPENSATED"), WORKFLOW) is None
    ended = record("COMPENSATED", "compensated")
    assert told(ended, WORKFLOW) == "compensated"
    out = outcome_of(ended, "compensated", Envelope.first("e9", "d1", "CompensationRecord", "supervisor"))
    assert (out.delivery_id, out.outcome, out.reason, out.compensate, out.event_type) == (
        "d1", "compensated", "NO_DRONE", ["drone", "package"], "CompensationRecord")
    out = outcome_of(record("COMPENSATION_FAILED", "failed"), "failed", Envelope.first("e8", "d1", "X", "s"))
    assert (out.outcome, out.reason) == ("failed", "COMPENSATION_FAILED")


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"outcome": "shipped"}, "shipped"),
    ({"outcome": "failed"}, None),  # the supervisor has not read it yet
    ({"outcome": "failed", "fail.seen": "1", "undo.order": ""}, "failed"),  # nothing to undo
    ({"outcome": "failed", "fail.seen": "1", "undo.order": "package"}, None),  # compensating
    ({"outcome": "failed", "fail.seen": "1", "undo.order": "package", "outcome.told": "compensated"}, "compensated"),
])
def test_the_state_tells_a_failure_once_its_compensation_is_settled(fields: dict[str, str], expected: str | None) -> None:
    assert told_in_state(fields) == expected
