"""The whole story of one delivery, across every topic, in causal order.

How the events are found without reading whole topics:

1. **One partition per topic.** Every event of a delivery is keyed by its delivery id, so
   it sits in partition ``hash(key) % partitions`` of each topic (the producers' own
   partitioner, see ``records.partition_for``); co-partitioned topics share that number.
   Retry, dead-letter, recovery and compensation topics are keyed the same way.
2. **From the request on.** The scan of each partition starts at the delivery's request
   time, found by ``offsets_for_times``: the request time comes from the state table when
   Redis still has it (the publisher opens the steps just before producing), otherwise from
   the request event itself, looked up first in the entry topic's one partition within a
   bounded window (``--since``, default a day). The state table only keeps each step's
   *last* transition, so its earliest time is an upper bound of the request time: when the
   scan from there finds no request (every step moved on later, e.g. services that started
   late or a requeue), the request is looked up backwards in the entry topic's partition in
   growing windows (1 min, ×4 each, up to the default window), and the scan starts again
   from it.
3. **Keys compared as bytes** before anything is decoded; only the delivery's own records
   become objects, and only they are decoded (with their writer schema).

Why not a Redis index of (topic, partition, offset) per delivery: it would be one more
write on every hop of the hot path, it disappears exactly when it is needed most (Redis
lost), and the broker already keeps a time index per partition. ``bench/trace.py``
measures the scan on a topic of a million events.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis
from confluent_kafka import Consumer, Message, TopicPartition

from choreo.config import settings
from choreo.ops.records import (
    BodyDecoder, Progress, Rec, existing_topics, partition_for, read, reader, resolve,
)
from choreo.redis_client import connect
from choreo.runner import RECOVERY_TOPIC, dlq_topic
from choreo.serde import MAX_VALUE_BYTES
from choreo.state import delivery_key, flat_fields, text
from choreo.topology import derive
from choreo.workflow import Workflow

REQUEST_SLACK_MS = 5_000  # producers' clocks and CreateTime vs the state table's clock
DEFAULT_WINDOW_MS = 24 * 3600 * 1000


@dataclass
class ScanStats:
    partitions: int = 0
    records_read: int = 0
    seconds: float = 0.0
    cut: bool = False  # the delivery had more records than the scan keeps (``Keeping.max_records``)


@dataclass(frozen=True)
class Keeping:
    """What a scan keeps of the delivery's records: every record and every value (an
    operator's trace), or, for a server answering whoever asks, a bounded story of a
    delivery anyone able to write a topic can pad: the values of a few topics, each up to a
    size, headers up to a size, and so many records (past them the story is ``cut``). A
    value not kept is ``Rec.cut_bytes`` long; headers not kept are none."""

    values_of: frozenset[str] | None = None  # None: every topic's
    max_value_bytes: int = MAX_VALUE_BYTES  # what a consumer takes: a larger one is refused anyway
    max_header_bytes: int | None = None
    max_records: int | None = None

    def kept(self, record: Rec) -> Rec:
        size = len(record.value or b"")
        if size > self.max_value_bytes or (self.values_of is not None and record.topic not in self.values_of):
            record = replace(record, value=None, cut_bytes=size)
        if (self.max_header_bytes is not None
                and sum(len(k) + len(v) for k, v in record.headers) > self.max_header_bytes):
            record = replace(record, headers=[])
        return record


@dataclass
class Hop:
    """One record of the delivery's story, as a person reads it."""

    topic: str
    partition: int
    offset: int
    kind: str  # event | retry | dead-letter | recovery | compensation
    time_ms: int
    since_start_ms: int
    since_previous_ms: int
    event_type: str
    producer: str
    attempt: int
    hops: int
    event_id: str
    causation_id: str
    consumed_by: dict[str, bool] = field(default_factory=dict)
    note: str = ""
    body: dict[str, Any] | str = ""


