"""How a batch's offsets are committed (``Runner._process``), with Kafka's clients faked: in
the transaction when the batch wrote a record, plainly when it wrote none; a plain commit
that fails rewinds the batch without counting an aborted transaction (the consumer's errors
carry no retriable flag: librdkafka retried already). And when a periodic task's
``after_commit`` runs (``Runner._tick``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import REGISTRY

from choreo import metrics
from choreo.envelope import Envelope
from choreo.runner import BATCH_MAX_BYTES, Runner
from choreo.service import Context
from tests.factories import KafkaMessage


class _Producer:
    """librdkafka's transactional state as far as a batch sees it: an abort outside a
    transaction is refused with a non-fatal state error."""

    def __init__(self, writes: bool) -> None:
        self.writes = writes
        self.wrote = False
        self.calls: list[str] = []
        self.open = False

    def begin_transaction(self) -> None:
        self.calls.append("begin")
        self.open, self.wrote = True, self.writes

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], *_: Any) -> None:
        self.calls.append(f"send_offsets {[(tp.topic, tp.partition, tp.offset) for tp in offsets]}")

    def commit_transaction(self, *_: Any) -> None:
        self.calls.append("commit")
        self.open = False

    def abort_transaction(self, *_: Any) -> None:
        if not self.open:
            raise KafkaException(KafkaError(KafkaError._STATE))
        self.calls.append("abort")
        self.open = False


class _Consumer:
    """Refuses its first plain commit with ``error``, if given, then accepts."""

    def __init__(self, error: KafkaError | None = None) -> None:
        self.error = error
        self.tries = 0
        self.commits: list[list[tuple[str, int, int]]] = []
        self.seeks: list[tuple[str, int, int]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous is False
        self.tries += 1
        error, self.error = self.error, None
        if error is not None:
            raise KafkaException(error)
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])

    def consumer_group_metadata(self) -> str:
        return "group metadata"

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition("t", 0)]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))


SERVICE = "commit-test"


def _sample(name: str, **labels: str) -> float:
    """A sample's value now; its child must exist (``_touch``), so a misspelt name fails."""
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, f"no sample {name} {labels}"
    return value


def _touch() -> None:
    """Create the children the tests read, so each reads 0 before its first count."""
    metrics.child(metrics.TXN_ABORTS, SERVICE)
    metrics.child(metrics.OFFSET_COMMIT_REFUSALS, SERVICE)
    metrics.child(metrics.OFFSET_COMMITS, SERVICE, "plain")
    metrics.child(metrics.BATCH_SIZE, SERVICE)


def _runner(producer: _Producer, consumer: _Consumer) -> Any:
    runner: Any = object.__new__(Runner)
    runner.service = SimpleNamespace(name=SERVICE)
    runner.log = SimpleNamespace(warning=lambda *a, **k: None, info=lambda *a, **k: None,
                                 error=lambda *a, **k: None)
    runner._dead_lettered = set()
    runner.state = SimpleNamespace(note_dead_letters=lambda ids: None)
    runner._prepare = lambda message, envelope: None
    runner._begin_all = lambda taken: []
    runner._run_all = lambda work: []
    runner._finish_all = lambda done: None
    runner.producer, runner.consumer = producer, consumer
    return runner


@pytest.mark.parametrize("writes", [True, False])
def test_the_offsets_go_in_the_transaction_only_when_the_batch_wrote_a_record(writes: bool) -> None:
    producer, consumer = _Producer(writes), _Consumer()
    _runner(producer, consumer)._process([KafkaMessage(5), KafkaMessage(6)])
    if writes:
        assert producer.calls == ["begin", "send_offsets [('t', 0, 7)]", "commit"]
        assert consumer.commits == []
    else:  # the empty transaction ends (locally, in librdkafka), then one plain commit
        assert producer.calls == ["begin", "commit"]
        assert consumer.commits == [[("t", 0, 7)]]
    assert consumer.seeks == []


@pytest.mark.parametrize("refusal", [KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
                                     KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REQUEST_TIMED_OUT])
