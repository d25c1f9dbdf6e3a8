"""The registry's only store: one compacted, single-partition Kafka topic.

One partition gives one total order, which is what makes "next id = highest id + 1" and
"next version = highest version + 1" safe to derive from the replayed log. The reader uses
``read_committed`` so a write is applied only once its transaction committed, and every
acknowledged write is first durable (acks=all, idempotent, committed) and then waited for
until the reader applied it: a read right after a write, on this instance, sees it.

Writes go through a transactional producer with one fixed ``transactional.id`` per topic.
That is the safety half of single-writer (see ``leader.py`` for the routing half): when a
new writer calls ``init_transactions`` the broker bumps the producer epoch, aborts whatever
the previous writer left open and rejects every later commit from it, so a paused or
partitioned ex-leader cannot append a record computed from a stale view. After each
``init_transactions`` the writer first reads to the end of the log, so its own view is
complete before it computes anything.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from choreo.kafka import base_config
from choreo.logs import get_logger
from registry import errors
from registry.state import Record, State

log = get_logger(component="registry.store")


_SETTLING = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError.NOT_LEADER_FOR_PARTITION,
                       KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART})


class KafkaStore:
    """Owns the reader thread and the (lazily created) transactional writer."""

    def __init__(self, bootstrap: str, topic: str, state: State, timeout_s: float = 30.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.state = state
        self.timeout_s = timeout_s
        self._partition = TopicPartition(topic, 0)
        self._applied = threading.Condition()
        self._position = 0  # next offset the reader will look at (records before it are applied)
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._reader_error: str | None = None
        self._producer: Producer | None = None

    # -- topic ------------------------------------------------------------------------

    def ensure_topic(self) -> None:
        """Create the store topic when missing: 1 partition, compacted, broker-default replication."""
        admin = AdminClient(base_config(self.bootstrap))
        metadata = admin.list_topics(timeout=self.timeout_s)
        if self.topic in metadata.topics:
            partitions = len(metadata.topics[self.topic].partitions)
            if partitions != 1:
                raise RuntimeError(f"store topic {self.topic} has {partitions} partitions; it must have 1")
            return
        topic = NewTopic(self.topic, num_partitions=1, replication_factor=-1,
                         config={"cleanup.policy": "compact", "min.compaction.lag.ms": "0"})
        for future in admin.create_topics([topic], request_timeout=self.timeout_s).values():
            try:
                future.result(timeout=self.timeout_s)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
        log.info("store_topic_created", topic=self.topic)

    # -- reading ----------------------------------------------------------------------

    def start(self) -> None:
        consumer = Consumer({
            **base_config(self.bootstrap),
            "group.id": f"schema-registry-reader-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "fetch.wait.max.ms": 50,
        })
        consumer.assign([TopicPartition(self.topic, 0, 0)])
        self._reader = threading.Thread(target=self._read, args=(consumer,), name="registry-reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._producer is not None:
            self._producer.flush(5)

    def _read(self, consumer: Consumer) -> None:
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.2)
                if msg is None:
                    continue
                self._handle(msg)
        except Exception as exc:  # the thread must say why it died; readiness then fails
            self._reader_error = repr(exc)
            log.error("reader_failed", error=repr(exc))
        finally:
            consumer.close()

    def _handle(self, msg: Message) -> None:
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                self._advance(msg.offset())
            elif err.fatal():
                raise KafkaException(err)
            else:
                log.warning("reader_error", error=str(err))
            return
        offset = msg.offset() or 0
        if not self.state.apply(msg.key(), msg.value()):  # malformed: skipped, the reader goes on
            log.warning("record_skipped", offset=offset, reason=self.state.last_skipped,
                        skipped=self.state.skipped)
        self._advance(offset + 1)

    def _advance(self, position: int | None) -> None:
        if position is None:
            return
        with self._applied:
            if position > self._position:
                self._position = position
                self._applied.notify_all()

    @property
    def position(self) -> int:
        return self._position

    def wait_position(self, position: int, timeout_s: float | None = None) -> bool:
        """Block until every record before ``position`` is applied (False on timeout)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._applied:
            while self._position < position:
                if self._reader_error is not None:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._applied.wait(min(left, 0.5))
        return True

    def end_offset(self) -> int:
        """The log's current end as a read_committed reader will reach it."""
        probe = Consumer({**base_config(self.bootstrap), "group.id": "schema-registry-probe",
                          "isolation.level": "read_committed", "enable.auto.commit": False})
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:
                    _, high = probe.get_watermark_offsets(self._partition, timeout=self.timeout_s,
                                                          cached=False)
                    return int(high)
                except KafkaException as exc:
                    # a broker just started, or a topic just created on a cluster: leadership
                    # and metadata are still settling
                    if (exc.args[0].code() not in _SETTLING or time.monotonic() > deadline):
                        raise
                    time.sleep(0.3)
        finally:
            probe.close()

    def catch_up(self, timeout_s: float | None = None) -> None:
        """Read to the end of the log as it is now; raises 50002 when that takes too long."""
        end = self.end_offset()
        if not self.wait_position(end, timeout_s):
            raise errors.operation_timeout(
                f"the store reader did not reach offset {end} of {self.topic} "
                f"(at {self._position}; {self._reader_error or 'still reading'})"
            )

    # -- writing ----------------------------------------------------------------------

    def prepare_writer(self) -> None:
        """Make sure we hold the current producer epoch and have read everything before it."""
        if self._producer is not None:
            return
        producer = Producer({
            **base_config(self.bootstrap),
            "transactional.id": f"schema-registry-{self.topic}",
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 0,
            "transaction.timeout.ms": 30000,
        })
        try:
            producer.init_transactions(self.timeout_s)
        except KafkaException as exc:
            raise errors.store_error(f"could not become the writer: {exc.args[0]}") from None
        self._producer = producer
        log.info("writer_initialized", topic=self.topic)
        self.catch_up()

    def append(self, records: Sequence[Record]) -> int:
        """Write ``records`` atomically; return once committed and applied (the last offset + 1)."""
        self.prepare_writer()
        producer = self._producer
        assert producer is not None
        offsets: list[int] = []
        failures: list[str] = []

        def delivered(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                failures.append(str(err))
            else:
                offsets.append(msg.offset() or 0)

        try:
            producer.begin_transaction()
            for key, value in records:
                producer.produce(self.topic, key=key, value=value, partition=0, on_delivery=delivered)
            producer.commit_transaction(self.timeout_s)
        except KafkaException as exc:
            self._after_failure(producer, exc.args[0])
            raise errors.store_error(str(exc.args[0])) from None
        if failures or len(offsets) != len(records):
            raise errors.store_error("; ".join(failures) or "delivery not confirmed")
        position = max(offsets) + 1
        if not self.wait_position(position):
            raise errors.operation_timeout("the write is durable but the reader has not applied it yet")
        return position

    def _after_failure(self, producer: Producer, err: KafkaError) -> None:
        """Abortable errors keep the producer; fatal ones (fenced) drop it so we re-init next time."""
        if err.txn_requires_abort():
            try:
                producer.abort_transaction(self.timeout_s)
                return
            except KafkaException:
                pass
        log.warning("writer_reset", error=str(err), fatal=err.fatal())
        try:
            producer.purge()  # nothing of a failed transaction may linger and be retried later
        except KafkaException:
            pass
        self._producer = None

    def drop_writer(self) -> None:
        """Forget the producer (on losing leadership): the next writer's init fences it anyway."""
        self._producer = None