@dataclass
class Trace:
    delivery_id: str
    hops: list[Hop]
    state: dict[str, str]
    stats: ScanStats
    since_ms: int
    found_start_by: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kind_of(topic: str) -> str:
    if topic.endswith(".dlq"):
        return "dead-letter"
    if topic.startswith("retry."):
        return "retry"
    if topic == RECOVERY_TOPIC:
        return "recovery"
    if topic.startswith("compensation"):
        return "compensation"
    return "event"


def workflow_topics(workflow: Workflow, present: dict[str, int]) -> dict[str, int]:
    """Every topic a delivery can appear on (derived from the services), with its real
    partition count; topics not created yet are skipped."""
    topo = derive(workflow)
    names = set(topo.partitions) | {dlq_topic(t) for t in topo.consumers if not t.startswith("retry.")}
    return {t: present[t] for t in sorted(names) if t in present}


def scan_delivery(consumer: Consumer, delivery_id: str, topics: dict[str, int], since_ms: int | None,
                  partitioner: str = "consistent_random", progress: Progress | None = None,
                  compound: Mapping[str, Sequence[str]] | None = None,
                  keeping: Keeping = Keeping()) -> tuple[list[Rec], ScanStats]:
    """The delivery's records in ``topics`` (name → partition count) from ``since_ms`` on:
    one partition per topic, keys compared as bytes.

    ``compound`` names topics keyed by ``<delivery>|<suffix>`` (a compacted log keeps one
    record per such key, e.g. the compensation log per step) with their possible suffixes:
    their partitions are those of the compound keys. A record is the delivery's when its key
    is the id or one of those compound keys exactly (on any topic: a dead letter keeps its
    record's key), never any key that merely starts with the id.
    """
    started = time.perf_counter()
    key = delivery_id.encode()
    prefix = key + b"|"
    spans = []
    for topic, count in topics.items():
        keys = [key, *(prefix + s.encode() for s in (compound or {}).get(topic, ()))]
        parts = sorted({partition_for(k, count, partitioner) for k in keys})
        spans += resolve(consumer, topic, parts, since_ms=since_ms)
    stats = ScanStats(partitions=len(spans), records_read=sum(s.size for s in spans))

    wanted = {key, *(prefix + s.encode() for suffixes in (compound or {}).values() for s in suffixes)}

    def accept(m: Message) -> bool:
        return m.key() in wanted

    # ``read`` pauses each partition it has finished, and a pause outlives unassign/assign:
    # a consumer that scans a partition a second time (the request searched first) resumes it
    consumer.resume([TopicPartition(s.topic, s.partition) for s in spans])
    records = read(consumer, spans, progress, accept=accept)
    found = [keeping.kept(r) for r in itertools.islice(records, keeping.max_records)]
    stats.cut = keeping.max_records is not None and next(records, None) is not None
    records.close()
    stats.seconds = time.perf_counter() - started
    return found, stats


def request_time(client: redis.Redis | None, delivery_id: str) -> int | None:
    """When the delivery was requested, from the state table (steps are opened just before
    the request is produced); None when Redis no longer knows it."""
    if client is None:
        return None
    times = [int(v) for k, v in _state(client, delivery_id).items() if k.endswith(".updated") and v.isdigit()]
    return min(times) if times else None


def request_before(consumer: Consumer, delivery_id: str, entry: dict[str, int], before_ms: int,
                   partitioner: str = "consistent_random",
                   first_window_ms: int = 60_000) -> tuple[int | None, ScanStats]:
    """The time of the delivery's request in the entry topics' one partition, searched
    backwards from ``before_ms`` in windows growing ×4 up to the default window."""
    total = ScanStats()
    window = first_window_ms
    while True:
        found, stats = scan_delivery(consumer, delivery_id, entry, before_ms - window, partitioner)
        _add(total, stats)
        if found:
            return min(r.timestamp_ms for r in found), total
        if window >= DEFAULT_WINDOW_MS:
            return None, total
        window = min(window * 4, DEFAULT_WINDOW_MS)


def _add(total: ScanStats, stats: ScanStats) -> None:
    total.partitions += stats.partitions
    total.records_read += stats.records_read
    total.seconds += stats.seconds
    total.cut = total.cut or stats.cut


