"""Replay: re-run a service's handlers over exactly an offset or time range, or move a
consumer group to the start of a range.

**The design: the service's own runtime, on a private group and explicit assignment.**
``ReplayRunner`` *is* the service's ``Runner`` (same decoders, dedupe, state table, once
effects, exactly-once transactions, dead letters and recovery reports) with three changes:

* its consumer belongs to a replay group (``replay.<service>.<id>`` by default) and is
  *assigned* the range's partitions at their start offsets, so the live group's committed
  offsets are untouched and the replay's own progress is committed with its outputs
  (a crashed replay resumes where it stopped when run again with the same ``--group``);
* its ``transactional.id`` is ``<service>-replay-<id>``, so it never fences a live instance;
* it presents each input to the dedupe at a *replay position* (``<group>:topic|p|offset``).
  The dedupe re-runs an event id seen at the *same* position (that is how an aborted
  transaction is replayed) and skips it at another position. A replay of a range the live
  service already handled must be the second case, or every handler would run again and
  re-produce its outputs: so events the service already handled are skipped as copies,
  and only events it never handled (missed, newly subscribed, dedupe entry expired) run,
  save copies under new ids of the input that began a step.
  Events of a delivery that ended and was released (``choreo.release``) are skipped too, and
  counted apart: that delivery is finished, for a replay and for ``--reset-live-group`` alike.
  Even those cannot double an effect: effects are remembered per event id
  (``ctx.once``) and outputs carry deterministic ids.

Why not re-produce the range into the service's retry topics: it would add copies to the
topics that a trace reads as supervisor requeues, retry topics exist only for supervised
steps, and the replay's progress would not be resumable.

The dedupe remembers ids for ``CHOREO_DEDUPE_TTL_S`` (a day by default): a replay into a
live service older than that re-runs handlers whose once effects still answer the same
(a week) and whose outputs repeat the same event ids, which downstream dedupe drops.

``--reset-live-group`` instead rewinds the service's own group (it must be stopped; Kafka
refuses to move an active group) so the service itself re-reads the range: at the same
positions, so handlers really run again. That is the tool for *redoing* work (outputs were
lost), not for a harmless catch-up.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from confluent_kafka import ConsumerGroupTopicPartitions

from choreo.config import settings
from choreo.effects import EffectCall
from choreo.envelope import Envelope, Unusable
from choreo.kafka import CommittedOffsets, base_config, admin
from choreo.ops.records import Span, reader, resolve
from choreo.runner import Refused, Runner, RunnerOptions, Work
from choreo.service import Service
from choreo.state import Begin
from choreo.workflow import Workflow


@dataclass
class RangeSpec:
    """What to replay: topics, and either a time range or explicit offsets per partition."""

    topics: list[str]
    since_ms: int | None = None
    until_ms: int | None = None
    offsets: dict[int, tuple[int, int]] | None = None  # partition -> [first, end)

    def spans(self, consumer: Consumer) -> list[Span]:
        spans: list[Span] = []
        for topic in self.topics:
            spans += resolve(consumer, topic, sorted(self.offsets) if self.offsets else None,
                             since_ms=self.since_ms, until_ms=self.until_ms, offsets=self.offsets)
        return spans


@dataclass
class ReplayResult:
    service: str
    group: str
    spans: list[Span]
    records: int = 0
    handled: int = 0
    duplicates: int = 0
    released: int = 0  # events of deliveries already finished and released (choreo.release)
    rewound_batches: int = 0  # read again: their transaction aborted, or their commit was refused
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


class ReplayRunner(Runner):
    """The service's runner on a replay group and an explicit assignment (see module doc)."""

    def __init__(self, service: Service, group: str, replay_id: str,
                 workflow: Workflow | None = None) -> None:
        super().__init__(service, RunnerOptions(instance=f"replay-{replay_id}"), workflow)
        self.consumer.close()  # the live group's consumer: never subscribed, never used
        self.group = group
        self.consumer = Consumer({
            **base_config(),
            "group.id": group,
            "client.id": f"{service.name}-replay-{replay_id}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 10,
        })
        self.fresh_count = 0
        self.duplicate_count = 0
        self.released_count = 0
        self.rewinds = 0

    def _dedupe_position(self, message: Message) -> str:
        """A replay position: an event the live service handled is a copy here."""
        return f"{self.group}:{super()._dedupe_position(message)}"

    def _prepare(self, message: Message, envelope: Envelope | Unusable) -> Work | Refused | None:
        taken = super()._prepare(message, envelope)
        if taken is None:  # dead-lettered at once (no usable envelope): handled, as a fresh record is
            self.fresh_count += 1
        return taken

    def _begin_verdicts(self, taken: list[Work | Refused], riders: list[EffectCall | None]
                        ) -> tuple[list[tuple[Begin, int]], list[str | None]]:
        verdicts, answers = super()._begin_verdicts(taken, riders)
        duplicates = sum(v in (Begin.DUPLICATE, Begin.COPY) for v, _ in verdicts)
        released = sum(v is Begin.RELEASED for v, _ in verdicts)
        self.duplicate_count += duplicates
        self.released_count += released
        self.fresh_count += len(verdicts) - duplicates - released
        return verdicts, answers

    def _rewind(self, batch: list[Message]) -> None:
        self.rewinds += 1
        super()._rewind(batch)

    def replay(self, spans: list[Span], progress: Callable[[int], None] | None = None,
               idle_timeout_s: float = 60.0) -> int:
        """Handle exactly ``spans`` through the runtime; returns the records handled."""
        for hook in self.service.startup:
            hook(self.redis)
        todo = {(s.topic, s.partition): s for s in spans if s.size > 0}
        unknown = [t for t, _ in todo if t not in self.service.handlers]
        if unknown:
            raise ValueError(f"{self.service.name} has no handler for {sorted(set(unknown))}")
        self.consumer.assign([TopicPartition(s.topic, s.partition, s.start) for s in todo.values()])
        done = 0
        last = time.monotonic()
        try:
            while todo:
                batch = self._next_batch()
                keep = [m for m in batch if (s := todo.get((m.topic() or "", m.partition() or 0)))
                        and (m.offset() or 0) < s.end]
                if keep:
                    rewinds = self.rewinds
                    self._process(keep)
                    if self.rewinds == rewinds:
                        done += len(keep)
                        if progress is not None:
                            progress(len(keep))
                    last = time.monotonic()
                for tp in self.consumer.position([TopicPartition(t, p) for t, p in todo]):
                    span = todo.get((tp.topic, tp.partition))
                    if span is not None and tp.offset >= span.end:
                        todo.pop((span.topic, span.partition))
                        self.consumer.pause([TopicPartition(span.topic, span.partition)])
                if time.monotonic() - last > idle_timeout_s:
                    raise TimeoutError(f"replay made no progress for {idle_timeout_s}s on {sorted(todo)}")
        finally:
            self.consumer.close()
            self.producer.flush(10)
        return done


