"""Rebuild Redis from Kafka after Redis was lost: Kafka is the record, Redis a derived view.

What is rebuilt, and why each piece matters for exactly-once after a wipe:

* **Delivery outcome** (``outcome`` in ``dl:{id}``) from ``delivery.shipped`` /
  ``delivery.failed``. The dedupe entries (``seen:``) and remembered effect answers (``fx:``) are gone, so a copy
  of a step result or a requeue would otherwise find "both results in, no decision" and
  decide again: the restored outcome makes it ``late``, no second shipment.
* **Fan-in** (``fanin.package`` / ``fanin.drone`` / ``fanin.order``) from every committed
  result, consumed by the delivery service or not: the fan-in script never overwrites a
  recorded result and decides as soon as both are present, so a result recorded here and
  delivered later decides exactly once. A result consumed before the wipe would otherwise
  be forgotten and its delivery would wait forever for a pair.
* **Fleet** (``fleet:*``): the fleet is seeded again, then every booking still held is
  restored: ``drone.scheduled`` minus ``drone.released`` minus shipments the
  drone-scheduler has *consumed* (its committed offset is past them: the drone came back).
  A shipment not consumed yet keeps its drone held; the drone returns when it is consumed.
  Only a drone's **latest** committed booking can still hold it: the fleet script let a later
  delivery reserve the drone, so every earlier holder had given it back in Redis, even when
  the release or return was in a transaction that a kill aborted (a Redis effect runs before
  its Kafka commit). Earlier bookings are superseded, not restored; when the service handles
  their release again it finds no booking and does nothing. A restore never takes a drone
  someone else holds (reported as a conflict).
* **State table** (``dl:{id}`` steps + ``deadlines``), replayed through the state table's
  own transitions (``open`` / ``begin`` / ``finish``): a step whose latest trigger the
  service has committed is completed (failed when it was reported to ``recovery`` or
  dead-lettered), otherwise pending with a deadline, so the supervisor watches it again.
  Compensation states come from the supervisor's ``compensation.log``.
* **Dedupe** (``seen:{id}``): for every record each service has committed, its position,
  so a copy arriving after the wipe is still recognised.
* **Business records** derived from events: packages (``pkg:{id}``), notifications.
* **The release's record of terminals** (``release:<topic>:<partition>``): each shipped
  delivery's ``delivery.shipped`` position, so the supervisor releases its rebuilt state once
  every reader is past it, instead of leaving it to its TTLs (``choreo.release``).

Remembered effect answers (``fx:{id}``) are not rebuilt: every effect is also idempotent on its business key
(a booking by delivery id, a package by its derived id, the fan-in by its fields, the
outcome), and those keys are what is restored.

Everything is **merge-only** (a field or booking that exists is kept), so running it
twice, or once more after the services resumed, is harmless. A delivery whose tombstone
says it was released (``choreo.release``) is left as it is; a decided delivery's rebuilt
state expires as the delivery service's does; a delivery with dead letters gets its
``dead_letters`` mark back, so it is not released before a redrive.

**Procedure.** Pause the workflow's services (stop them, or SIGSTOP), run
``rebuild-state``, resume them. Between a wipe and the end of the rebuild a running
service would decide on empty state (the drone-scheduler sees no fleet, a fan-in half a
pair). The rebuild ends by writing ``choreo:state:ready``; a runtime that pauses its batches
while that key is missing makes the procedure safe with the services running (see the
report's proposed runner change).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import TopicPartition

from choreo.kafka import wait_transactions_settled
from choreo.config import settings
from choreo.dedupe import seen_field, seen_key
from choreo.envelope import now_ms
from choreo.kafka import admin
from choreo.ops.records import BodyDecoder, Progress, Rec, existing_topics, read, reader, resolve
from choreo.runner import RECOVERY_TOPIC, dlq_topic
from choreo.release import awaiting_key, released
from choreo.state import Source, StateTable, StepStatus, delivery_key
from choreo.workflow import Workflow
from consumers import fleet
from consumers.delivery import RETENTION_S as DECIDED_RETENTION_S
from consumers.package import RETENTION_S as PACKAGE_RETENTION_S
from consumers.package import package_key
from schemas.models import (
    CompensationRecord, DeliveryFailed, DeliveryShipped, DroneFailed, DroneReleased, DroneScheduled,
    PackageCancelled, PackageFailed, PackageReady,
)

READY_KEY = "choreo:state:ready"
NOTIFICATIONS = "notifications"  # the notifier's record (consumers/notifier.py)
NOTIFIER = "notifier"
DEFAULT_WINDOW_S = 7 * 24 * 3600

RESTORE_BOOKING = """
local delivery, drone = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[3], delivery) then return 'exists' end
local holder = redis.call('HGET', KEYS[2], drone)
if holder and holder ~= delivery then return 'conflict:' .. holder end
redis.call('ZREM', KEYS[1], drone)
redis.call('HSET', KEYS[2], drone, delivery)
redis.call('HSET', KEYS[3], delivery, drone)
redis.call('XADD', KEYS[4], '*', 'action', 'reserve', 'drone', drone, 'delivery', delivery, 'rebuilt', '1')
return 'restored'
"""

RESULTS = {PackageReady.topic: ("package", "ok", "package_id"), PackageFailed.topic: ("package", "fail", "reason"),
           DroneScheduled.topic: ("drone", "ok", "drone_id"), DroneFailed.topic: ("drone", "fail", "reason")}
OUTCOMES = {DeliveryShipped.topic: "shipped", DeliveryFailed.topic: "failed"}
SHARED = {RECOVERY_TOPIC, CompensationRecord.topic}  # never prefixed


@dataclass
class Trigger:
    step: str
    service: str
    handler_topic: str
    rec: Rec
    attempt: int
    deadline_ms: int
    event_id: str = ""


@dataclass
class DeliveryFacts:
    results: dict[str, tuple[int, str, str]] = field(default_factory=dict)  # kind -> (ts, ok, value)
    outcome: str = ""
    drone: str = ""
    scheduled_ms: int = 0  # when this delivery's booking of ``drone`` was first recorded
    released: bool = False
    returned: bool = False
    package: dict[str, str] = field(default_factory=dict)
    cancelled: bool = False
    notified_drone: str = ""
    triggers: dict[str, Trigger] = field(default_factory=dict)  # step -> latest trigger
    reports: dict[tuple[str, int], str] = field(default_factory=dict)  # (step, attempt) -> error
    compensation: dict[str, str] = field(default_factory=dict)  # forward step -> status
    dead_letters: int = 0  # its events in dead-letter topics: the state stays for a redrive
    terminal: tuple[str, int, int] | None = None  # its first delivery.shipped: topic, partition, offset


@dataclass
class RebuildReport:
    since_ms: int
    records_read: int = 0
    deliveries: int = 0
    outcomes: int = 0
    fanin_fields: int = 0
    steps: int = 0
    open_steps: int = 0
    bookings_restored: int = 0
    bookings_superseded: int = 0
    booking_conflicts: list[str] = field(default_factory=list)
    seen_entries: int = 0
    packages: int = 0
    notifications: int = 0
    fleet_seeded: int = 0
    released_skipped: int = 0  # released deliveries (choreo.release): their tombstone is left alone
    awaiting_release: int = 0  # shipped deliveries handed back to the release
    seconds: float = 0.0


class Rebuilder:
    """Collects the facts from the topics, then writes them merge-only (see module doc)."""

    def __init__(self, workflow: Workflow, client: redis.Redis, fleet_size: int,
                 grace_s: float = 10.0, prefix: str = "") -> None:
        self.workflow = workflow
        self.prefix = prefix
        # the pipeline's topics under this workflow's naming, mapped back to the canonical names
        self.canonical = {prefix + t: t for t in [*RESULTS, *OUTCOMES, DroneReleased.topic, PackageCancelled.topic]}
        self.canonical.update({t: t for t in SHARED})
        self.client = client
        self.fleet_size = fleet_size
        self.grace_ms = int(grace_s * 1000)
        self.facts: dict[str, DeliveryFacts] = {}
        self.seen: list[tuple[str, str, str]] = []  # (delivery, field, position)
        self.dead_lettered: set[tuple[str, str]] = set()  # (service, source position)
        self.released: set[str] = set()
        self.decode = BodyDecoder()
        self._consumed: dict[tuple[str, str, int], int] = {}  # (service, topic, partition) -> committed
        # handler topic (origin or retry) -> [(service, step, origin topic, deadline)]
        self.handlers: dict[str, list[tuple[str, str | None, str, int]]] = {}
        for service in workflow.services:
            for topic, handler in service.handlers.items():
                self.handlers.setdefault(topic, []).append(
                    (service.name, handler.step, handler.topic, int(handler.deadline_s * 1000)))

    def topics(self, present: dict[str, int]) -> list[str]:
        wanted = set(self.handlers) | set(self.canonical)
        wanted |= {dlq_topic(t) for t in self.handlers if not t.startswith("retry.")}
        return sorted(t for t in wanted if t in present)

    # -- reading ---------------------------------------------------------------------------

    def collect(self, since_ms: int, progress_total: Callable[[int], None] | None = None,
                progress: Progress | None = None) -> int:
        consumer = reader()
        try:
            present = existing_topics(consumer)
            spans = [s for t in self.topics(present) for s in resolve(consumer, t, since_ms=since_ms)]
            committed = self._consumed = self._committed(consumer, {(s.topic, s.partition) for s in spans})
            total = sum(s.size for s in spans)
            if progress_total is not None:
                progress_total(total)
            for record in read(consumer, spans, progress):
                self._fact(record, committed)
            return total
        finally:
            consumer.close()

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
        delivery = env.correlation_id if env else r.key_text
        if not delivery:
            return
        facts = self.facts.setdefault(delivery, DeliveryFacts())

        def consumed_by(service: str) -> bool:
            return committed.get((service, r.topic, r.partition), -1) > r.offset

        if r.topic.endswith(".dlq"):
            facts.dead_letters += 1
            self.dead_lettered.add((r.header("dlq.service") or "",
                                    f"{r.header('dlq.source.topic')}|{r.header('dlq.source.partition')}|"
                                    f"{r.header('dlq.source.offset')}"))
            return
        topic = self.canonical.get(r.topic, "")
        body = self.decode(r.topic, r.value) if topic else {}
        body = body if isinstance(body, dict) else {}
        if topic in RESULTS and body:
            kind, ok, name = RESULTS[topic]
            if kind not in facts.results:
                facts.results[kind] = (r.timestamp_ms, ok, str(body.get(name) or ""))
            drone = str(body.get("drone_id") or "")
            if topic == DroneScheduled.topic and drone != facts.drone:
                # the first record of a booking dates it: a copy (a replay, a redrive) comes later
                # and would make an earlier holder look like the drone's latest
                facts.drone, facts.scheduled_ms = drone, r.timestamp_ms
            if topic == PackageReady.topic:
                facts.package = {"package_id": str(body["package_id"]), "size": str(body["package_size"]),
                                 "weight_kg": str(body["weight_kg"])}
        if topic in OUTCOMES and not facts.outcome:
            facts.outcome = OUTCOMES[topic]
        if topic == DeliveryShipped.topic:
            if facts.terminal is None:
                facts.terminal = (r.topic, r.partition, r.offset)
            facts.returned = facts.returned or consumed_by(_drone_service(self.workflow))
            if consumed_by(self.prefix + NOTIFIER) and body:
                facts.notified_drone = str(body.get("drone_id") or "")
        if topic == DroneReleased.topic:
            facts.released = True
        if topic == PackageCancelled.topic:
            facts.cancelled = True
        if topic == RECOVERY_TOPIC and body:
            facts.reports[(str(body["step"]), int(body["attempt"]))] = f"{body['kind']}: {body.get('error', '')}"
        if topic == CompensationRecord.topic and body:
            facts.compensation[str(body["step"])] = str(body["status"]).lower()
        for service, step, origin, deadline_ms in self.handlers.get(r.topic, ()):
            if env is not None and consumed_by(service):
                self.seen.append((delivery, seen_field(service, env.event_id, env.attempt), r.position))
            if step is None or env is None:
                continue
            latest = facts.triggers.get(step)
            if latest is not None and (latest.event_id, latest.attempt) == (env.event_id, env.attempt):
                continue  # a copy of the trigger already kept (the dedupe skips it): not a new try
            if latest is None or (env.attempt, r.timestamp_ms) >= (latest.attempt, latest.rec.timestamp_ms):
                facts.triggers[step] = Trigger(step, service, origin, r, env.attempt, deadline_ms,
                                               env.event_id)

    # -- writing ---------------------------------------------------------------------------

    def write(self, report: RebuildReport) -> None:
        report.deliveries = len(self.facts)
        self.released = self._released()
        report.released_skipped = len(self.released)
        report.fleet_seeded = fleet.seed(self.client, self.fleet_size)
        self._write_fanin(report)
        self._write_steps(report)
        self._write_fleet(report)
        self._write_records(report)
        self._write_seen(report)
        self._write_awaiting_release(report)
        self.client.set(READY_KEY, now_ms())

    def _released(self) -> set[str]:
        """Deliveries whose tombstone says they are finished: on a live Redis, writing their
        state again would bring back what the release freed (and shorten the tombstone)."""
        return released(self.client, self.facts)

    def _unreleased(self) -> Iterable[tuple[str, DeliveryFacts]]:
        return ((d, f) for d, f in self.facts.items() if d not in self.released)

    def _write_fanin(self, report: RebuildReport) -> None:
        pipe = self.client.pipeline(transaction=False)
        for delivery, facts in self._unreleased():
            key = delivery_key(delivery)
            if facts.dead_letters:
                pipe.hsetnx(key, "dead_letters", facts.dead_letters)
            if facts.outcome:
                pipe.hsetnx(key, "outcome", facts.outcome)
                # as the delivery service does when it decides: a decided delivery's state goes
                # in time, rebuilt or not (it stayed forever, for every delivery of the window)
                pipe.expire(key, DECIDED_RETENTION_S)
                report.outcomes += 1
            for kind, (_, ok, value) in facts.results.items():
                pipe.hsetnx(key, f"fanin.{kind}", f"{ok}:{value}")
                report.fanin_fields += 1
            done = sorted((ts, kind) for kind, (ts, ok, _) in facts.results.items() if ok == "ok")
            if done:  # newest first, as the fan-in script prepends
                pipe.hsetnx(key, "fanin.order", "".join(f"{kind}," for _, kind in reversed(done)))
        pipe.execute()

    def _write_steps(self, report: RebuildReport) -> None:
        state = StateTable(self.client)
        items = [(d, t) for d, f in self._unreleased() for t in f.triggers.values()]
        pipe = self.client.pipeline(transaction=False)
        for delivery, trigger in items:
            pipe.hexists(delivery_key(delivery), trigger.step)
        exists = pipe.execute()
        now = now_ms()
        for (delivery, trigger), known in zip(items, exists):
            if known:
                continue
            r = trigger.rec
            complete_by = max(r.timestamp_ms + trigger.deadline_ms, now + self.grace_ms)
            # at the trigger's attempt: a requeue not yet read must not be claimed (and sent)
            # again under the same attempt once the supervisor finds the step past its deadline
            state.open(delivery, trigger.step, complete_by, now, attempt=trigger.attempt)
            report.steps += 1
            if self._consumed.get((trigger.service, r.topic, r.partition), -1) <= r.offset:
                report.open_steps += 1
                continue
            state.begin(delivery, trigger.step, trigger.attempt, now, trigger.deadline_ms, 1 << 30,
                        source=Source(trigger.handler_topic, r.topic, r.partition, r.offset).text())
            error = self.facts[delivery].reports.get((trigger.step, trigger.attempt), "")
            if not error and (trigger.service, r.position) in self.dead_lettered:
                error = "dead-lettered"
            state.finish(delivery, trigger.step, trigger.attempt, now,
                         StepStatus.FAILED if error else StepStatus.COMPLETED, error)
        pipe = self.client.pipeline(transaction=False)
        for delivery, facts in self._unreleased():
            for step, status in facts.compensation.items():
                # the supervisor's log is the record of compensation states
                state.put(delivery, {f"{step}.status": StepStatus(status).value}, pipe)
        pipe.execute()

    def _write_fleet(self, report: RebuildReport) -> None:
        script = self.client.register_script(RESTORE_BOOKING)
        latest: dict[str, tuple[int, str]] = {}  # drone -> (scheduled at, delivery)
        for delivery, facts in self.facts.items():
            if facts.drone:
                latest[facts.drone] = max(latest.get(facts.drone, (0, "")), (facts.scheduled_ms, delivery))
        for delivery, facts in self.facts.items():
            if not facts.drone or facts.released or facts.returned:
                continue
            if latest[facts.drone][1] != delivery:
                report.bookings_superseded += 1
                continue
            verdict = script(keys=fleet.KEYS, args=[delivery, facts.drone])
            text = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
            if text == "restored":
                report.bookings_restored += 1
            elif text.startswith("conflict:"):
                report.booking_conflicts.append(f"{facts.drone} for {delivery}: held by {text[9:]}")

    def _write_records(self, report: RebuildReport) -> None:
        pipe = self.client.pipeline(transaction=False)
        for delivery, facts in self.facts.items():
            if facts.package and delivery not in self.released:
                key = package_key(delivery)
                for name, value in facts.package.items():
                    pipe.hsetnx(key, name, value)
                pipe.hsetnx(key, "status", "cancelled" if facts.cancelled else "ready")
                pipe.expire(key, PACKAGE_RETENTION_S)
                report.packages += 1
            if facts.notified_drone:
                pipe.hsetnx(NOTIFICATIONS, delivery, facts.notified_drone)
                report.notifications += 1
        pipe.execute()

    def _write_seen(self, report: RebuildReport) -> None:
        ttl = settings().dedupe_ttl_s
        for chunk in _chunks(self.seen, 2000):
            pipe = self.client.pipeline(transaction=False)
            for delivery, name, position in chunk:
                if delivery in self.released:
                    continue
                pipe.hsetnx(seen_key(delivery), name, position)
                pipe.expire(seen_key(delivery), ttl)
            pipe.execute()
            report.seen_entries += len(chunk)


    def _write_awaiting_release(self, report: RebuildReport) -> None:
        """The supervisor's record of each terminal was lost with Redis: without it, a shipped
        delivery's rebuilt state would wait for its TTLs (63,623 deliveries' worth in the chaos
        run, RELIABILITY.md). Recorded again, the supervisor's releaser frees each one as soon as
        its readers are past its terminal, by the same rule as for any other."""
        pipe = self.client.pipeline(transaction=False)
        for delivery, facts in self._unreleased():
            if facts.terminal is not None and facts.outcome == "shipped":
                topic, partition, offset = facts.terminal
                pipe.zadd(awaiting_key(topic, partition), {delivery: offset})
                report.awaiting_release += 1
        pipe.execute()


def _drone_service(workflow: Workflow) -> str:
    """The service that holds drones: the one consuming ``delivery.shipped`` to take them back
    and producing ``drone.scheduled``."""
    for service in workflow.services:
        if DroneScheduled in service.outputs:
            return service.name
    return "drone-scheduler"


def _chunks(items: list[tuple[str, str, str]], size: int) -> Iterable[list[tuple[str, str, str]]]:
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


def rebuild(workflow: Workflow, *, since_ms: int | None = None, fleet_size: int | None = None,
            client: redis.Redis | None = None, progress_total: Callable[[int], None] | None = None,
            progress: Progress | None = None, force: bool = False, prefix: str = "") -> RebuildReport:
    """Read the topics from ``since_ms`` (default: a week) and restore Redis, merge-only.

    Refuses while a workflow service is consuming (see the procedure above) unless ``force``.
    """
    started = time.perf_counter()
    if not force:
        active = active_groups([s.name for s in workflow.services])
        if active:
            raise RuntimeError(f"services still consuming: {active}; stop them first (or --force)")
    if fleet_size is None:
        from consumers.drone_scheduler import FLEET_SIZE

        fleet_size = FLEET_SIZE
    since = since_ms if since_ms is not None else now_ms() - DEFAULT_WINDOW_S * 1000
    client = client or redis.Redis.from_url(settings().redis_url, socket_timeout=10)
    rebuilder = Rebuilder(workflow, client, fleet_size, prefix=prefix)
    report = RebuildReport(since_ms=since)
    # a service killed mid-transaction leaves it open until it times out: read only once
    # everything in doubt has committed or aborted, or its effects would be missed
    wait_transactions_settled(90)
    report.records_read = rebuilder.collect(since, progress_total, progress)
    rebuilder.write(report)
    report.seconds = time.perf_counter() - started
    return report

