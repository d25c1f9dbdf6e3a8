"""Reading bounded ranges of topics: the one reader every ops command shares.

A range is resolved per partition from offsets or from times (``offsets_for_times``) into
``[start, end)``, then read as a ``read_committed`` client with no group commits, so reading
never moves anyone's offsets. With ``read_committed`` the last offsets of a partition may be
transaction markers that are never delivered, so a partition is done when the consumer's
*position* reaches its end, not when a message at ``end - 1`` arrives.
"""

from __future__ import annotations

import io
import math
import re
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from datetime import time as dt_time
from functools import cached_property, partial
from typing import Any, NoReturn

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from fastavro import schemaless_reader

from choreo.kafka import base_config, headers_if_readable
from choreo.envelope import Envelope, header_value, pairs
from choreo.errors import DeadLetterReason
from choreo.serde import (MAGIC_BYTE, DecodeFailure, RegistryDenied, RegistryUnavailable, WriterSchemas,
                          bounded_writer, not_registered_under, registry_client, schema_id_of)

Progress = Callable[[int], None]
MAX_DENIAL_SUBJECTS = 64  # subjects a body decoder remembers denied ids' refusals for (the oldest out)
# how long a consume waits to fill its batch: a read's last batch always waits it out (its
# span ends where nothing more comes), once per read, and the rebuild reads once per partition
BATCH_WAIT_S = 0.02
# what one consume hands over at most, by the largest record the read has met: each
# message's key and value are Python bytes from the moment it is consumed, and within one
# wait the broker refills the prefetch queue as fast as the batch drains it (the largest so
# far, not the last batch's: small records between large ones would lift the bound again).
# Headers are not counted: reading them would build every record's header list
READ_BATCH_BYTES = 16 * 1024 * 1024
FIRST_BATCH = 16  # records of a read's first consume, before any size is known

_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)(?:\s+ago)?$")
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def shown_time(ms: int, with_date: bool = True) -> str:
    """Epoch milliseconds as ``[YYYY-MM-DD ]HH:MM:SS.mmm`` in UTC, or ``"-"`` for none; a time
    no date holds (a record's or a header's, as its writer set it) as its number: shown, not
    a stop."""
    if not ms:
        return "-"
    try:
        shown = datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f" if with_date else "%H:%M:%S.%f")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms"
    return shown[:-3]


EARLIEST_EPOCH_MS = 10**11  # 1973-03-03: a smaller number is a time in seconds
LATEST_EPOCH_MS = 253_402_300_799_999  # 9999-12-31: past it no date holds the time
CRC32_PARTITIONERS = ("consistent", "consistent_random")  # librdkafka's default
MURMUR2_PARTITIONERS = ("murmur2", "murmur2_random")  # Java clients'
PARTITIONERS = CRC32_PARTITIONERS + MURMUR2_PARTITIONERS


def parse_time(text: str, now_ms: int | None = None) -> int:
    """An operator's time as epoch ms: ISO 8601 (naive means UTC, the brokers' clock),
    epoch ms (``0``: the start of every log), ``now``, or relative (``-15m``, ``2h ago``).
    A number that would be a time before 1973 is refused: epoch seconds pasted as they are
    would select every record a topic holds."""
    ms = _epoch_ms(text.strip(), now_ms if now_ms is not None else int(time.time() * 1000))
    if not 0 <= ms <= LATEST_EPOCH_MS:  # a negative time is Kafka's "the end" or "the start"
        raise ValueError(f"{text.strip()[:20]} is not a time between 1970 and 9999")
    return ms


def _epoch_ms(text: str, now: int) -> int:
    if text == "now":
        return now
    if text.isascii() and text.isdigit():
        if len(text) > 20:
            return -1  # refused, as past year 9999
        if 0 < int(text) < EARLIEST_EPOCH_MS:
            raise ValueError(f"{text[:20]} is before 1973 as epoch milliseconds (epoch seconds?): "
                             "give milliseconds, an ISO 8601 time or -15m")
        return int(text)
    if _RELATIVE.match(text):
        ago = parse_duration(text)
        return now - ago if ago <= now else -1
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def parse_duration(text: str) -> int:
    """An operator's span of time (``15m``, ``-2h``, ``2h ago``) in ms, at most 9999 years."""
    relative = _RELATIVE.match(text.strip())
    if relative is None:
        raise ValueError(f"{text.strip()[:20]} is not a span of time such as 15m, 2h or 7d")
    ms = float(relative.group(1)) * _UNITS_MS[relative.group(2)]
    if ms > LATEST_EPOCH_MS:  # infinity too: 400 digits are a float's
        raise ValueError(f"{text.strip()[:20]} is longer than 9999 years")
    return int(ms)


