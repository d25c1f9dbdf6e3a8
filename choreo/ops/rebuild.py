"""Rebuild Redis from Kafka after Redis was lost: Kafka is the record, Redis a derived view.

What is rebuilt, and why each piece matters for exactly-once after a wipe:

* **Delivery outcome** (``outcome`` in ``dl:{id}``) from the events the workflow's join
  names as its outcomes (``choreo.join``). The dedupe entries (``seen:``) and remembered
  effect answers (``fx:``) are gone, so a copy of a step result or a requeue would otherwise
  find "every part in, no decision" and decide again: the restored outcome makes it
  ``late``, no second decision.
* **Join** (``fanin.<part>``, ``fanin.order``) from every committed result of a part the
  joining service reads (not one it dead-letters unread), consumed by it or not: the join
  never overwrites a recorded result and decides as soon as every part is present, so a
  result recorded here and delivered later decides exactly once. A result consumed before
  the wipe would otherwise be forgotten and its delivery would wait forever for its other
  parts.
* **Pools** (``choreo.pool``): each pool is grown to its seed again, then every hold still
  on is restored from the events its declaration names: a hold event minus the events that
  end it (published, or *consumed* by the pool's service when that is what frees the
  member: its committed offset is past them). An end not consumed yet keeps its member
  held; it is freed when it is consumed. Only a member's **latest** committed hold can
  still be on: the pool let a later holder reserve the member, so every earlier holder had
  given it back in Redis, even when the release was in a transaction that a kill aborted (a
  Redis effect runs before its Kafka commit). Earlier holds are superseded, not restored;
  when the service handles their release again it finds no hold and does nothing. A
  restore never takes a member someone else holds (reported as a conflict), nor a hold
  of a delivery whose compensation log calls a step of the pool's service compensated (an
  undo marked done by hand gives the hold back with no event of the pool's own).
* **State table** (``dl:{id}`` steps + ``deadlines``), replayed through the state table's
  own transitions (``open`` / ``begin`` / ``finish``, a delivery's steps in one script item:
  ``StateTable.restore_many``): a step whose latest trigger the
  service has committed is completed (failed when it was reported to ``recovery`` or
  dead-lettered), otherwise pending with a deadline, so the supervisor watches it again;
  but a step with an undo whose delivery had already failed is closed with a new token, as
  the supervisor closed it, so its queued trigger starts nothing for a failed delivery.
  A record the service dead-letters unread (``Runner._prepare``) triggers nothing: it is
  decoded with the service's own decoder and checked against its hop limit and envelope.
  Compensation states come from the supervisor's ``compensation.log``.
* **Dedupe** (``seen:{id}``): for every record each service has committed, its position,
  so a copy arriving after the wipe is still recognised.
* **Services' records** (``choreo.record``), by the ``rebuilt_from`` rules each declares:
  merged in the order of the events, written where no field is. A rule that waits for its
  service's reading (``when_consumed``) takes nothing from a record the service
  dead-lettered unread, and neither does a pool's end on its reading, nor the supervisor's
  reading of a failure.
* **The release's record of terminals** (``release:<topic>:<partition>``): each successful
  delivery's position on its join's success event, so the supervisor releases its rebuilt state once
  every reader is past it, instead of leaving it to its TTLs (``choreo.release``).

Each fact is read from its event as the services decode it (their own decoders, a record
decoded once per model for the facts and the readings alike), so a newer version's fields
are resolved away as for them; a fact whose event no service of the workflow reads as that
model is read from the writer's body, the top-level fields the model does not know left out.

Remembered effect answers (``fx:{id}``) are not rebuilt: every effect is also idempotent on its
business key (a hold by its holder, a record by its delivery, the join by its fields, the
outcome), and those keys are what is restored. Nothing here knows a service: every piece
comes from the workflow's declarations, so a new service's state is rebuilt as it declares.

Everything is **merge-only** (a field or booking that exists is kept), so running it
twice, or once more after the services resumed, is harmless. A delivery whose tombstone
says it was released (``choreo.release``) is left as it is; a decided delivery's rebuilt
state expires as the delivery service's does; a delivery with dead letters gets its
``dead_letters`` mark back, so it is not released before a redrive.

The writes go by the chunk (``WRITE_CHUNK`` items per call: many deliveries' steps, a key's
fields in one script item): the pipeline waits for the rebuild, and a round trip per
transition or a command per field would make it wait for Redis's round trips, not its work.

**A partition at a time.** The facts of a delivery are held until they are written, so the
window is read and written in passes, one per partition number: every event of a delivery
is keyed by its id, and the workflow's topics are co-partitioned (``choreo.topology``), so
partition *p* of each topic holds the same deliveries. The rebuild holds one partition's
deliveries at once, not the window's; a partition of more than ``PASS_RECORDS`` records is
read once per share of its deliveries (split by a salted hash of the delivery id), so what
a pass holds is bounded whatever the window. A delivery's facts must all be in one pass
(a release read after its booking was written would restore a finished delivery's drone),
so a first read checks that every record lies in its delivery's partition by the producers'
partitioner; when one does not (partitions added within the window, another partitioner, a
record keyed by something else than its delivery), or the topics' partition counts differ,
the workflow's topics are read as one group, still in shares. What crosses partitions is
read first and kept, and it is small: the runtime's shared topics (``recovery``, its dead
letters, the compensation log, which is keyed by delivery and step) hold failures only,
and a pool keeps each member's latest holder and the holds not yet ended.

**Procedure.** Stop the workflow's services, run ``rebuild-state``, start them. Between a
wipe and the end of the rebuild a running service would decide on empty state (a pool with
no members, a join with no parts). A paused one (SIGSTOP) is not stopped: it resumes the
batch it had begun with the answers read before the wipe (a drone taken in its step's begin
while dispatch is asked) and finishes it on the rebuilt state. The
rebuild ends by writing ``choreo:state:ready``; a runtime that pauses its batches while that
key is missing makes the procedure safe with the services running.
"""

from __future__ import annotations

import gc
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import redis
from confluent_kafka import Message, TopicPartition

