"""What the live view shows, gathered by one background thread, never by a request.

Every ``interval_s`` the sampler reads the end offsets of the workflow's topics, every
service group's committed offsets and lag (``choreo.ops.status.lag``) and the state
table's open, stuck, failed and compensating steps (``choreo.ops.status.deliveries``);
the dead letters (``recent_dead_letters``) when a dead-letter topic has grown, or every
``dead_letters_every`` rounds. A page only renders the last snapshot, so however many
browsers poll, the broker and Redis see one reader; a part that fails keeps its last
value and the snapshot says what failed.

Rates are offsets per second over the last ``rate_window_s``: the topic's end offset for
what is published, the group's committed offset for what a service has handled. Under
exactly-once each committed transaction also writes one marker offset per partition, so a
rate slightly over-counts events when batches are small.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from confluent_kafka import Consumer, TopicPartition

from choreo.config import settings
from choreo.logs import get_logger
from choreo.ops import status as ops_status
from choreo.ops.dlq import DeadLetter, redriven_positions, summary
from choreo.ops.records import Span, existing_topics, read, reader, watermarks
from choreo.ops.trace import kind_of, workflow_topics
from choreo.workflow import Workflow

log = get_logger(component="ops-web")

MAX_STEPS = 1000  # steps of the deadline index looked at per round (most overdue first)
DEAD_LETTERS_PER_PARTITION = 200  # the newest dead letters read per partition


@dataclass
class Offsets:
    """One round's offsets: topic → sum of end offsets; (group, topic) → sum of positions."""

    at: float
    ends: dict[str, int]
    positions: dict[tuple[str, str], int]


@dataclass
class Snapshot:
    at_ms: int = 0
    rates: dict[str, float] = field(default_factory=dict)  # topic → offsets/s published
    handled: dict[tuple[str, str], float] = field(default_factory=dict)  # (group, topic) → offsets/s
    lag: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, topic) → lag
    deliveries: ops_status.Status | None = None
    dead_letters: list[DeadLetter] = field(default_factory=list)  # newest first
    dead_letter_summary: list[dict[str, object]] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # part → what failed, this round

    def group_lag(self, group: str) -> int:
        return sum(n for (g, _), n in self.lag.items() if g == group)


def recent_dead_letters(consumer: Consumer, topics: Iterable[str], present: dict[str, int],
                        per_partition: int = DEAD_LETTERS_PER_PARTITION) -> list[DeadLetter]:
    """The newest ``per_partition`` dead letters of each partition of ``topics``, newest
    first: bounded whatever the dead-letter topics hold."""
    redriven = redriven_positions()
    spans = []
    for topic in topics:
        for partition in range(present.get(topic, 0)):
            low, high = watermarks(consumer, TopicPartition(topic, partition), 10)
            spans.append(Span(topic, partition, max(low, high - per_partition), high))
    letters = [DeadLetter.of(record, redriven) for record in read(consumer, spans)]
    return sorted(letters, key=lambda d: d.time_ms, reverse=True)


class Sampler:
    """The background reader; ``snapshot`` is the last complete round."""

    def __init__(self, workflow: Workflow, interval_s: float = 2.0, rate_window_s: float = 10.0,
                 dead_letters_every: int = 5) -> None:
        self.workflow = workflow
        self.interval_s, self.rate_window_s, self.dead_letters_every = interval_s, rate_window_s, dead_letters_every
        self.snapshot = Snapshot()
        self._history: deque[Offsets] = deque(maxlen=max(4, int(rate_window_s / interval_s) * 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ops-web-sampler", daemon=True)
        self._redis = redis.Redis.from_url(settings().redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._dlq_ends: dict[str, int] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        consumer = reader()
        try:
            rounds = 0
            while not self._stop.is_set():
                started = time.monotonic()
                self.snapshot = self.sample(consumer, rounds)
                rounds += 1
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
        finally:
            consumer.close()

    def sample(self, consumer: Consumer, rounds: int) -> Snapshot:
        """One round; each part that fails keeps the previous round's value."""
        last = self.snapshot
        snap = Snapshot(at_ms=int(time.time() * 1000), rates=last.rates, handled=last.handled, lag=last.lag,
                        deliveries=last.deliveries, dead_letters=last.dead_letters,
                        dead_letter_summary=last.dead_letter_summary)
        present: dict[str, int] = {}
        try:
            present = existing_topics(consumer)
            topics = workflow_topics(self.workflow, present)
            ends = {t: self._end(consumer, t, n) for t, n in topics.items() if kind_of(t) != "dead-letter"}
            lag_rows = ops_status.lag(self.workflow)
            positions: dict[tuple[str, str], int] = {}
            snap.lag = {}
            for row in lag_rows:
                key = (row.group, row.topic)
                positions[key] = positions.get(key, 0) + row.end - row.lag
                snap.lag[key] = snap.lag.get(key, 0) + row.lag
            self._history.append(Offsets(time.monotonic(), ends, positions))
            snap.rates, snap.handled = self._rates()
        except Exception as exc:  # noqa: BLE001 - shown on the page, the loop goes on
            snap.problems["kafka"] = _say(exc)
        try:
            snap.deliveries = ops_status.deliveries(self._redis, MAX_STEPS,
                                                    undo_steps=ops_status.undo_steps(self.workflow))
        except Exception as exc:  # noqa: BLE001
            snap.problems["redis"] = _say(exc)
        try:
            dlqs = {t: n for t, n in workflow_topics(self.workflow, present).items() if kind_of(t) == "dead-letter"}
            ends = {t: self._end(consumer, t, n) for t, n in dlqs.items()}
            if ends != self._dlq_ends or rounds % self.dead_letters_every == 0:
                snap.dead_letters = recent_dead_letters(consumer, dlqs, present)
                snap.dead_letter_summary = summary(snap.dead_letters)
                self._dlq_ends = ends
        except Exception as exc:  # noqa: BLE001
            snap.problems["dead letters"] = _say(exc)
        for part, problem in snap.problems.items():
            log.warning("ops_web.sample_failed", part=part, error=problem)
        return snap

    @staticmethod
    def _end(consumer: Consumer, topic: str, partitions: int) -> int:
        return sum(watermarks(consumer, TopicPartition(topic, p), 5)[1] for p in range(partitions))

    def _rates(self) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
        newest = self._history[-1]
        oldest = next((o for o in self._history if newest.at - o.at <= self.rate_window_s), newest)
        span = newest.at - oldest.at
        if span <= 0:
            return {}, {}
        rates = {t: max(0, n - oldest.ends.get(t, n)) / span for t, n in newest.ends.items()}
        handled = {k: max(0, n - oldest.positions.get(k, n)) / span for k, n in newest.positions.items()}
        return rates, handled


def _say(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