def partition_for(key: bytes, partitions: int, partitioner: str = "consistent_random") -> int:
    """The partition a keyed record was produced to, computed without reading anything.

    The project's producers use librdkafka's default partitioner (``consistent_random``:
    CRC-32 of the key); Java clients and ``murmur2_random`` use murmur2. The trace must use
    the same function as the producers, so it is a parameter.
    """
    if partitioner in CRC32_PARTITIONERS:
        return zlib.crc32(key) % partitions
    if partitioner in MURMUR2_PARTITIONERS:
        return (murmur2(key) & 0x7FFFFFFF) % partitions
    raise ValueError(f"unknown partitioner {partitioner!r}")


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's default partitioner hash), as a signed 32-bit int."""
    m, r, mask = 0x5BD1E995, 24, 0xFFFFFFFF
    length = len(data)
    h = (0x9747B28C ^ length) & mask
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * m) & mask
        k ^= k >> r
        k = (k * m) & mask
        h = (h * m) & mask
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


@dataclass(frozen=True)
class Span:
    """One partition's offsets to read: ``[start, end)``."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


@dataclass
class Rec:
    """One record as read, with its envelope parsed on demand."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    cut_bytes: int = 0  # its value's size, when a scan did not keep the value (``trace.Keeping``)

    @classmethod
    def of(cls, message: Message) -> Rec:
        _, ts = message.timestamp()
        # a header without a value is left out: the services' envelope reads it as absent, and
        # an empty value in its place would be a header's last value (``header_value``)
        return cls(message.topic() or "", message.partition() or 0, message.offset() or 0, ts,
                   message.key(), message.value(),
                   [(k, v if isinstance(v, bytes) else v.encode()) for k, v in pairs(headers_if_readable(message))
                    if v is not None])

    @cached_property
    def envelope(self) -> Envelope | None:
        return Envelope.from_headers(self.headers)

    def header(self, name: str) -> str | None:
        return header_value(self.headers, name)

    @property
    def position(self) -> str:
        return f"{self.topic}|{self.partition}|{self.offset}"

    @property
    def key_text(self) -> str:
        return self.key.decode(errors="replace") if self.key is not None else ""


READER_PREFETCH_BYTES = 16 * 1024 * 1024  # what a reader fetches ahead of its caller, at most


def reader(bootstrap: str | None = None, **overrides: Any) -> Consumer:
    """A read_committed consumer that never commits; its group id is unique and unused.

    What it fetches ahead is bounded (``READER_PREFETCH_BYTES`` queued, and as much again in
    the fetch under way from each broker): the live view holds one for its sampler, one per
    trace and one for a redrive, and on librdkafka's defaults each runs ahead of a slow
    caller by over a hundred megabytes (64 MiB queued, 50 MiB a fetch) where a dead letter
    can be half a megabyte. A full queue is looked at again after 20 ms, not librdkafka's
    second, so a fast caller is not held to one queue a second."""
    config: dict[str, Any] = {
        **base_config(bootstrap),
        "group.id": f"choreo-ops-reader-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 50,
        "max.partition.fetch.bytes": READER_PREFETCH_BYTES // 2,
        "fetch.max.bytes": READER_PREFETCH_BYTES,
        "queued.max.messages.kbytes": READER_PREFETCH_BYTES // 1024,
        "fetch.queue.backoff.ms": 20,
    }
    config.update(overrides)
    return Consumer(config)


def partitions_of(consumer: Consumer, topic: str, timeout_s: float = 10.0) -> list[int]:
    """The topic's partitions, or [] when the topic does not exist."""
    meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if meta is None or meta.error is not None:
        return []
    return sorted(meta.partitions)


def existing_topics(consumer: Consumer, timeout_s: float = 10.0) -> dict[str, int]:
    """Every topic on the cluster with its partition count."""
    meta = consumer.list_topics(timeout=timeout_s)
    return {name: len(t.partitions) for name, t in meta.topics.items() if t.error is None}