from choreo import layout
from choreo.batch import BatchScript, Item
from choreo.kafka import headers_if_readable, wait_transactions_settled
from choreo.config import settings
from choreo.dedupe import seen_field, seen_key
from choreo.envelope import H_CORRELATION_ID, MAX_ID_CHARS, Envelope, header_value, now_ms
from choreo.kafka import admin
from choreo.events import Event, disagrees_with
from choreo.join import FAILED, Join, fanin_fields, result_text
from choreo.outcomes import undoes
from choreo.ops.dlq import DeadLetter
from choreo.ops.records import (BodyDecoder, Progress, Rec, Span, existing_topics, partition_for, read, reader,
                                resolve)
from choreo.pool import Pool
from choreo.record import Record, RebuildRule
from choreo.redis_client import NodePipelines, connect, raise_first
from choreo.runner import RECOVERY_TOPIC, dlq_topic, read_input
from choreo.release import awaiting_key, released
from choreo.runtime_events import CompensationRecord, StepReport
from choreo.serde import MAX_VALUE_BYTES, Decoder, DecodeFailure, RegistryUnavailable, registry_client
from choreo.state import MAX_ERROR_CHARS, Restored, Source, StateTable, StepStatus, delivery_key, index_member
from choreo.supervision import CLOSED_BY_FAILURE, awaiting_operator_index, undo_fields
from choreo.workflow import Workflow

READY_KEY = "choreo:state:ready"
DEFAULT_WINDOW_S = 7 * 24 * 3600
WRITE_CHUNK = 5000  # items per call: a transition's steps, merged keys, a ZADD's members
# the records a pass reads before a partition is split into shares of its deliveries: the
# bound on what the rebuild holds (about 3 KB a record), paid for by reading the partition
# once per share
PASS_RECORDS = 500_000
# a key's fields per merge item: an item's arguments are unpacked at once, and Lua refuses
# 8,000 values or more (a hostile writer can give one delivery that many dedupe entries)
MERGE_PAIRS = 1000
# how long a read waits out a schema registry that does not answer before the rebuild stops
REGISTRY_WAIT_S = 60.0
T = TypeVar("T")
E = TypeVar("E", bound=Event)
# KEYS[1] a hash; ARGV: a TTL in seconds (0: none), then field and value pairs, each written
# only where the field is absent (merge-only): one script item per key and not a command per
# field, so the rebuild waits for Redis's work rather than for its round trips
_MERGE = """
for i = 2, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
"""
# how far apart two producers' record times (CreateTime) may be: a hold recorded about when a
# failure gave it back is taken as recorded after (held again: a drone kept, never booked twice)
CLOCK_SLACK_MS = 5_000
SHARED = {RECOVERY_TOPIC, CompensationRecord.topic}  # never prefixed
# read before the partition passes and kept: keyed otherwise, or partitioned apart from the
# workflow's topics, and holding failures only
SIDE = SHARED | {dlq_topic(t) for t in SHARED}
# what the supervisor's scan wrote to the compensation log with an empty correlation id
SCAN_STATUSES = {"COMPENSATING", "COMPENSATION_FAILED"}


@dataclass(frozen=True)
class Pass:
    """Spans read together, of which one share of the deliveries is kept (by a salted hash
    of the delivery id, so no writer can aim records at one share): a partition too big for
    one pass is read once per share, each read holding only its share's facts."""

    spans: list[Span]
    share: int = 0
    shares: int = 1
    salt: bytes = b""

    @property
    def accept(self) -> Callable[[Message], bool] | None:
        if self.shares == 1:
            return None
        return lambda message: self.share_of(delivery_of(headers_if_readable(message), message.key())) == self.share

    def share_of(self, delivery: str) -> int:
        digest = hashlib.blake2b(delivery.encode(), digest_size=8, key=self.salt).digest()
        return int.from_bytes(digest, "big") % self.shares


def delivery_of(headers: Any, key: bytes | None) -> str:
    """The delivery a record is about: its envelope's correlation id (the last, as the
    services read it), else its key. Read from the raw record, so a share and the stray
    check decide by what the facts are kept under."""
    correlation = header_value(headers, H_CORRELATION_ID)
    if correlation:
        return correlation[:MAX_ID_CHARS]
    return key.decode(errors="replace") if key is not None else ""


@dataclass(frozen=True)
class Reader:
    """A service that reads a topic, and what decides whether it takes a record of it."""

    service: str
    step: str | None  # the step its reading begins, if any
    origin: str  # the topic it reads the step's events on (a retry topic's origin)
    deadline_ms: int
    max_hops: int
    model: type[Event]  # what it decodes the topic's records to (``Rebuilder.decoders``)


@dataclass(slots=True)
class Trigger:
    """A step's latest trigger: where it lies and when it was written, not the record (the
    rebuild holds one per step of every delivery of the window until it writes)."""

    step: str
    service: str
    source: Source
    timestamp_ms: int
    attempt: int
    deadline_ms: int
    event_id: str = ""


@dataclass(slots=True)
class Hold:
    member: str
    since_ms: int  # when this holder's hold was first recorded
    last_ms: int  # ... and last (a copy, a replay)


@dataclass(slots=True)
class DeliveryFacts:
    results: dict[str, tuple[int, bool, str]] = field(default_factory=dict)  # part -> (ts, ok, result)
    outcome: str = ""
    undo: dict[str, str] = field(default_factory=dict)  # the failure's undo order and reason
    holds: dict[str, Hold] = field(default_factory=dict)  # pool -> this delivery's hold
    ended: set[str] = field(default_factory=set)  # pools whose hold of it ended (in any order)
    # pool -> when the first failure read by the supervisor gave back what the delivery held
    # there (a hold recorded after it, or about then, is not taken as given back)
    given_back: dict[str, int] = field(default_factory=dict)
    records: dict[str, dict[str, str]] = field(default_factory=dict)  # record name -> fields
    triggers: dict[str, Trigger] = field(default_factory=dict)  # step -> latest trigger
    dead_letters: int = 0  # its events in dead-letter topics: the state stays for a redrive
    terminal: tuple[str, int, int] | None = None  # its first success outcome: topic, partition, offset
    failure_unread: bool = False  # a failure event of it not consumed by every service that reads it