def test_a_refused_plain_commit_rewinds_the_batch_and_leaves_the_producer_ready(refusal: int) -> None:
    producer, consumer = _Producer(False), _Consumer(KafkaError(refusal))
    runner = _runner(producer, consumer)
    _touch()
    aborts = _sample("choreo_transaction_aborts_total", service=SERVICE)
    refusals = _sample("choreo_offset_commit_refusals_total", service=SERVICE)
    plain = _sample("choreo_offset_commits_total", service=SERVICE, how="plain")
    batches = _sample("choreo_batch_size_count", service=SERVICE)
    runner._process([KafkaMessage(5), KafkaMessage(6)])
    assert consumer.tries == 1  # librdkafka retried what it could: no second try here
    assert consumer.seeks == [("t", 0, 5)]  # read again, here or by the partition's new owner
    assert consumer.commits == [] and not producer.open
    # no transaction was open to abort, and the batch is not done: counted as what it is
    assert _sample("choreo_transaction_aborts_total", service=SERVICE) == aborts
    assert _sample("choreo_offset_commit_refusals_total", service=SERVICE) == refusals + 1
    assert _sample("choreo_offset_commits_total", service=SERVICE, how="plain") == plain
    assert _sample("choreo_batch_size_count", service=SERVICE) == batches
    runner._process([KafkaMessage(5), KafkaMessage(6)])  # the next batch begins a transaction as usual
    assert producer.calls == ["begin", "commit", "begin", "commit"]
    assert consumer.commits == [[("t", 0, 7)]]
    assert _sample("choreo_offset_commits_total", service=SERVICE, how="plain") == plain + 1
    assert _sample("choreo_batch_size_count", service=SERVICE) == batches + 1


def test_a_fatal_consumer_error_on_a_plain_commit_stops_the_service() -> None:
    producer, consumer = _Producer(False), _Consumer(KafkaError(KafkaError._FATAL))
    with pytest.raises(SystemExit, match="fatal Kafka error"):
        _runner(producer, consumer)._process([KafkaMessage(5), KafkaMessage(6)])
    assert consumer.seeks == []


def _ticked(producer: _Producer) -> list[str]:
    """What a periodic task's ``after_commit`` saw of the producer when it ran."""
    seen: list[str] = []
    runner = _runner(producer, _Consumer())
    runner.redis, runner._open_steps = None, lambda emitted: None
    runner._tick(SimpleNamespace(fn=lambda ctx: ctx.after_commit(lambda: seen.append(producer.calls[-1]))))
    return seen


def test_a_ticks_after_commit_runs_once_its_transaction_committed_and_never_after_an_abort() -> None:
    assert _ticked(_Producer(True)) == ["commit"]
    refused = _Producer(True)

    def refuse(*_: Any) -> None:
        refused.calls.append("commit refused")
        raise KafkaException(KafkaError(KafkaError.INVALID_TXN_STATE))

    refused.commit_transaction = refuse  # type: ignore[method-assign]
    assert _ticked(refused) == [] and refused.calls == ["begin", "commit refused", "abort"]


def test_only_a_periodic_task_may_wait_for_its_commit() -> None:
    """A handler's input is read again after an abort; nothing would call its hook."""
    ctx = Context("s", Envelope.first("e", "d", "T", "s"), "t", 0, 5, None, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="periodic"):
        ctx.after_commit(lambda: None)


class _Sized:
    def __init__(self, partition: int, offset: int, size: int) -> None:
        self._partition, self._offset, self._size = partition, offset, size

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return b"v" * self._size

    def key(self) -> bytes:
        return b"k"


def test_a_batch_ends_at_its_bytes_and_the_rest_is_read_again() -> None:
    """Records each just under what a consumer takes, up to a full batch, decode for minutes
    (a microsecond a byte for an array of empty strings): past the poll interval the member
    leaves its group and the batch is read again, by each member in turn."""
    consumer = _Consumer()
    consumer.assignment = lambda: [TopicPartition("t", 0), TopicPartition("t", 1)]  # type: ignore[method-assign]
    runner = _runner(_Producer(False), consumer)
    big = 500_000
    messages = [_Sized(0, 10, big), _Sized(1, 3, 100), *[_Sized(0, 11 + i, big) for i in range(9)], _Sized(1, 4, 100)]
    kept = runner._within_budget(messages)
    assert [(m.partition(), m.offset()) for m in kept] == [(0, 10), (1, 3), *[(0, 11 + i) for i in range(7)]]
    assert sum(len(m.value()) for m in kept) <= BATCH_MAX_BYTES
    assert sorted(consumer.seeks) == [("t", 0, 18), ("t", 1, 4)]
    huge = [_Sized(0, 1, 10 * BATCH_MAX_BYTES), _Sized(0, 2, 1)]  # the first goes whatever its size
    assert [m.offset() for m in runner._within_budget(huge)] == [1]
    assert runner._within_budget(messages[1:2]) == messages[1:2]