def resolve(consumer: Consumer, topic: str, partitions: Iterable[int] | None = None, *,
            since_ms: int | None = None, until_ms: int | None = None,
            offsets: dict[int, tuple[int, int]] | None = None, timeout_s: float = 10.0) -> list[Span]:
    """The spans of ``topic`` between two times (``until`` exclusive) or explicit offsets.

    ``offsets_for_times`` gives, per partition, the first offset whose timestamp is at or
    after the time (or the end when there is none), which is exactly a half-open bound.
    """
    parts = list(partitions) if partitions is not None else partitions_of(consumer, topic, timeout_s)
    marks = {p: watermarks(consumer, TopicPartition(topic, p), timeout_s) for p in parts}
    starts = {p: low for p, (low, _) in marks.items()}
    ends = {p: high for p, (_, high) in marks.items()}
    if since_ms is not None:
        starts = _at_time(consumer, topic, parts, since_ms, ends, timeout_s)
    if until_ms is not None:
        ends = _at_time(consumer, topic, parts, until_ms, ends, timeout_s)
    if offsets is not None:
        for p, (first, last_excl) in offsets.items():
            low, high = marks.get(p, (0, 0))
            starts[p], ends[p] = max(first, low), min(last_excl, high)
        parts = [p for p in parts if p in offsets]
    spans = [Span(topic, p, max(starts[p], marks[p][0]), ends[p]) for p in parts]
    return [s for s in spans if s.size > 0]


def watermarks(consumer: Consumer, tp: TopicPartition, timeout_s: float) -> tuple[int, int]:
    """A partition's low and high offsets. A fresh consumer that has no leader for the
    partition yet (a topic just created, a leader moving) answers "unknown partition" on
    the first ask and knows it a moment later: asked again until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=max(0.1, deadline - time.monotonic()))
            return int(low), int(high)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._UNKNOWN_PARTITION or time.monotonic() > deadline:
                raise
            # librdkafka's own thread asks for the leader meanwhile (a poll here could
            # consume a record of a partition the caller has assigned)
            time.sleep(0.1)


def _at_time(consumer: Consumer, topic: str, parts: list[int], ms: int, ends: dict[int, int],
             timeout_s: float) -> dict[int, int]:
    if not parts:
        return {}
    found = consumer.offsets_for_times([TopicPartition(topic, p, ms) for p in parts], timeout=timeout_s)
    return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition] for tp in found}


def read(consumer: Consumer, spans: list[Span], progress: Progress | None = None,
         batch: int = 5000, idle_timeout_s: float = 30.0,
         accept: Callable[[Message], bool] | None = None) -> Generator[Rec, None, None]:
    """Every committed record of ``spans``, partition by partition in offset order.

    ``accept`` filters on the raw message before a ``Rec`` is built (e.g. compare the key
    bytes): the cheap test runs on every record, the object only for the ones kept.
    """
    todo = {(s.topic, s.partition): s for s in spans if s.size > 0}
    if not todo:
        return
    assigned = [TopicPartition(s.topic, s.partition, s.start) for s in todo.values()]
    consumer.assign(assigned)
    consumer.resume(assigned)  # pauses from an earlier read survive unassign/assign
    last_progress = time.monotonic()
    delivered: set[tuple[str, int]] = set()
    count, largest = min(batch, FIRST_BATCH), 1
    try:
        while todo:
            messages = consumer.consume(count, BATCH_WAIT_S)
            if not messages:
                _finish_ended(consumer, todo)
                if time.monotonic() - last_progress > idle_timeout_s:
                    raise TimeoutError(f"no progress reading {sorted(todo)} for {idle_timeout_s}s")
                continue
            last_progress = time.monotonic()
            counted = 0
            for message in messages:
                largest = max(largest, len(message.value() or b"") + len(message.key() or b""))
                if message.error() is not None:
                    continue
                span = todo.get((message.topic() or "", message.partition() or 0))
                offset = message.offset() or 0
                if span is None or offset >= span.end:
                    continue
                delivered.add((span.topic, span.partition))
                counted += 1
                if accept is None or accept(message):
                    yield Rec.of(message)
                if offset + 1 >= span.end:
                    _finish(consumer, todo, span)
            count = max(1, min(batch, READ_BATCH_BYTES // largest))
            del messages  # not held through the next consume
            if progress is not None and counted:
                progress(counted)
            # a span ending in a transaction marker (never delivered) ends with the batch that
            # took the consumer past it: found now, not after one more wait for nothing. Only
            # where this read delivered a record: until then a partition read before on this
            # consumer may still show that read's position
            _finish_ended(consumer, todo, delivered)
    finally:
        try:
            consumer.unassign()
        except Exception:  # noqa: BLE001 - the consumer may be closing already
            pass


def _finish_ended(consumer: Consumer, todo: dict[tuple[str, int], Span],
                  among: set[tuple[str, int]] | None = None) -> None:
    """Finish the spans (``among`` these partitions) the consumer's position has passed the end of."""
    checked = [TopicPartition(t, p) for t, p in todo if among is None or (t, p) in among]
    if checked:
        for tp in consumer.position(checked):
            span = todo.get((tp.topic, tp.partition))
            if span is not None and tp.offset >= span.end:
                _finish(consumer, todo, span)


