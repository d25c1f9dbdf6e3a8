"""Whose state a dead letter keeps for a redrive: the runtime (``Runner._dead_letter``) and
rebuild-state (``Rebuilder._fact``) must name the same delivery, or none, for the same
letter, or a rebuilt Redis would hold a delivery back from its release that the runtime let
go (or the other way round). The letter is the one the runtime writes, read back as the
rebuild reads a record; Kafka's clients are faked."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis

from choreo.envelope import H_CORRELATION_ID, H_EVENT_ID, Envelope
from choreo.errors import DeadLetterReason
from choreo.ops.rebuild import Rebuilder
from choreo.ops.records import Rec
from choreo.runner import RECOVERY_TOPIC, Runner, dlq_topic
from consumers.workflow import WORKFLOW
from tests.factories import KafkaMessage

Headers = list[tuple[str, bytes | None]]


def _message(topic: str, headers: Headers, key: bytes = b"d-key") -> KafkaMessage:
    return KafkaMessage(5, topic=topic, key=key, value=b"\x00body", headers=headers, timestamp_ms=1_800_000_000_000)


class _Producer:
    def __init__(self) -> None:
        self.letters: list[KafkaMessage] = []

    def produce(self, topic: str, key: bytes, value: bytes, headers: Headers) -> None:
        self.letters.append(_message(topic, headers, key))


def _runner(producer: _Producer) -> Any:
    runner: Any = object.__new__(Runner)
    runner.service = SimpleNamespace(name="notifier", handlers={})
    runner.log = SimpleNamespace(warning=lambda *a, **k: None)
    runner._dead_lettered = set()
    runner.producer = producer
    return runner


def _usable() -> Headers:
    envelope = Envelope.first("e-1", "d-1", "DeliveryShipped", "delivery")
    return [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in envelope.to_headers()]


CASES: dict[str, tuple[Headers, set[str]]] = {
    "a usable envelope": (_usable(), {"d-1"}),
    "no event id": ([(H_CORRELATION_ID, b"d-1")], set()),
    "no correlation header, a key": ([(H_EVENT_ID, b"e-1")], set()),
    # the incoming record was unusable for this header alone: the letter drops it, so a
    # redrive sends a usable envelope, and its delivery's state must wait for it
    "a malformed dlq.* header": ([*_usable(), ("dlq.forged", b"\xff\xfe")], {"d-1"}),
    # a header without a value is absent to the envelope: the first value counts
    "a second correlation header without a value": ([*_usable(), (H_CORRELATION_ID, None)], {"d-1"}),
}


@pytest.mark.parametrize("topic", ["delivery.shipped", RECOVERY_TOPIC])  # a workflow topic, a runtime one
@pytest.mark.parametrize("case", CASES)
def test_the_runtime_and_the_rebuild_keep_the_same_delivery_for_a_dead_letter(case: str, topic: str) -> None:
    headers, kept = CASES[case]
    producer = _Producer()
    runner = _runner(producer)
    runner._dead_letter(_message(topic, headers), DeadLetterReason.MISSING_HEADERS, "unusable")
    assert runner._dead_lettered == kept

    rebuilder = Rebuilder(WORKFLOW, redis.Redis())  # no call reaches Redis in _fact
    [letter] = producer.letters
    rebuilder._fact(Rec.of(letter), {})  # type: ignore[arg-type]
    counted = {d for d, facts in rebuilder.facts.items() if facts.dead_letters} | set(rebuilder.side_dead_letters)
    assert counted == kept
    # whoever it is kept for, the rebuild knows the letter's event was dead-lettered
    assert rebuilder.dead_lettered == {("notifier", f"{topic}|0|5")}


def test_a_letter_the_runtime_did_not_write_keeps_no_delivery_s_state() -> None:
    # a usable envelope written straight to a dead-letter topic, without the runtime's dlq.*
    # headers: the redrive refuses it as untrusted, so nothing waits for it
    rebuilder = Rebuilder(WORKFLOW, redis.Redis())
    rebuilder._fact(Rec.of(_message(dlq_topic("delivery.shipped"), _usable())), {})  # type: ignore[arg-type]
    assert not rebuilder.facts and not rebuilder.side_dead_letters and not rebuilder.dead_lettered