def replay_into_service(service: Service, spec: RangeSpec, *, group: str | None = None,
                        workflow: Workflow | None = None,
                        progress_total: Callable[[int], None] | None = None,
                        progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Run ``service``'s handlers over exactly ``spec`` without touching its live group."""
    if group == service.name:
        raise ValueError(f"{group} is the live group of {service.name}: use --reset-live-group to move it")
    replay_id = uuid.uuid4().hex[:8]
    group = group or f"replay.{service.name}.{replay_id}"
    probe = reader()
    try:
        spans = spec.spans(probe)
    finally:
        probe.close()
    result = ReplayResult(service.name, group, spans, records=sum(s.size for s in spans))
    ttl_ms = settings().dedupe_ttl_s * 1000
    if spec.since_ms is not None and spec.since_ms < time.time() * 1000 - ttl_ms:
        result.warnings.append(
            "the range starts before the dedupe window: events the service handled then are no "
            "longer remembered and run again (effects answer the same, outputs repeat their ids)")
    if progress_total is not None:
        progress_total(result.records)
    started = time.perf_counter()
    runner = ReplayRunner(service, group, replay_id, workflow)
    runner.replay(spans, progress)
    result.handled, result.duplicates = runner.fresh_count, runner.duplicate_count
    result.released = runner.released_count
    result.rewound_batches = runner.rewinds
    result.seconds = time.perf_counter() - started
    return result


def committed_offsets(group: str, spans: list[Span]) -> dict[tuple[str, int], int]:
    """The group's committed offset per span partition (negative when it has none)."""
    committed = CommittedOffsets(timeout_s=10)
    try:
        return committed.of(group, [(s.topic, s.partition) for s in spans])
    finally:
        committed.close()


def move_group(group: str, spec: RangeSpec, *, allow_existing: bool = False) -> list[Span]:
    """Set ``group``'s committed offsets to the start of the range.

    For a new subscriber: it starts at the range when it first runs. For an existing group
    (``allow_existing``, the ``--reset-live-group`` case): the group must have no active
    member, which Kafka itself enforces.
    """
    probe = reader()
    try:
        spans = spec.spans(probe)
    finally:
        probe.close()
    if not spans:
        return []
    existing = {tp: o for tp, o in committed_offsets(group, spans).items() if o >= 0}
    if existing and not allow_existing:
        raise ValueError(f"group {group} already has committed offsets on {len(existing)} partitions; "
                         "pass --reset-live-group to move it anyway")
    request = ConsumerGroupTopicPartitions(group, [TopicPartition(s.topic, s.partition, s.start) for s in spans])
    client = admin()  # keep a reference: the futures need the handle alive
    futures = client.alter_consumer_group_offsets([request])
    for future in futures.values():
        try:
            future.result(30)
        except KafkaException as exc:
            raise RuntimeError(f"Kafka refused to move {group} (is it still running?): {exc}") from exc
    return spans