def causal_order(records: list[Rec]) -> list[Rec]:
    """Sort by production time, then make sure no event is shown before its cause (clocks
    of different producers may disagree by a few ms; a transaction's records share one).

    The earliest record whose cause is shown (or not among the records) comes next; when
    every record left waits for a cause (a cycle, which fresh ids never make), the earliest.
    Each record is looked at a bounded number of times: records written to hang a lookup
    (thousands under one key, each naming the next as its cause) cost n log n, not n²."""
    by_time = sorted(records, key=lambda r: (_produced_at(r), r.timestamp_ms, r.topic, r.offset))
    envelopes = [r.envelope for r in by_time]
    ids = {env.event_id for env in envelopes if env}
    ready: list[int] = []  # positions in time order, each record's cause shown (or none)
    waiting: dict[str, list[int]] = {}  # a cause's event id -> the records it holds back
    held: list[int] = []  # every waiting record's position, for a cycle (stale entries skipped)
    for i, (record, env) in enumerate(zip(by_time, envelopes)):
        cause = env.causation_id if env else ""
        if cause and cause in ids and kind_of(record.topic) == "event":
            waiting.setdefault(cause, []).append(i)
            held.append(i)
        else:
            ready.append(i)
    heapq.heapify(ready)
    taken = [False] * len(by_time)
    ordered: list[Rec] = []
    while len(ordered) < len(by_time):
        i = heapq.heappop(ready if ready else held)
        if taken[i]:  # freed after a cycle took it, or taken since it was held
            continue
        taken[i] = True
        ordered.append(by_time[i])
        if (env := envelopes[i]) is not None:
            for freed in waiting.pop(env.event_id, ()):
                heapq.heappush(ready, freed)
    return ordered


def _produced_at(record: Rec) -> int:
    env = record.envelope
    return env.produced_at_ms if env is not None and env.produced_at_ms else record.timestamp_ms


def _note(record: Rec, body: dict[str, Any] | str) -> str:
    if record.topic.endswith(".dlq"):
        return (f"{record.header('dlq.reason')} by {record.header('dlq.service')} from "
                f"{record.header('dlq.source.topic')}@{record.header('dlq.source.partition')}:"
                f"{record.header('dlq.source.offset')}: {(record.header('dlq.error') or '')[:160]}")
    if record.header("redrive.from"):
        return f"redriven from {record.header('redrive.from')}"
    if isinstance(body, dict):
        # what a person looks for first: a verdict, else what the step produced (its id)
        produced = [n for n in body if n.endswith("_id") and n not in ("delivery_id", "source_event_id")]
        for name in ("status", "reason", "kind", *produced):
            if body.get(name):
                extra = f" ({body['step']})" if body.get("step") and name != "step" else ""
                return f"{name}={body[name]}{extra}"
    return ""


def consumption(consumer: Consumer, workflow: Workflow, records: list[Rec]) -> dict[tuple[str, int, int], dict[str, bool]]:
    """For each record, which consuming services have committed past it (handled it)."""
    consumers = derive(workflow).consumers
    groups: dict[str, set[tuple[str, int]]] = {}
    for r in records:
        for service in consumers.get(r.topic, ()):
            groups.setdefault(service, set()).add((r.topic, r.partition))
    committed: dict[tuple[str, str, int], int] = {}
    for group, tps in groups.items():
        probe = reader(**{"group.id": consumer_group(group)})
        try:
            for tp in probe.committed([TopicPartition(t, p) for t, p in sorted(tps)], timeout=10):
                committed[(group, tp.topic, tp.partition)] = tp.offset
        finally:
            probe.close()
    return {
        (r.topic, r.partition, r.offset): {
            s: committed.get((s, r.topic, r.partition), -1) > r.offset for s in sorted(consumers.get(r.topic, ()))
        }
        for r in records
    }


def consumer_group(service: str) -> str:
    """The live consumer group of a service (the runner uses the service name)."""
    return service


