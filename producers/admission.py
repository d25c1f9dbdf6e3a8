"""Admission control: refuse new deliveries at the door when the pipeline is past its limits.

Nothing else bounds work in flight in a choreography: every service just consumes what
arrives. So the submit path enforces three bounds, each checked in O(1) per request:

* **deliveries in flight** (accepted, not yet terminal), across every ingestion instance:
  a Redis sorted set of delivery ids scored by accept time. One Lua script admits a
  delivery only while the set is under the cap and its owner holds less than its share of
  the cap (``INGESTION_OWNER_SHARE``: one owner cannot take every place and leave the
  others 429s); count and add are atomic, so concurrent instances cannot overshoot either
  bound. Each owner's count is a field of a hash next to the set, kept in step with it by
  the same scripts that add and remove its members. Terminal deliveries leave the set lazily: a background
  trimmer reads the ``outcome`` the delivery service writes into the state hash, for the
  oldest page and one rotating page per tick (bounded work, never a full scan per request).
  An entry older than ``inflight_max_age_s`` without an outcome is dropped from the count
  with a metric and a warning: by then it is the supervisor's, and one stuck delivery must
  not close the door for good.
* **backlog**: the lag on ``delivery.requested`` of the slowest consumer group that runs a
  step on it, measured by the same background thread every ~0.5 s with the AdminClient
  (committed offsets against read_committed end offsets). Requests only read the last figure.
* **local producer queue**: publishes awaiting the broker's confirmation in this process
  (enforced by ``producers.submit``, which owns the producer).

Past the first two the answer is 429 with ``Retry-After``; nothing is queued on the side.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import redis
from confluent_kafka import IsolationLevel, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

from choreo.kafka import CommittedOffsets, admin as kafka_admin
from choreo.keys import tagged
from choreo.logs import get_logger
from choreo.state import delivery_key
from choreo.workflow import Workflow
from producers import metrics
from producers.errors import AdmissionRefused
from producers.settings import IngestionSettings

# A delivery whose state hash does not exist yet may be between admission and publish:
# only an entry older than this with no hash at all is taken as gone (state expired).
MISSING_STATE_GRACE_S = 60.0
MAX_RETRY_AFTER_S = 30

# Verdicts of the admission script, per delivery.
ADMITTED, PAST_CAP, PAST_OWNER_SHARE = 0, 1, 2

# KEYS: the in-flight set, each owner's count (hash), each delivery's owner (hash).
# ARGV: now ms, cap, an owner's cap, then (delivery id, owner) pairs. Admits each in order
# while the set is under the cap and its owner under its own (one already in the set is
# admitted: a retry); returns {set size, {verdict per pair}}.
_ADMIT = """
local n = redis.call('ZCARD', KEYS[1])
local cap, owner_cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local verdicts = {}
for i = 4, #ARGV, 2 do
  local id, owner, verdict = ARGV[i], ARGV[i + 1], 0
  if not redis.call('ZSCORE', KEYS[1], id) then
    if n >= cap then
      verdict = 1
    elseif (tonumber(redis.call('HGET', KEYS[2], owner)) or 0) >= owner_cap then
      verdict = 2
    else
      redis.call('ZADD', KEYS[1], ARGV[1], id)
      redis.call('HINCRBY', KEYS[2], owner, 1)
      redis.call('HSET', KEYS[3], id, owner)
      n = n + 1
    end
  end
  verdicts[#verdicts + 1] = verdict
end
return {n, verdicts}
"""

# KEYS: as _ADMIT's. ARGV: delivery ids leaving the set; their owners' counts go down with
# them. Returns how many were in the set.
_REMOVE = """
local gone = 0
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    gone = gone + 1
    local owner = redis.call('HGET', KEYS[3], ARGV[i])
    if owner then
      redis.call('HDEL', KEYS[3], ARGV[i])
      if redis.call('HINCRBY', KEYS[2], owner, -1) <= 0 then redis.call('HDEL', KEYS[2], owner) end
    end
  end
end
return gone
"""


def inflight_keys(key: str) -> list[str]:
    """The in-flight set and the two hashes kept in step with it (owner counts, owners), in
    one hash slot (``choreo.keys.tagged``): one script updates all three."""
    base = tagged(key)
    return [base, f"{base}:owners", f"{base}:owner_of"]


def owner_cap(cap: int, share: float) -> int:
    """An owner's places: ``share`` of the cap, rounded down (exact: 0.29 of 100 is 29), at
    least one."""
    return max(1, math.floor(Fraction(str(share)) * cap))


def lag_groups(workflow: Workflow, topic: str, configured: str = "") -> list[str]:
    """The consumer groups whose lag is the backlog: configured, or the workflow's consumers
    of ``topic`` (a service's group id is its name)."""
    if configured.strip():
        return [g.strip() for g in configured.split(",") if g.strip()]
    return workflow.consumer_groups(topic)


class InFlight:
    """The cap on deliveries accepted and not yet terminal, shared by all instances."""

    def __init__(self, client: redis.Redis, key: str, cap: int, max_age_s: float,
                 page: int, owner_cap: int) -> None:
        self.client = client
        self.keys = inflight_keys(key)
        self.key = self.keys[0]  # the set itself
        self.cap = cap
        self.owner_cap = owner_cap
        self.max_age_ms = int(max_age_s * 1000)
        self.page = page
        self._admit = client.register_script(_ADMIT)
        self._remove = client.register_script(_REMOVE)
        self._cursor = 0
        self.log = get_logger(component="admission")

    def admit(self, items: Sequence[tuple[str, str]], now_ms: int) -> tuple[list[int], int]:
        """Reserve places for (delivery id, owner) ``items`` in order, within the cap and each
        owner's share (idempotent): a verdict per item (``ADMITTED``, ``PAST_CAP``,
        ``PAST_OWNER_SHARE``) and the set's size after."""
        args: list[str | int] = [now_ms, self.cap, self.owner_cap]
        for delivery_id, owner in items:
            args += [delivery_id, owner]
        count, verdicts = self._admit(keys=self.keys, args=args)
        return [int(v) for v in verdicts], int(count)

    def release(self, delivery_ids: Sequence[str]) -> None:
        """Give the places back: the deliveries were never accepted."""
        if delivery_ids:
            self._remove(keys=self.keys, args=list(delivery_ids))

    def count(self) -> int:
        return int(self.client.zcard(self.key))

    def trim(self, now_ms: int) -> int:
        """Drop terminal (or long-gone) deliveries from the oldest page and a rotating page."""
        oldest = self.client.zrange(self.key, 0, self.page - 1, withscores=True)
        rotating = self.client.zrange(self.key, self._cursor, self._cursor + self.page - 1,
                                      withscores=True)
        self._cursor = 0 if len(rotating) < self.page else self._cursor + self.page
        entries: dict[str, float] = {m.decode(): s for m, s in (*oldest, *rotating)}
        if not entries:
            return 0
        ids = list(entries)
        pipe = self.client.pipeline(transaction=False)
        for delivery_id in ids:
            pipe.hget(delivery_key(delivery_id), "outcome")
            pipe.exists(delivery_key(delivery_id))
        replies = pipe.execute()
        done, expired = [], []
        for i, delivery_id in enumerate(ids):
            outcome, exists = replies[2 * i], replies[2 * i + 1]
            age_ms = now_ms - entries[delivery_id]
            if outcome is not None or (not exists and age_ms > MISSING_STATE_GRACE_S * 1000):
                done.append(delivery_id)
            elif age_ms > self.max_age_ms:
                expired.append(delivery_id)
        if expired:
            metrics.INFLIGHT_EXPIRED.inc(len(expired))
            self.log.warning("in-flight entries expired without an outcome",
                             count=len(expired), delivery_ids=expired[:20])
        if done or expired:
            self.release([*done, *expired])
        return len(done) + len(expired)


@dataclass
class Backlog:
    """The last lag measurement: the slowest group's lag and how fast it drains."""

    lag: int = 0
    drain_per_s: float = 0.0
    measured_at: float = 0.0  # time.monotonic(); 0: never
    per_group: dict[str, int] | None = None


class LagMeter:
    """Consumer lag of ``groups`` on ``topic``: end offsets (read_committed) minus committed."""

    def __init__(self, client: AdminClient, topic: str, groups: list[str],
                 timeout_s: float = 5.0) -> None:
        self.client = client
        self.topic = topic
        self.groups = groups
        self.timeout_s = timeout_s
        self._partitions: list[int] = []
        self._partitions_at = 0.0
        self._last: tuple[float, dict[str, int]] | None = None  # (time, committed sum per group)
        self.committed = CommittedOffsets(timeout_s)

    def partitions(self) -> list[int]:
        """The topic's partitions, refreshed every 30 s (partitions can be added)."""
        if not self._partitions or time.monotonic() - self._partitions_at > 30:
            meta = self.client.list_topics(self.topic, timeout=self.timeout_s).topics[self.topic]
            if meta.error is not None:
                raise RuntimeError(f"topic {self.topic}: {meta.error}")
            self._partitions = sorted(meta.partitions)
            self._partitions_at = time.monotonic()
        return self._partitions

    def _offsets(self, spec: OffsetSpec, parts: list[int]) -> dict[int, int]:
        request = {TopicPartition(self.topic, p): spec for p in parts}
        futures = self.client.list_offsets(request, isolation_level=IsolationLevel.READ_COMMITTED,
                                           request_timeout=self.timeout_s)
        return {tp.partition: int(f.result().offset) for tp, f in futures.items()}

    def measure(self) -> Backlog:
        parts = self.partitions()
        ends = self._offsets(OffsetSpec.latest(), parts)  # type: ignore[no-untyped-call]
        starts = self._offsets(OffsetSpec.earliest(), parts)  # type: ignore[no-untyped-call]
        lags: dict[str, int] = {}
        committed_sums: dict[str, int] = {}
        for group in self.groups:
            lag = committed_sum = 0
            for partition, offset in self.committed.on_topic(group, self.topic, parts).items():
                # no commit yet: the group starts from the earliest offset (auto.offset.reset)
                position = offset if offset >= 0 else starts[partition]
                lag += max(0, ends[partition] - position)
                committed_sum += position
            lags[group] = lag
            committed_sums[group] = committed_sum
        now = time.monotonic()
        slowest = max(lags, key=lambda g: lags[g]) if lags else ""
        drain = 0.0
        if self._last is not None and slowest in self._last[1] and now > self._last[0]:
            drain = max(0.0, (committed_sums[slowest] - self._last[1][slowest]) / (now - self._last[0]))
        self._last = (now, committed_sums)
        return Backlog(lag=lags.get(slowest, 0), drain_per_s=drain, measured_at=now, per_group=lags)


class Admission:
    """The door: cheap checks per request, measurements in one background thread."""

    def __init__(self, cfg: IngestionSettings, client: redis.Redis, workflow: Workflow,
                 topic: str, admin: AdminClient | None = None,
                 clock_ms: Callable[[], int] | None = None) -> None:
        self.cfg = cfg
        self.inflight = InFlight(client, cfg.inflight_key, cfg.max_in_flight,
                                 cfg.inflight_max_age_s, cfg.trim_page,
                                 owner_cap(cfg.max_in_flight, cfg.owner_share))
        self.groups = lag_groups(workflow, topic, cfg.lag_groups)
        self.meter = LagMeter(admin or kafka_admin(), topic, self.groups)
        self.backlog = Backlog()
        self.redis_ok = False
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed: set[str] = set()  # reasons currently refusing (logged on change only)
        # records this instance saw the broker confirm, and how many of them before the
        # last measurement began (the others it may not count)
        self._count_lock = threading.Lock()
        self._published = 0
        self._published_before_measure = 0
        self.log = get_logger(component="admission")

    # -- per request -------------------------------------------------------------------

    def check_backlog(self, pending: int = 0, wanted: int = 1) -> tuple[int, AdmissionRefused | None]:
        """How many of ``wanted`` requests the backlog lets in, and the refusal of the rest:
        the slowest step consumer's ``lag``, plus the ``pending`` publishes not confirmed
        yet, plus those let in here, stays under the threshold.

        A stale measurement does not refuse (the in-flight cap still holds); it makes the
        service report not ready instead, so the failure is visible without closing the door.
        """
        limit = self.cfg.max_backlog
        lag = self.lag() + pending
        if not limit or lag + wanted <= limit or not self.fresh():
            self._open("backlog")
            return wanted, None
        allowed = max(0, limit - lag)
        behind = lag + allowed  # what the refused ones find
        rate = self.backlog.drain_per_s
        wait = math.ceil((behind - limit + 1) / rate) if rate > 0 else 5 * self.cfg.retry_after_s
        self._refusing("backlog", f"consumer lag {behind} >= {limit}")
        return allowed, AdmissionRefused(
            "backlog", f"the pipeline is {behind} requests behind (limit {limit})",
            max(self.cfg.retry_after_s, min(MAX_RETRY_AFTER_S, wait)))

    def lag(self) -> int:
        """The last measured lag plus what this instance published since that measurement
        began: a flood between two measurements meets the limit, not a measurement later.
        What was consumed meanwhile still counts until the next measurement (at most the
        rate times one interval): a drain rate measured an interval ago could reopen the
        door for a request while nothing drains. Each instance counts only its own
        publishes: several let a flood past by up to the others' publishes in one interval."""
        with self._count_lock:
            return self.backlog.lag + self._published - self._published_before_measure

    def published(self, count: int) -> None:
        """``count`` records reached the topic (the broker confirmed them)."""
        with self._count_lock:
            self._published += count

    def reserve(self, items: Sequence[tuple[str, str]]) -> list[AdmissionRefused | None]:
        """Take places in flight for (delivery id, owner) ``items``, in order, within the cap
        and each owner's share (atomic across instances): None for each that got one, else
        its refusal. One owner past its share does not refuse the others' items."""
        verdicts, count = self.inflight.admit(items, self._clock_ms())
        metrics.INFLIGHT.set(count)
        cap, share = self.cfg.max_in_flight, self.inflight.owner_cap
        refusals: dict[int, AdmissionRefused | None] = {ADMITTED: None}
        if PAST_CAP in verdicts:
            self._refusing("in_flight", f"{count} deliveries in flight, cap {cap}")
            refusals[PAST_CAP] = AdmissionRefused(
                "in_flight", f"{count} deliveries in flight (cap {cap})", self.cfg.retry_after_s)
        else:
            self._open("in_flight")
        if PAST_OWNER_SHARE in verdicts:
            self._refusing("owner_share", f"an owner holds its {share} places of the cap {cap}")
            refusals[PAST_OWNER_SHARE] = AdmissionRefused(
                "owner_share", f"this owner has {share} deliveries in flight, its share of the cap "
                f"({self.cfg.owner_share} of {cap})", self.cfg.retry_after_s)
        else:
            self._open("owner_share")
        return [refusals[verdict] for verdict in verdicts]

    def release(self, delivery_ids: Sequence[str]) -> None:
        try:
            self.inflight.release(delivery_ids)
        except redis.RedisError as exc:  # the trimmer drops them once their state is gone
            self.log.warning("could not release in-flight places", delivery_ids=list(delivery_ids[:20]),
                             error=str(exc))

    def fresh(self) -> bool:
        return (self.backlog.measured_at > 0
                and time.monotonic() - self.backlog.measured_at <= self.cfg.lag_stale_s)

    def ready(self) -> dict[str, bool]:
        checks = {"redis": self.redis_ok}
        if self.cfg.max_backlog:
            checks["backlog_measured"] = self.fresh()
        return checks

    def _refusing(self, reason: str, detail: str) -> None:
        if reason not in self._closed:
            self._closed.add(reason)
            self.log.warning("admission closed", reason=reason, detail=detail)

    def _open(self, reason: str) -> None:
        if reason in self._closed:
            self._closed.discard(reason)
            self.log.info("admission reopened", reason=reason)

    # -- background ----------------------------------------------------------------------

    def tick(self) -> None:
        """One measurement round: trim the in-flight set, then measure the backlog."""
        try:
            self.inflight.trim(self._clock_ms())
            metrics.INFLIGHT.set(self.inflight.count())
            self.redis_ok = True
        except redis.RedisError as exc:
            self.redis_ok = False
            self.log.warning("in-flight trim failed", error=str(exc))
        if not self.cfg.max_backlog or not self.groups:
            return
        with self._count_lock:
            published_before = self._published
        try:
            backlog = self.meter.measure()
            with self._count_lock:
                self.backlog, self._published_before_measure = backlog, published_before
            metrics.BACKLOG.set(backlog.lag)
        except Exception as exc:  # Kafka unreachable, topic missing: retry next tick
            self.log.warning("lag measurement failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def start(self) -> None:
        if self._thread is not None:
            return
        self.tick()  # the first figures before the first request
        self._thread = threading.Thread(target=self._run, name="admission-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.lag_interval_s):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def snapshot(self) -> dict[str, Any]:
        return {"backlog": self.lag(), "measured_backlog": self.backlog.lag,
                "backlog_per_group": self.backlog.per_group or {},
                "drain_per_s": round(self.backlog.drain_per_s, 1), "groups": self.groups}
