"""What is going on right now: deliveries in flight, stuck, failed, compensating, and
consumer lag per group and partition.

The delivery view reads the state table's deadline index (``deadlines``), never every key:
open and due steps are exactly its members, oldest deadline first, so ``--limit`` bounds
the work whatever the backlog (the same O(due) property the supervisor relies on). Recent
outcomes are counted from the terminal topics over a time window (keys only, nothing
decoded). Lag is the high watermark minus the group's committed offset; under exactly-once
every transaction leaves one commit marker, so a caught-up partition may show a lag of 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Message, TopicPartition

from choreo.config import settings
from choreo.ops.records import existing_topics, read, reader, resolve, watermarks
from choreo.redis_client import connect
from choreo.state import StepStatus, deadline_shards, delivery_key, text, unpack_step
from choreo.workflow import Workflow

OPEN = {StepStatus.PENDING.value, StepStatus.PROCESSING.value}
COMPENSATING = {StepStatus.COMPENSATING.value, StepStatus.COMPENSATION_FAILED.value}


@dataclass
class StepView:
    delivery_id: str
    step: str
    status: str
    complete_by_ms: int
    overdue_ms: int
    attempt: int
    failures: int
    error: str
    outcome: str


@dataclass
class LagRow:
    group: str
    topic: str
    partition: int
    committed: int
    end: int
    lag: int


@dataclass
class Status:
    now_ms: int
    indexed_steps: int
    scanned_steps: int
    in_flight_deliveries: int
    in_flight: list[StepView] = field(default_factory=list)
    stuck: list[StepView] = field(default_factory=list)
    failed: list[StepView] = field(default_factory=list)
    compensating: list[StepView] = field(default_factory=list)
    recent_outcomes: dict[str, int] = field(default_factory=dict)
    window_ms: int = 0
    lag: list[LagRow] = field(default_factory=list)


def _text(value: Any) -> str:
    return text(value)


def deliveries(client: redis.Redis, limit: int = 1000, now_ms: int | None = None) -> Status:
    """Classify the first ``limit`` steps of the deadline indexes (most overdue first)."""
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    pipe = client.pipeline(transaction=False)
    for index in deadline_shards():
        pipe.zcard(index)
        pipe.zrange(index, 0, limit - 1, withscores=True)
    replies = pipe.execute()
    total = sum(int(n) for n in replies[0::2])
    members = sorted((item for page in replies[1::2] for item in page), key=lambda item: item[1])[:limit]
    pipe = client.pipeline(transaction=False)
    parsed: list[tuple[str, str, int]] = []
    for item in members:
        member, score = item[0], item[1]
        delivery_id, _, step = _text(member).rpartition("|")
        parsed.append((delivery_id, step, int(score)))
        pipe.hmget(delivery_key(delivery_id), [step, "outcome"])
    status = Status(now, total, len(parsed), 0)
    open_deliveries: set[str] = set()
    for (delivery_id, step, deadline), (record, raw_outcome) in zip(parsed, pipe.execute()):
        values = unpack_step(_text(record)) if record else {}
        st, attempt, failures = values.get("status", ""), values.get("attempt"), values.get("failures")
        error, outcome = values.get("error", ""), _text(raw_outcome)
        view = StepView(delivery_id, step, st, deadline, max(0, now - deadline), int(attempt or 1),
                        int(failures or 0), error, outcome)
        if st in COMPENSATING:
            status.compensating.append(view)
        elif st == StepStatus.FAILED.value:
            status.failed.append(view)
        elif st in OPEN and deadline < now:
            status.stuck.append(view)
        elif st in OPEN:
            status.in_flight.append(view)
        if st in OPEN and not outcome:
            open_deliveries.add(delivery_id)
    status.in_flight_deliveries = len(open_deliveries)
    return status


def recent_outcomes(topics: Iterable[str], window_ms: int) -> dict[str, int]:
    """Events per terminal topic over the last ``window_ms`` (records counted, not decoded)."""
    consumer = reader()
    since = int(time.time() * 1000) - window_ms
    counts: dict[str, int] = {}
    try:
        present = existing_topics(consumer)
        for topic in topics:
            if topic not in present:
                continue
            seen = 0

            def count(_: Message) -> bool:
                nonlocal seen
                seen += 1
                return False

            for _ in read(consumer, resolve(consumer, topic, since_ms=since), accept=count):
                pass
            counts[topic] = seen
    finally:
        consumer.close()
    return counts


def lag(workflow: Workflow, extra_groups: dict[str, list[str]] | None = None) -> list[LagRow]:
    """Lag of every workflow service's group (and ``extra_groups``: group → topics)."""
    groups = {s.name: s.topics for s in workflow.services}
    groups.update(extra_groups or {})
    rows: list[LagRow] = []
    meta_reader = reader()
    try:
        present = existing_topics(meta_reader)
        for group, topics in sorted(groups.items()):
            tps = [TopicPartition(t, p) for t in topics if t in present for p in range(present[t])]
            if not tps:
                continue
            probe = reader(**{"group.id": group})
            try:
                for tp in probe.committed(tps, timeout=10):
                    low, high = watermarks(meta_reader, TopicPartition(tp.topic, tp.partition), 10)
                    behind = high - (tp.offset if tp.offset >= 0 else low)
                    rows.append(LagRow(group, tp.topic, tp.partition, tp.offset, high, max(0, behind)))
            finally:
                probe.close()
    finally:
        meta_reader.close()
    return rows


def status(workflow: Workflow, *, limit: int = 1000, window_ms: int = 3600_000, with_lag: bool = True,
           client: redis.Redis | None = None) -> Status:
    client = client or connect(settings().redis_url, socket_timeout=5)
    result = deliveries(client, limit)
    result.window_ms = window_ms
    result.recent_outcomes = recent_outcomes(workflow.terminal_topics, window_ms)
    if with_lag:
        result.lag = lag(workflow)
    return result