def trace(delivery_id: str, workflow: Workflow, *, since_ms: int | None = None,
          partitioner: str = "consistent_random", progress: Progress | None = None,
          redis_client: redis.Redis | None = None, decode: bool = True,
          extra_topics: Sequence[str] = (), keeping: Keeping = Keeping()) -> Trace:
    """Find, order and describe every record of one delivery (in the workflow's topics and
    ``extra_topics``, e.g. the topics of a subscriber outside the workflow); ``keeping``: what
    of them (a body is decoded only from a value kept)."""
    client = redis_client or connect(settings().redis_url, socket_timeout=2)
    consumer = reader()
    try:
        present = existing_topics(consumer)
        topics = workflow_topics(workflow, present)
        topics.update({t: present[t] for t in extra_topics if t in present})
        how = "--since"
        total = ScanStats()
        if since_ms is None:
            requested = request_time(client, delivery_id)
            if requested is not None:
                since_ms, how = requested - REQUEST_SLACK_MS, "state table"
            else:
                entry = {t: topics[t] for t in workflow.extra_producers if t in topics}
                window_start = int(time.time() * 1000) - DEFAULT_WINDOW_MS
                first, stats = scan_delivery(consumer, delivery_id, entry, window_start, partitioner, progress,
                                             keeping=keeping)
                total = stats
                since_ms = (min(r.timestamp_ms for r in first) - REQUEST_SLACK_MS) if first else window_start
                how = "request event" if first else "default window"
        steps = [s.name for s in workflow.steps]
        compound = {t: steps for t in derive(workflow).configs if t in topics}  # compacted logs
        records, stats = scan_delivery(consumer, delivery_id, topics, since_ms, partitioner, progress, compound,
                                       keeping)
        _add(total, stats)
        entry = {t: topics[t] for t in workflow.extra_producers if t in topics}
        if how == "state table" and entry and not any(r.topic in entry for r in records):
            # the state table's times are the steps' last transitions: the request is older
            requested, searched = request_before(consumer, delivery_id, entry, since_ms, partitioner)
            _add(total, searched)
            if requested is not None:
                since_ms, how = requested - REQUEST_SLACK_MS, "request event before the state table's times"
                records, stats = scan_delivery(consumer, delivery_id, topics, since_ms, partitioner,
                                               progress, compound, keeping)
                _add(total, stats)
        done = consumption(consumer, workflow, records)
    finally:
        consumer.close()
    decoder = BodyDecoder() if decode else None
    hops: list[Hop] = []
    ordered = causal_order(records)
    start = _produced_at(ordered[0]) if ordered else 0
    previous = start
    for r in ordered:
        env = r.envelope
        at = _produced_at(r)
        source_topic = r.header("dlq.source.topic") or r.topic
        body: dict[str, Any] | str = (
            f"<{r.cut_bytes} bytes, not kept>" if r.cut_bytes
            else decoder(source_topic if r.topic.endswith(".dlq") else r.topic, r.value) if decoder is not None
            else "")
        hops.append(Hop(
            topic=r.topic, partition=r.partition, offset=r.offset, kind=kind_of(r.topic), time_ms=at,
            since_start_ms=at - start, since_previous_ms=at - previous,
            event_type=env.event_type if env else "", producer=env.producer if env else "",
            attempt=env.attempt if env else 0, hops=env.hops if env else 0,
            event_id=env.event_id if env else "", causation_id=env.causation_id if env else "",
            consumed_by=done.get((r.topic, r.partition, r.offset), {}), note=_note(r, body), body=body,
        ))
        previous = at
    return Trace(delivery_id, hops, _state(client, delivery_id), total, since_ms, how)


def _state(client: redis.Redis, delivery_id: str) -> dict[str, str]:
    """The delivery's state table as ``<step>.<name>`` fields ({} when Redis cannot say)."""
    try:
        raw = client.hgetall(delivery_key(delivery_id))
    except redis.RedisError:
        return {}
    return dict(sorted(flat_fields({text(k): text(v) for k, v in raw.items()}).items()))
