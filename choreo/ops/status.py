"""What is going on right now: deliveries in flight, stuck, failed, compensating, and
consumer lag per group and partition.

The delivery view reads the state table's deadline index (``deadlines``), never every key:
open and due steps are exactly its members, oldest deadline first, so ``--limit`` bounds
the work whatever the backlog (the same O(due) property the supervisor relies on). The
steps whose undo failed for good, waiting for an operator's decision, are read from the
supervisor's ``awaiting-operator`` sets (``choreo.supervision``), however many steps are in
flight. Recent outcomes are counted from the terminal topics over a time window (keys only,
nothing decoded). Lag is the high watermark minus the group's committed offset; under exactly-once
every transaction leaves one commit marker, so a caught-up partition may show a lag of 1.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Message, TopicPartition

from choreo.config import settings
from choreo.ops.records import existing_topics, read, reader, resolve, watermarks
from choreo.redis_client import connect
from choreo.state import StepStatus, deadline_shards, delivery_key, text, unpack_step
from choreo.supervision import awaiting_operator_shards
from choreo.workflow import Workflow

OPEN = {StepStatus.PENDING.value, StepStatus.PROCESSING.value}


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
    waiting_since_ms: int = 0  # a step awaiting an operator: since when


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
    compensating: list[StepView] = field(default_factory=list)  # undos under way
    awaiting_operator: list[StepView] = field(default_factory=list)  # undos failed for good
    recent_outcomes: dict[str, int] = field(default_factory=dict)
    window_ms: int = 0
    lag: list[LagRow] = field(default_factory=list)


def _text(value: Any) -> str:
    return text(value)


def deliveries(client: redis.Redis, limit: int = 1000, now_ms: int | None = None,
               undo_steps: Collection[str] = ()) -> Status:
    """Classify the first ``limit`` steps of the deadline indexes (most overdue first), and
    the first ``limit`` steps waiting for an operator (longest waiting first); a step of
    ``undo_steps`` open and not yet due is an undo under way."""
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    indexes = deadline_shards()
    pipe = client.pipeline(transaction=False)
    for index in indexes:
        pipe.zcard(index)
        pipe.zrange(index, 0, limit - 1, withscores=True)
    for index in awaiting_operator_shards():
        pipe.zrange(index, 0, limit - 1, withscores=True)
    replies = pipe.execute()
    indexed, waiting = replies[:2 * len(indexes)], replies[2 * len(indexes):]
    total = sum(int(n) for n in indexed[0::2])
    members = sorted((item for page in indexed[1::2] for item in page), key=lambda item: item[1])[:limit]
    awaiting = sorted((item for page in waiting for item in page), key=lambda item: item[1])[:limit]
    pipe = client.pipeline(transaction=False)
    parsed: list[tuple[str, str, int]] = []
    for member, score in (*members, *awaiting):
        delivery_id, _, step = _text(member).rpartition("|")
        parsed.append((delivery_id, step, int(score)))
        pipe.hmget(delivery_key(delivery_id), [step, "outcome"])
    status = Status(now, total, len(members), 0)
    open_deliveries: set[str] = set()
    for i, ((delivery_id, step, score), (record, raw_outcome)) in enumerate(zip(parsed, pipe.execute())):
        values = unpack_step(_text(record)) if record else {}
        st, attempt, failures = values.get("status", ""), values.get("attempt"), values.get("failures")
        error, outcome = values.get("error", ""), _text(raw_outcome)
        if i >= len(members):  # listed as waiting (since ``score``): unless decided or gone
            if st == StepStatus.COMPENSATION_FAILED.value:
                status.awaiting_operator.append(StepView(delivery_id, step, st, 0, 0, int(attempt or 1),
                                                         int(failures or 0), error, outcome, score))
            continue
        view = StepView(delivery_id, step, st, score, max(0, now - score), int(attempt or 1),
                        int(failures or 0), error, outcome)
        if st in OPEN and score < now:  # an undo's too: its service may be down
            status.stuck.append(view)
        elif st == StepStatus.COMPENSATING.value or (st in OPEN and step in undo_steps):
            status.compensating.append(view)
        elif st == StepStatus.FAILED.value:
            status.failed.append(view)
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
    result = deliveries(client, limit, undo_steps=undo_steps(workflow))
    result.window_ms = window_ms
    result.recent_outcomes = recent_outcomes(workflow.terminal_topics, window_ms)
    if with_lag:
        result.lag = lag(workflow)
    return result


def undo_steps(workflow: Workflow) -> set[str]:
    """The steps that undo others: open, they are a compensation under way."""
    return {undo for undo, _ in workflow.compensations().values()}