@dataclass
class RebuildReport:
    since_ms: int
    records_read: int = 0
    deliveries: int = 0
    outcomes: int = 0
    fanin_fields: int = 0
    steps: int = 0
    open_steps: int = 0  # pending again: their triggers are not consumed yet
    closed_steps: int = 0  # not consumed either, but their delivery had failed: closed
    bookings_restored: int = 0
    bookings_superseded: int = 0
    bookings_left_free: int = 0  # held by a step whose undo an operator marked done by hand
    awaiting_operator: int = 0  # steps whose undo failed for good, listed again for a decision
    booking_conflicts: list[str] = field(default_factory=list)
    seen_entries: int = 0
    service_records: int = 0
    pool_members: int = 0
    released_skipped: int = 0  # released deliveries (choreo.release): their tombstone is left alone
    awaiting_release: int = 0  # successful deliveries handed back to the release
    passes: int = 0  # reads of a share of the window, each written before the next
    most_deliveries_held: int = 0  # the largest pass's deliveries: what sets the memory
    one_group_because: str = ""  # why the workflow's topics were not read a partition at a time
    seconds: float = 0.0
    # where the time went (the pipeline waits for the rebuild): waiting for transactions in
    # doubt, reading the topics, and each kind of write
    phase_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class Declared:
    """What the workflow's declarations say one (canonical) topic restores."""

    parts: list[tuple[Join, str, bool, type[Event], str]] = field(default_factory=list)  # ..., the join's service
    outcome: tuple[Join, str, type[Event]] | None = None  # ..., the event that publishes it
    holds: list[tuple[Pool, str]] = field(default_factory=list)  # pool, its service
    ends: list[tuple[Pool, str, bool, type[Event]]] = field(default_factory=list)  # ..., when consumed, the event
    records: list[tuple[Record, RebuildRule, str]] = field(default_factory=list)  # record, rule, its service


def declarations(workflow: Workflow) -> dict[str, Declared]:
    """Canonical topic -> what it restores, from every service's joins, pools and records."""
    found: dict[str, Declared] = {}

    def at(topic: str) -> Declared:
        return found.setdefault(topic, Declared())

    for service in workflow.services:
        for join in service.joins:
            for name, part in join.parts.items():
                at(part.ok.topic).parts.append((join, name, True, part.ok, service.name))
                if part.failed is not None:
                    at(part.failed.topic).parts.append((join, name, False, part.failed, service.name))
            for model, outcome in join.outcomes.items():
                at(model.topic).outcome = (join, outcome, model)
        for pool in service.pools:
            if pool.held_by is not None:
                at(pool.held_by[0].topic).holds.append((pool, service.name))
            for end in pool.freed:
                at(end.model.topic).ends.append((pool, service.name, end.when_consumed, end.model))
        for record in service.records:
            for rule in record.rules:
                at(rule.model.topic).records.append((record, rule, service.name))
    return found


