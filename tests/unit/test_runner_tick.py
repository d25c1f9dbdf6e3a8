"""A periodic task's outputs when its transaction aborts (``Runner._tick``), with Kafka's
producer faked: its Redis writes stand, so its outputs are sent again before the next ticks,
in a transaction of their own, and given up after a bound."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import REGISTRY

from choreo import metrics, runner as runner_module
from choreo.runner import Runner

SERVICE = "tick-test"


class _Producer:
    """Commits what was produced in the transaction, or refuses the next ``refusals``
    commits (a non-retriable error: the transaction aborts); never takes ``poison``."""

    def __init__(self, refusals: int = 0, poison: str = "") -> None:
        self.refusals, self.poison = refusals, poison
        self.pending: list[str] = []
        self.committed: list[list[str]] = []
        self.aborts = 0

    def begin_transaction(self) -> None:
        self.pending = []

    def produce(self, emitted: Any, _: Any) -> None:
        if emitted.event_id == self.poison:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        self.pending.append(emitted.event_id)

    def commit_transaction(self, *_: Any) -> None:
        if self.refusals:
            self.refusals -= 1
            raise KafkaException(KafkaError(KafkaError.INVALID_TXN_STATE))
        self.committed.append(self.pending)

    def abort_transaction(self, *_: Any) -> None:
        self.aborts += 1


def _runner(producer: _Producer) -> Any:
    runner: Any = object.__new__(Runner)
    runner.service = SimpleNamespace(name=SERVICE)
    runner.log = SimpleNamespace(warning=lambda *a, **k: None, info=lambda *a, **k: None,
                                 error=lambda *a, **k: None)
    runner.redis = None
    runner.producer = producer
    runner.consumer = SimpleNamespace(assignment=lambda: [TopicPartition("t", 0)])
    runner._unsent = []
    runner._open_steps = lambda outputs: None
    runner._produce = producer.produce
    return runner


def _task(*ids: str) -> Any:
    """A periodic task that emits an output of each id."""
    return SimpleNamespace(fn=lambda ctx: ctx.emitted.extend(SimpleNamespace(event_id=i) for i in ids))


def _dropped() -> float:
    metrics.child(metrics.TICK_OUTPUTS_DROPPED, SERVICE)
    value = REGISTRY.get_sample_value("choreo_tick_outputs_dropped_total", {"service": SERVICE})
    assert value is not None
    return value


def test_the_outputs_of_an_aborted_tick_go_again_before_the_next_ticks_own() -> None:
    producer = _Producer(refusals=1)
    runner = _runner(producer)
    runner._tick(_task("requeue-1", "compensation-failed-1"))
    assert producer.committed == [] and producer.aborts == 1
    runner._tick(_task("requeue-2"))
    assert producer.committed == [["requeue-1", "compensation-failed-1"], ["requeue-2"]]
    runner._tick(_task())
    assert producer.committed[2:] == [[]]  # nothing is sent a third time


def test_an_output_kafka_never_takes_holds_no_tick_back_and_is_given_up() -> None:
    producer = _Producer(poison="too-large")
    runner = _runner(producer)
    before = _dropped()
    runner._tick(_task("too-large", "fine"))  # its own transaction: aborted
    for n in range(runner_module.UNSENT_TRIES):
        runner._tick(_task(f"own-{n}"))
        assert producer.committed[-1] == [f"own-{n}"]  # each tick's own outputs go
    # sent again with the first tick's other output until the bound, never after
    assert producer.aborts == 1 + runner_module.UNSENT_TRIES
    assert "fine" not in [i for batch in producer.committed for i in batch]
    assert runner._unsent == [] and _dropped() == before + 2
    runner._tick(_task("last"))
    assert producer.committed[-1] == ["last"] and producer.aborts == 1 + runner_module.UNSENT_TRIES


def test_at_most_so_many_outputs_wait_the_newest_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "MAX_UNSENT", 3)
    producer = _Producer(refusals=1)
    runner = _runner(producer)
    before = _dropped()
    runner._tick(_task("a", "b", "c", "d", "e"))
    assert [emitted.event_id for emitted, _ in runner._unsent] == ["c", "d", "e"]
    assert _dropped() == before + 2
    runner._tick(_task())
    assert producer.committed[0] == ["c", "d", "e"]