def _finish(consumer: Consumer, todo: dict[tuple[str, int], Span], span: Span) -> None:
    todo.pop((span.topic, span.partition), None)
    consumer.pause([TopicPartition(span.topic, span.partition)])


class BodyDecoder:
    """Decodes any Confluent-framed Avro value with its *writer* schema, for people to read.

    The ops tools show events of every type (and dead letters, whose bytes may be broken),
    so they need no model: the registry's writer schema is enough, if it decodes in bounded
    work (a dead letter may be there because its schema does not: ``serde.bounded_writer``),
    and a failure is shown as text instead of raised. An id the registry denies this login
    is refused when the topic's subject does not hold it, as the services refuse it: whoever
    may register under a subject the ops login may not read, and write to a topic the
    rebuild reads, could otherwise stop the rebuild.
    """

    def __init__(self) -> None:
        self._client = registry_client()
        self._schemas = WriterSchemas(partial(bounded_writer, self._client), subject="(ops tools: any)")
        # subject -> the denied ids refused for it; a dead letter's subject is named by its header
        self._denials: OrderedDict[str, WriterSchemas] = OrderedDict()

    def __call__(self, topic: str, value: bytes | None) -> dict[str, Any] | str:
        try:
            return self.read(topic, value)
        except RegistryUnavailable as exc:  # shown to the operator, who may look again
            return f"<registry unavailable: {str(exc)[:200]}>"

    def read(self, topic: str, value: bytes | None) -> dict[str, Any] | str:
        """As a call, but a registry that cannot be reached raises ``RegistryUnavailable``:
        for a caller that acts on what the bodies say (``rebuild-state``), where a body shown
        as text would be a fact silently missed."""
        if value is None:
            return "<tombstone>"
        if len(value) < 5 or value[0] != MAGIC_BYTE:
            return f"<{len(value)} bytes, not Confluent wire format>"
        try:
            decoded = schemaless_reader(io.BytesIO(value[5:]), self._writer(f"{topic}-value", schema_id_of(value)),
                                        None)
        except RegistryUnavailable:
            raise
        except DecodeFailure as exc:
            return f"<refused: {exc}>"
        except Exception as exc:  # noqa: BLE001 - shown to the operator, never raised
            return f"<undecodable: {type(exc).__name__}: {str(exc)[:200]}>"
        return _plain(decoded) if isinstance(decoded, dict) else str(decoded)

    def _writer(self, subject: str, schema_id: int) -> Any:
        """The parsed writer schema of ``schema_id``; a denied one is refused under
        ``subject`` when the subject does not hold it (that refusal remembered a while, per
        subject), and waits as an outage when it may be the subject's own."""
        denials = self._denials.get(subject)
        if denials is not None:
            denials.raise_refusal(schema_id)
        try:
            return self._schemas.get(schema_id)
        except RegistryDenied:
            if denials is None:
                if len(self._denials) >= MAX_DENIAL_SUBJECTS:
                    self._denials.popitem(last=False)
                denials = self._denials[subject] = WriterSchemas(partial(self._refuse_denied, subject), subject)
            return denials.get(schema_id)

    def _refuse_denied(self, subject: str, schema_id: int) -> NoReturn:
        """Asked only for an id the registry denied: refused when ``subject`` does not hold it."""
        if not_registered_under(self._client, subject, schema_id):
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA, f"schema id {schema_id} (or a schema it "
                                f"references) is denied and not registered under {subject}")
        raise RegistryDenied(f"schema id {schema_id} is denied, and {subject} may hold it")


def _plain(value: Any) -> Any:
    """A decoded body as JSON holds it: whatever type a writer schema decodes to (bytes,
    decimals, UUIDs, dates and times, floats JSON has not) becomes text, so every tool can
    print what any registered schema wrote."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (datetime, date, dt_time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    return str(value)