class Rebuilder:
    """Collects the facts from the topics, then writes them merge-only (see module doc)."""

    def __init__(self, workflow: Workflow, client: redis.Redis, grace_s: float = 10.0,
                 prefix: str = "", pass_records: int = PASS_RECORDS, partitioner: str = "consistent_random",
                 registry_wait_s: float = REGISTRY_WAIT_S) -> None:
        self.workflow = workflow
        self.prefix = prefix
        self.pass_records = pass_records
        self.partitioner = partitioner  # the producers': a delivery's records are in its partition
        self.declared = declarations(workflow)
        # the pipeline's topics under this workflow's naming, mapped back to the canonical names
        self.canonical = {prefix + t: t for t in self.declared}
        self.canonical.update({t: t for t in SHARED})
        self.client = client
        self.grace_ms = int(grace_s * 1000)
        # one pass's: written, then dropped before the next pass reads
        self.facts: dict[str, DeliveryFacts] = {}
        self.seen: list[tuple[str, str, str]] = []  # (delivery, field, position)
        self.released: set[str] = set()
        # kept from pass to pass: the side topics' facts (failures only) and the pools' holds
        self.dead_lettered: set[tuple[str, str]] = set()  # (service, source position)
        self.reports: dict[str, dict[tuple[str, int], str]] = {}  # delivery -> (step, attempt) -> error
        self.compensation: dict[str, dict[str, str]] = {}  # delivery -> forward step -> status
        self.side_dead_letters: dict[str, int] = {}  # delivery -> its dead letters in the side topics
        self.side_seen: list[tuple[str, str, str]] = []  # the side topics' dedupe entries
        self.latest_holds: dict[str, dict[str, tuple[int, str]]] = {}  # pool -> member -> (since, holder)
        self.open_holds: list[tuple[str, str, str]] = []  # (pool, holder, member): not ended
        self.bodies = BodyDecoder()
        self.registry_wait_s = registry_wait_s
        self._consumed: dict[tuple[str, str, int], int] = {}  # (service, topic, partition) -> committed
        # handler topic (origin or retry) -> the services that read it
        self.handlers: dict[str, list[Reader]] = {}
        registry = registry_client()
        # the services' decoders, one per topic and model: a record is decoded once for every
        # service that reads it so, and for the declarations' facts of that model
        self.decoders: dict[tuple[str, type[Event]], Callable[[bytes | None], Event]] = {}
        for service in workflow.services:
            for topic, handler in service.handlers.items():
                self.decoders.setdefault((topic, handler.model), Decoder(handler.model, topic, registry))
                self.handlers.setdefault(topic, []).append(Reader(
                    service.name, handler.step, handler.topic, int(handler.deadline_s * 1000),
                    service.max_hops, handler.model))
        self.records = {record.name: record for s in workflow.services for record in s.records}
        self.pools = {pool.name: pool for s in workflow.services for pool in s.pools}
        self.compensable = set(workflow.compensations())
        self.step_names = {step.name for step in workflow.steps}
        self._merge_script = BatchScript(client, "rebuild_merge", _MERGE)

    def merge_fields(self, writes: Iterable[tuple[str, Mapping[str, str | int], int]]) -> None:
        """(key, fields, TTL s or 0) each: the fields written where absent and the TTL set
        (also on a key with no field to write, as an EXPIRE would), ``WRITE_CHUNK`` items per
        call."""
        items: list[Item] = []
        for key, fields, ttl_s in writes:
            pairs = [x for pair in fields.items() for x in pair]
            if pairs or ttl_s:
                items += [([key], [ttl_s, *pairs[i:i + 2 * MERGE_PAIRS]])
                          for i in range(0, max(1, len(pairs)), 2 * MERGE_PAIRS)]
        for chunk in _chunks(items, WRITE_CHUNK):
            self._merge_script.run(chunk)

    def topics(self, present: dict[str, int]) -> list[str]:
        wanted = set(self.handlers) | set(self.canonical)
        wanted |= {dlq_topic(t) for t in self.handlers if not t.startswith("retry.")}
        return sorted(t for t in wanted if t in present)

    # -- reading ---------------------------------------------------------------------------

    def passes(self, consumer: Any, since_ms: int, report: RebuildReport) -> list[Pass]:
        """The window's passes in the order they are read: the side topics', then one per
        partition number of the workflow's topics, each split into shares of its deliveries
        past ``pass_records`` records. The workflow's topics are read as one group instead
        when a partition number does not hold the same deliveries in each of them (their
        counts differ, or a record lies outside its delivery's partition: partitions added
        within the window, another partitioner, a record keyed by something else)."""
        present = existing_topics(consumer)
        spans = [s for t in self.topics(present) for s in resolve(consumer, t, since_ms=since_ms)]
        workflow = [s for s in spans if s.topic not in SIDE]
        counts = {present[s.topic] for s in workflow}
        if len(counts) > 1:
            report.one_group_because = "the workflow's topics have different partition counts"
        elif len({s.partition for s in workflow}) > 1:
            report.one_group_because = self._stray(workflow, counts.pop())
        groups: dict[int, list[Span]] = {}
        for span in workflow:
            groups.setdefault(0 if report.one_group_because else span.partition, []).append(span)
        salt = secrets.token_bytes(16)
        passes = [Pass([s for s in spans if s.topic in SIDE])]
        for _, group in sorted(groups.items()):
            shares = max(1, -(-sum(s.size for s in group) // self.pass_records))
            passes += [Pass(group, share, shares, salt) for share in range(shares)]
        return passes

    def _stray(self, spans: list[Span], partitions: int) -> str:
        """The first record that lies outside its delivery's partition (by the producers'
        partitioner), as a sentence, or "": one read of the window, nothing decoded."""
        def outside(message: Message) -> bool:  # a record of no delivery gives no fact
            delivery = delivery_of(headers_if_readable(message), message.key()).encode()
            return bool(delivery) and partition_for(delivery, partitions, self.partitioner) != message.partition()

        for partition in sorted({s.partition for s in spans}):  # as the passes read: what it buffers
            consumer = reader()
            try:
                for record in read(consumer, [s for s in spans if s.partition == partition], accept=outside):
                    return f"{record.position} lies outside its delivery's partition"
            finally:
                consumer.close()
        return ""

    def run(self, since_ms: int, report: RebuildReport, progress_total: Callable[[int], None] | None = None,
            progress: Progress | None = None) -> None:
        """Read and write the window pass by pass (see the module doc), then what the passes kept."""
        consumer = reader()
        try:
            with _timed(report, "plan"):
                passes = self.passes(consumer, since_ms, report)
            spans = {s for p in passes for s in p.spans}
            self._consumed = self._committed(consumer, {(s.topic, s.partition) for s in spans})
        finally:
            consumer.close()
        report.records_read = sum(s.size for s in spans)
        if progress_total is not None:
            progress_total(sum(s.size for p in passes for s in p.spans))  # a share reads it all
        with _timed(report, "pools"):
            report.pool_members = sum(pool.grow(self.client) for pool in self.pools.values())
        for each in passes:
            with _timed(report, "read"):
                consumer = reader()  # its own: nothing of an earlier read's positions
                try:
                    for record in read(consumer, each.spans, progress, accept=each.accept):
                        self._fact(record, self._consumed)
                finally:
                    consumer.close()
            self.write(report)
        for name, part in (("side", self._write_side), ("holds", self._write_holds)):
            with _timed(report, name):
                part(report)
        self.client.set(READY_KEY, now_ms())

    def _committed(self, consumer: Any, tps: set[tuple[str, int]]) -> dict[tuple[str, str, int], int]:
        """Each service group's committed offset on every partition it consumes."""
        out: dict[tuple[str, str, int], int] = {}
        for service in self.workflow.services:
            mine = [TopicPartition(t, p) for t, p in sorted(tps) if t in service.handlers]
            if not mine:
                continue
            probe = reader(**{"group.id": service.name})
            try:
                for tp in probe.committed(mine, timeout=10):
                    out[(service.name, tp.topic, tp.partition)] = tp.offset
            finally:
                probe.close()
        return out

    def _fact(self, r: Rec, committed: dict[tuple[str, str, int], int]) -> None:
        env = r.envelope
        delivery = delivery_of(r.headers, r.key)
        if not delivery:
            return

        def consumed_by(service: str) -> bool:
            return committed.get((service, r.topic, r.partition), -1) > r.offset

        if r.topic in SIDE:
            self._side_fact(r, delivery, env, consumed_by)
            return
        if r.topic.endswith(".dlq"):
            if self._dead_letter(r):
                self.facts.setdefault(delivery, DeliveryFacts()).dead_letters += 1
            return
        facts = self.facts.setdefault(delivery, DeliveryFacts())
        declared = self.declared.get(self.canonical.get(r.topic, ""))
        handlers = self.handlers.get(r.topic, ())
        reads: dict[type[Event], Event | DecodeFailure] = {}  # model -> the record as read to it
        written: list[dict[str, Any] | str] = []  # the writer's body, once decoded

        def accepts(service: str) -> bool:
            """The service reads the record when it comes to it, not dead-letters it unread:
            what it does on reading one it refuses (a join's part, a record, a pool member
            given back, a failure's undos) it never did."""
            reader = next((h for h in handlers if h.service == service), None)
            return reader is None or env is None or self.takes(reader, env, r, reads)

        def read_by(service: str) -> bool:
            return consumed_by(service) and accepts(service)

        def event_as(model: type[E]) -> E | None:
            """The event a declared fact reads, or ``None`` for a record no service takes
            (no usable envelope, or a body that names another delivery or owner than its
            envelope, which the services dead-letter unread: ``events.disagrees_with``): as
            the services decode it where one of them reads the topic as ``model``, else from
            the writer's body."""
            if env is None:
                return None
            if (r.topic, model) in self.decoders:
                try:  # read_input's checks but the hop limit, which is each reader's
                    return cast(E, read_input(self._memo(r.topic, model, reads), r.value, env, env.hops))
                except DecodeFailure:
                    return None
            if not written:  # a value over what a consumer takes is refused by any reader
                written.append(self.decode(r.topic, r.value) if len(r.value or b"") <= MAX_VALUE_BYTES else "")
            body = written[0]
            return _event(model, body) if isinstance(body, dict) and not disagrees_with(body, env) else None

        if declared is not None:
            self._declared_fact(declared, delivery, facts, r, event_as, accepts, read_by)
        for reader in handlers:
            if env is not None and consumed_by(reader.service):
                self.seen.append((delivery, seen_field(reader.service, env.event_id, env.attempt), r.position))
            # a record its service dead-letters unread (past its hop limit, a body it cannot
            # decode or that disagrees with its envelope) began no step of it
            if reader.step is None or env is None or not self.takes(reader, env, r, reads):
                continue
            latest = facts.triggers.get(reader.step)
            if latest is not None and (latest.event_id, latest.attempt) == (env.event_id, env.attempt):
                continue  # a copy of the trigger already kept (the dedupe skips it): not a new try
            if latest is None or (env.attempt, r.timestamp_ms) >= (latest.attempt, latest.timestamp_ms):
                facts.triggers[reader.step] = Trigger(
                    reader.step, reader.service, Source(reader.origin, r.topic, r.partition, r.offset),
                    r.timestamp_ms, env.attempt, reader.deadline_ms, env.event_id)

    def decode(self, topic: str, value: bytes | None) -> dict[str, Any] | str:
        """A record's body as its writer wrote it (or why not, as text)."""
        return self._waiting_for_registry(lambda: self.bodies.read(topic, value))

    def takes(self, reader: Reader, env: Envelope, r: Rec, reads: dict[type[Event], Event | DecodeFailure]) -> bool:
        """Whether ``reader``'s service reads this record, as its runner decides
        (``runner.read_input``); ``reads``: the record as decoded so far, by model."""
        try:
            read_input(self._memo(r.topic, reader.model, reads), r.value, env, reader.max_hops)
        except DecodeFailure:
            return False
        return True

    def _memo(self, topic: str, model: type[Event], reads: dict[type[Event], Event | DecodeFailure]
              ) -> Callable[[bytes | None], Event]:
        """The services' decoder of ``topic`` as ``model``, decoding a record once for all
        who ask (``reads``), waiting for an unreachable registry."""
        decoder = self.decoders[(topic, model)]

        def read(value: bytes | None) -> Event:
            if model not in reads:
                try:
                    reads[model] = self._waiting_for_registry(lambda: decoder(value))
                except DecodeFailure as exc:
                    reads[model] = exc
            known = reads[model]
            if isinstance(known, DecodeFailure):
                raise known
            return known
        return read

    def _waiting_for_registry(self, read: Callable[[], T]) -> T:
        """``read()``, asked again while the registry cannot be reached, for up to
        ``registry_wait_s``: a body read as undecodable would be a fact missed (a hold not
        restored frees a drone still booked). Then the rebuild stops; what it wrote before is
        merged, so running it again is safe."""
        deadline = time.monotonic() + self.registry_wait_s
        pause = 0.2
        while True:
            try:
                return read()
            except RegistryUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"the schema registry did not answer for {self.registry_wait_s:.0f} s "
                                       f"({str(exc)[:200]}): the rebuild stopped; run it again once the "
                                       "registry answers (it merges into what it wrote)") from exc
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _side_fact(self, r: Rec, delivery: str, env: Envelope | None, consumed_by: Callable[[str], bool]) -> None:
        """A side topic's record (``SIDE``): kept until the passes that need it have run."""
        if r.topic.endswith(".dlq"):
            if self._dead_letter(r):
                self.side_dead_letters[delivery] = self.side_dead_letters.get(delivery, 0) + 1
            return
        # a value its readers refuse for its size restores nothing (nor is it decoded: ten
        # megabytes compressed to kilobytes each, kept for the whole rebuild)
        body = self.decode(r.topic, r.value) if len(r.value or b"") <= MAX_VALUE_BYTES else None
        # (a report or a record whose body names another delivery than its envelope, its
        # readers dead-letter unread: ``events.disagrees_with``; the supervisor refuses a
        # report of no workflow step, and only a step with an undo is compensated)
        if (isinstance(body, dict) and r.topic == RECOVERY_TOPIC and (report := _event(StepReport, body))
                and report.delivery_id == delivery and report.step in self.step_names):
            self.reports.setdefault(delivery, {})[(report.step, report.attempt)] = (
                f"{report.kind}: {report.error}"[:MAX_ERROR_CHARS])
        if (isinstance(body, dict) and r.topic == CompensationRecord.topic
                and (record := _event(CompensationRecord, body)) and record.step in self.compensable):
            # a scan's record written before its envelope named the delivery (a request or a
            # failure, with an empty correlation id) gives its key alone, ``<delivery>|<step>``:
            # filed under that delivery, not one of that name. No other record without a
            # delivery in its envelope counts for one (a COMPENSATED frees a pool member)
            keyed = delivery == f"{record.delivery_id}|{record.step}" and record.status in SCAN_STATUSES
            if keyed and not header_value(r.headers, H_CORRELATION_ID):
                self.compensation.setdefault(record.delivery_id, {})[record.step] = str(record.status).lower()
            elif record.delivery_id == delivery:
                self.compensation.setdefault(delivery, {})[record.step] = str(record.status).lower()
        for reader in self.handlers.get(r.topic, ()):
            if env is not None and consumed_by(reader.service):
                self.side_seen.append((delivery, seen_field(reader.service, env.event_id, env.attempt), r.position))

    def _dead_letter(self, r: Rec) -> bool:
        """Note where a dead letter's event lay; whether its delivery's state is kept for a
        redrive. It is for a letter the redrive would send again, as the runtime keeps it:
        one the runtime wrote (its ``dlq.*`` headers are the runtime's one set) with a usable
        envelope. A letter without one names no delivery, whatever its correlation header or
        key say, and one written to the topic by anyone else was never the runtime's."""
        letter = DeadLetter.of(r, set())  # read as redrive reads it: only the runtime's headers
        if letter.problem:
            return False
        self.dead_lettered.add((letter.service, f"{letter.source_topic}|{letter.source_partition}|"
                                                f"{letter.source_offset}"))
        return bool(letter.event_id)

    def _declared_fact(self, declared: Declared, delivery: str, facts: DeliveryFacts, r: Rec,
                       event_as: Callable[[type[Event]], Event | None], accepts: Callable[[str], bool],
                       read_by: Callable[[str], bool]) -> None:
        """What the declarations say this event restores (see the module doc); ``event_as``
        reads the record as a model, or gives ``None`` for a record that restores nothing."""
        for _, part, ok, model, joining in declared.parts:
            if not accepts(joining):
                continue
            event = event_as(model)
            if event is not None and part not in facts.results:
                facts.results[part] = (r.timestamp_ms, ok, result_text(event))
        if declared.outcome is not None and (deciding := event_as(declared.outcome[2])) is not None:
            join, outcome, _ = declared.outcome
            facts.outcome = facts.outcome or outcome
            if outcome == FAILED:  # unread too when its reader runs outside the workflow
                listed = undoes(getattr(deciding, "compensate", None) or (), self.workflow)  # as the supervisor lists them
                readers = self.handlers.get(r.topic, [])
                read = bool(readers) and all(read_by(reader.service) for reader in readers)
                facts.failure_unread = facts.failure_unread or not read
                if read and facts.outcome == FAILED:
                    # its reading gave back what the delivery held in the pools of services
                    # none of whose steps it lists, with no event of the pools' own
                    # (``Workflow.pools_not_undone``): a failure written by hand may leave out
                    # a completed step, whose hold would otherwise be restored for good
                    for pool in self.workflow.pools_not_undone(listed):  # the first reading gave it back
                        facts.given_back[pool.name] = min(facts.given_back.get(pool.name, r.timestamp_ms),
                                                          r.timestamp_ms)
                if not facts.undo and all(accepts(reader.service) for reader in readers):
                    # the order the supervisor asks the undos in, as it records it on reading this
                    why = f"{getattr(deciding, 'reason', '')}: {getattr(deciding, 'detail', '')}"
                    facts.undo = undo_fields(listed, why)
            if outcome == join.outcome and facts.terminal is None:
                facts.terminal = (r.topic, r.partition, r.offset)
        for pool, _ in declared.holds:
            assert pool.held_by is not None
            event = event_as(pool.held_by[0])
            member = pool.held_by[1](event) if event is not None else ""
            hold = facts.holds.get(pool.name)
            if member and (hold is None or hold.member != member):
                # the first record of a hold dates it: a copy (a replay, a redrive) comes later
                # and would make an earlier holder look like the member's latest
                facts.holds[pool.name] = Hold(member, r.timestamp_ms, r.timestamp_ms)
            elif member and hold is not None:
                hold.last_ms = max(hold.last_ms, r.timestamp_ms)
        for pool, service, when_consumed, model in declared.ends:
            if event_as(model) is not None and (not when_consumed or read_by(service)):
                facts.ended.add(pool.name)
        for record, rule, service in declared.records:
            event = event_as(rule.model)
            if event is not None and (not rule.when_consumed or read_by(service)):
                fields = facts.records.setdefault(record.name, {})
                fields.update({name: str(value) for name, value in rule.fields(event).items()})

    # -- writing ---------------------------------------------------------------------------

    def write(self, report: RebuildReport) -> None:
        """Write one pass's facts, keep what later writes need of them, and drop the rest."""
        report.passes += 1
        report.deliveries += len(self.facts)
        report.most_deliveries_held = max(report.most_deliveries_held, len(self.facts))
        with _timed(report, "released"):
            self.released = self._released()
        report.released_skipped += len(self.released)
        for name, part in (("joins", self._write_joins), ("steps", self._write_steps),
                           ("records", self._write_records), ("seen", self._write_seen),
                           ("awaiting_release", self._write_awaiting_release)):
            with _timed(report, name):
                part(report)
        self._keep_holds()
        self.facts, self.seen, self.released = {}, [], set()

    def _released(self) -> set[str]:
        """Deliveries whose tombstone says they are finished: on a live Redis, writing their
        state again would bring back what the release freed (and shorten the tombstone)."""
        return released(self.client, self.facts)

    def _unreleased(self) -> Iterable[tuple[str, DeliveryFacts]]:
        return ((d, f) for d, f in self.facts.items() if d not in self.released)

    def _failure_ttl(self, waiting: bool) -> int:
        """How long a decided delivery's state lives, as the join and the supervisor set it:
        while a failure waits to be read or an undo failed for good waits for an operator's
        decision, as long as an unread failure waits; else the retention."""
        return self.workflow.unread_failure_s if waiting else self.workflow.retention_s

    def _write_joins(self, report: RebuildReport) -> None:
        writes: list[tuple[str, Mapping[str, str | int], int]] = []
        for delivery, facts in self._unreleased():
            fields: dict[str, str | int] = {**facts.undo, **fanin_fields(facts.results)}
            dead_letters = facts.dead_letters + self.side_dead_letters.pop(delivery, 0)
            if dead_letters:
                fields["dead_letters"] = dead_letters
            if facts.outcome:
                fields["outcome"] = facts.outcome
                report.outcomes += 1
            report.fanin_fields += len(facts.results)
            # as the join does when it decides: a decided delivery's state goes in time,
            # rebuilt or not (it stayed forever, for every delivery of the window)
            waiting = "compensation_failed" in self.compensation.get(delivery, {}).values()
            ttl = self._failure_ttl(facts.failure_unread or waiting)
            writes.append((delivery_key(delivery), fields, ttl if facts.outcome else 0))
        self.merge_fields(writes)

    def _write_steps(self, report: RebuildReport) -> None:
        state = StateTable(self.client)
        triggered = [(d, f) for d, f in self._unreleased() if f.triggers]
        now = now_ms()
        # a chunk of deliveries' steps in one round trip, each delivery's in one script item
        # that runs the transitions its steps went through (open, begin, finish)
        for deliveries in _chunks(triggered, WRITE_CHUNK):
            pipe = self.client.pipeline(transaction=False)
            for delivery, facts in deliveries:
                pipe.hmget(delivery_key(delivery), list(facts.triggers))
            chunk = [(delivery, facts, t) for (delivery, facts), known in zip(deliveries, pipe.execute())
                     for t, value in zip(facts.triggers.values(), known) if value is None]
            if not chunk:
                continue
            # at the trigger's attempt: a requeue not yet read must not be claimed (and sent)
            # again under the same attempt once the supervisor finds the step past its deadline
            restored: dict[str, list[Restored]] = {}
            for delivery, facts, t in chunk:
                consumed = self._consumed.get((t.service, t.source.topic, t.source.partition), -1) > t.source.offset
                ended = self._ended(delivery, t) if consumed else None
                attempt = t.attempt
                if ended is None and facts.outcome == FAILED and t.step in self.compensable:
                    # its delivery failed before the step began: closed with a new token, as
                    # the supervisor closed it, so its queued trigger starts nothing (a drone
                    # taken for a failed delivery would be held for good: no failure is read again)
                    ended, attempt = (StepStatus.FAILED, CLOSED_BY_FAILURE), t.attempt + 1
                restored.setdefault(delivery, []).append(Restored(
                    step=t.step, attempt=attempt,
                    complete_by_ms=max(t.timestamp_ms + t.deadline_ms, now + self.grace_ms),
                    source=t.source.text(), ended=ended))
                report.open_steps += int(ended is None)
                report.closed_steps += int(ended is not None and not consumed)
            state.restore_many(list(restored.items()), now)
            report.steps += len(chunk)

    def _ended(self, delivery: str, trigger: Trigger) -> tuple[StepStatus, str]:
        """How a consumed trigger's step ended: failed when its attempt was reported to
        ``recovery`` or dead-lettered, completed otherwise."""
        error = self.reports.get(delivery, {}).get((trigger.step, trigger.attempt), "")
        if not error and (trigger.service, trigger.source.position) in self.dead_lettered:
            error = "dead-lettered"
        return (StepStatus.FAILED, error) if error else (StepStatus.COMPLETED, "")

    def _keep_holds(self) -> None:
        """A pass's holds, kept for the end: a member's latest holder is known only once
        every pass is read, and only its holds not ended can still be on."""
        for delivery, facts in self.facts.items():
            for name, hold in facts.holds.items():
                latest = self.latest_holds.setdefault(name, {})
                latest[hold.member] = max(latest.get(hold.member, (0, "")), (hold.since_ms, delivery))
                given_back = facts.given_back.get(name)
                kept = given_back is None or hold.last_ms >= given_back - CLOCK_SLACK_MS
                if name not in facts.ended and kept:
                    self.open_holds.append((name, delivery, hold.member))

    def _write_holds(self, report: RebuildReport) -> None:
        """Each member's latest hold not ended, held again; not one whose step the
        compensation log calls compensated (an undo marked done by hand gave it back with
        no event of the pool's own)."""
        for name, delivery, member in self.open_holds:
            if self.latest_holds[name][member][1] != delivery:
                report.bookings_superseded += 1
                continue
            undone = self.compensation.get(delivery, {})
            if any(pool.name == name for step, status in undone.items() if status == "compensated"
                   for pool in self.workflow.pools_of(step)):
                report.bookings_left_free += 1
                continue
            verdict = self.pools[name].restore(self.client, delivery, member)
            if verdict == "restored":
                report.bookings_restored += 1
            elif verdict.startswith("conflict:"):
                report.booking_conflicts.append(f"{member} for {delivery}: held by {verdict[9:]}")

    def _write_side(self, report: RebuildReport) -> None:
        """What the side topics gave that no pass wrote: the compensation states (once every
        step they name is in the table: the supervisor's log is their record), the dead
        letters and dedupe entries of deliveries no pass held."""
        deliveries = {*self.compensation, *self.side_dead_letters, *(d for d, _, _ in self.side_seen)}
        done = released(self.client, deliveries)
        # dead letters alone make a state here for the first time (no pass held its delivery:
        # its other records are older than the window), which goes in time
        new = self._absent(set(self.side_dead_letters) - set(self.compensation) - done)
        state = StateTable(self.client)
        pipes = NodePipelines(self.client)
        now = now_ms()
        for delivery, steps in self.compensation.items():
            if delivery not in done:
                state.put(delivery, {f"{step}.status": StepStatus(status).value for step, status in steps.items()},
                          pipes)
                # listed again as waiting for an operator, from now on as its state waits
                waiting = {index_member(delivery, step): now for step, status in steps.items()
                           if status == StepStatus.COMPENSATION_FAILED.value}
                pipe = pipes.on(delivery_key(delivery))
                if waiting:
                    pipe.zadd(awaiting_operator_index(delivery), waiting)
                    report.awaiting_operator += len(waiting)
                # a failure's state waits as the supervisor's own would, which always has a TTL
                # (one made here, or by a pass from an undo's records alone, would have none)
                ttl = self._failure_ttl(bool(waiting))
                if ttl > 0:
                    pipe.expire(delivery_key(delivery), ttl, nx=True)
        raise_first(pipes.execute())
        # dead letters count for a redrive as long as a copy could still be told apart
        ttl = settings().dedupe_ttl_s
        self.merge_fields((delivery_key(delivery), {"dead_letters": count}, ttl if delivery in new else 0)
                          for delivery, count in self.side_dead_letters.items() if delivery not in done)
        self._merge_seen(self.side_seen, done, report)

    def _absent(self, deliveries: Iterable[str]) -> set[str]:
        """The deliveries with no state in Redis (one round trip)."""
        ordered = list(deliveries)
        pipes = NodePipelines(self.client)
        for delivery in ordered:
            pipes.on(delivery_key(delivery)).exists(delivery_key(delivery))
        return {delivery for delivery, found in zip(ordered, raise_first(pipes.execute())) if not found}

    def _write_records(self, report: RebuildReport) -> None:
        writes: list[tuple[str, Mapping[str, str | int], int]] = []
        for delivery, facts in self.facts.items():
            for name, fields in facts.records.items():
                record = self.records[name]
                if record.released_with_delivery and delivery in self.released:
                    continue
                writes.append((record.key(delivery), fields, record.ttl_s or 0))
        report.service_records += len(writes)
        self.merge_fields(writes)

    def _write_seen(self, report: RebuildReport) -> None:
        self._merge_seen(self.seen, self.released, report)

    def _merge_seen(self, seen: list[tuple[str, str, str]], skipped: set[str], report: RebuildReport) -> None:
        by_delivery: dict[str, dict[str, str | int]] = {}
        for delivery, name, position in seen:
            if delivery not in skipped:
                # the first position read, as the live dedupe keeps it (and the step's trigger)
                by_delivery.setdefault(delivery, {}).setdefault(name, position)
        report.seen_entries += sum(map(len, by_delivery.values()))
        ttl = settings().dedupe_ttl_s
        self.merge_fields((seen_key(delivery), fields, ttl) for delivery, fields in by_delivery.items())

    def _write_awaiting_release(self, report: RebuildReport) -> None:
        """The supervisor's record of each terminal was lost with Redis: without it, a shipped
        delivery's rebuilt state would wait for its TTLs (63,623 deliveries' worth in the chaos
        run, RELIABILITY.md). Recorded again, the supervisor's releaser frees each one as soon as
        its readers are past its terminal, by the same rule as for any other."""
        by_key: dict[str, dict[str, int]] = {}
        for delivery, facts in self._unreleased():
            if facts.terminal is not None:
                topic, partition, offset = facts.terminal
                by_key.setdefault(awaiting_key(topic, partition), {})[delivery] = offset
                report.awaiting_release += 1
        pipe = self.client.pipeline(transaction=False)
        for key, members in by_key.items():
            for chunk in _chunks(list(members.items()), WRITE_CHUNK):
                pipe.zadd(key, dict(chunk))
        pipe.execute()


@contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """The cycle collector paused: the facts are millions of live objects and make no garbage
    cycles, and each full collection walked them all (a third of a rebuild's time on 40,000
    deliveries, bench/README.md)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def _timed(report: RebuildReport, phase: str) -> Iterator[None]:
    """Add the block's time to ``report.phase_seconds[phase]`` (a phase runs once per pass):
    an operator reads where the outage's time went."""
    started = time.perf_counter()
    try:
        yield
    finally:
        spent = report.phase_seconds.get(phase, 0.0) + time.perf_counter() - started
        report.phase_seconds[phase] = round(spent, 3)


def _event(model: type[E], body: dict[str, Any]) -> E | None:
    """The event a decoded body holds, or ``None`` when it is not one (a foreign writer). The
    body is as its writer wrote it: a newer version's fields (a BACKWARD-compatible v2 adds
    optional ones) are left out, as Avro's resolution leaves them out for the services, or
    the model would refuse every record a v2 wrote."""
    try:
        return model.from_avro({name: value for name, value in body.items() if name in model.model_fields})
    except ValueError:
        return None


def _chunks(items: list[T], size: int) -> Iterable[list[T]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def active_groups(groups: list[str]) -> dict[str, int]:
    """The groups among ``groups`` that have members right now (group → member count)."""
    client = admin()
    active = {}
    for group in groups:  # one request per group: a batched describe can stall on one group
        future = client.describe_consumer_groups([group])[group]
        members = len(future.result(timeout=15).members or [])
        if members:
            active[group] = members
    return active


def rebuild(workflow: Workflow, *, since_ms: int | None = None,
            client: redis.Redis | None = None, progress_total: Callable[[int], None] | None = None,
            progress: Progress | None = None, force: bool = False, prefix: str = "",
            pass_records: int = PASS_RECORDS, partitioner: str = "consistent_random") -> RebuildReport:
    """Read the topics from ``since_ms`` (default: a week) and restore Redis, merge-only.

    Refuses while a workflow service is consuming (see the procedure above) unless ``force``.
    """
    started = time.perf_counter()
    if not force:
        active = active_groups([s.name for s in workflow.services])
        if active:
            raise RuntimeError(f"services still consuming: {active}; stop them first (or --force)")
    since = since_ms if since_ms is not None else now_ms() - DEFAULT_WINDOW_S * 1000
    client = client or connect(settings().redis_url, socket_timeout=10)
    layout.claim(client)  # what it writes is this version's layout
    rebuilder = Rebuilder(workflow, client, prefix=prefix, pass_records=pass_records, partitioner=partitioner)
    report = RebuildReport(since_ms=since)
    # a service killed mid-transaction leaves it open until it times out: read only once
    # everything in doubt has committed or aborted, or its effects would be missed
    with _timed(report, "settle"):
        wait_transactions_settled(90)
    with _without_cycle_collection():
        rebuilder.run(since, report, progress_total, progress)
    report.seconds = time.perf_counter() - started
    return report

