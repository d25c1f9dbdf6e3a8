"""Release a finished delivery's Redis state as soon as Kafka says nothing can replay it.

A delivery's state (its step table ``dl:{id}``, the dedupe entries ``seen:{id}``, the
remembered effect answers ``fx:{id}`` and the records services declare with
``Service.record(..., released_with_delivery=True)``) exists so that a replayed or copied event of it is
harmless. Left to its TTLs (1 to 24 h) it was about 3 KB per delivery long after the
delivery ended: at 500 deliveries/s, tens of gigabytes a day (bench/README.md).

When is nothing left to replay? Once the delivery's terminal event is committed and every
consumer group that reads it has committed past it: the transactions that touched the
delivery are all committed, so no replay can come (a replay is a batch whose transaction
did not commit). Kafka knows both facts: the supervisor records each terminal's position
(partition, offset) in a sorted set per partition as it reads it, and ``Releaser`` compares
those with the groups' committed offsets (one offset fetch per group per period) and
releases everything behind all of them, one pipelined script per delivery.

What stays is a tombstone, ``dl:{id}`` = {``done``, ``outcome``}, for the dedupe window
(``CHOREO_DEDUPE_TTL_S``): a late copy of any event of the delivery is then refused by the
dedupe and the state table instead of starting it again, and status reads and admission
still see the outcome.

A delivery is kept (its TTLs apply) when a step of it is still open or one of its events was
dead-lettered: a redrive needs the dedupe entries and the steps. Only the terminal the
supervisor records is released (``delivery.shipped``): a failed delivery's compensation is a
chain of its own, and its state is what an operator reads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from prometheus_client import Counter as MetricCounter, Gauge

from choreo.dedupe import seen_key
from choreo.effects import OnceEffect, memo_key
from choreo.kafka import CommittedOffsets
from choreo.pool import GIVE_BACK
from choreo.batch import run_together
from choreo.state import StepScript, deadline_index, delivery_key, text

RELEASES = MetricCounter("choreo_releases_total", "Finished deliveries looked at for release, by verdict",
                         ["verdict"])
AWAITING = Gauge("choreo_release_awaiting", "Terminal events whose readers have not all committed past them")

# the supervisor's record of a terminal event's position (ZADD is idempotent: a replay is
# harmless). KEYS: the release set, then ``GIVE_BACK``'s keys of each pool whose members come
# back with the delivery's success (``Pool.returned_on_success``), five each. ARGV: the
# terminal's offset, the delivery id
AWAIT_RELEASE = OnceEffect("await_release", GIVE_BACK + """
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
for k = 2, #KEYS, 5 do
  give_back(KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], ARGV[2], 'return')
end
return 'awaiting'
""", remembers_itself=True)

# KEYS[1] the deadline index of the delivery's shard, KEYS[2] the step table, KEYS[3] the
# dedupe hash, KEYS[4] the effect answers, KEYS[5..] records the services declared. ARGV: delivery id, now ms,
# tombstone ttl s, then the names of the workflow's services (the ones that refuse a released
# delivery): only their fields of the shared hashes go; another subscriber's stay, under
# their own TTLs.
_RELEASE = """
local fields = redis.call('HGETALL', KEYS[2])
if #fields == 0 then return 'gone' end
local outcome, members = nil, {}
for i = 1, #fields, 2 do
  local name, value = fields[i], fields[i + 1]
  if name == 'done' then return 'done' end
  if name == 'dead_letters' then return 'kept:dead_letter' end
  if name == 'outcome' then outcome = value end
  if is_step_record(name, value) then
    if step_get(KEYS[2], name, 'status') ~= 'completed' then return 'kept:open_step' end
    members[#members + 1] = ARGV[1] .. '|' .. name
  end
end
if not outcome or outcome == '' then return 'kept:no_outcome' end
if #members > 0 then redis.call('ZREM', KEYS[1], unpack(members)) end
local ours = {}
for i = 4, #ARGV do ours[ARGV[i]] = true end
for k = 3, 4 do
  local theirs = {}
  for _, name in ipairs(redis.call('HKEYS', KEYS[k])) do
    if ours[string.match(name, '^[^:]*')] then theirs[#theirs + 1] = name end
  end
  -- by the thousand: Lua unpacks about 8,000 values at most, and copies of an event under
  -- new ids each leave a dedupe entry
  for i = 1, #theirs, 1000 do redis.call('HDEL', KEYS[k], unpack(theirs, i, math.min(i + 999, #theirs))) end
end
if #KEYS > 4 then redis.call('DEL', unpack(KEYS, 5)) end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'done', ARGV[2], 'outcome', outcome)
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 'released'
"""


def awaiting_key(topic: str, partition: int) -> str:
    return f"release:{topic}:{partition}"


def state_keys(delivery_id: str, declared: Callable[[str], list[str]]) -> list[str]:
    """A delivery's own keys: step table, dedupe entries, effect answers, and the records its
    services ``declared`` (``Workflow.released_keys``)."""
    return [delivery_key(delivery_id), seen_key(delivery_id), memo_key(delivery_id), *declared(delivery_id)]


def released(client: redis.Redis, delivery_ids: Iterable[str]) -> set[str]:
    """Which of these deliveries were released (their tombstone says so), in one round trip."""
    ids = list(delivery_ids)
    pipe = client.pipeline(transaction=False)
    for delivery_id in ids:
        pipe.hexists(delivery_key(delivery_id), "done")
    return {d for d, done in zip(ids, pipe.execute()) if done}


@dataclass
class ReleaseStats:
    verdicts: Counter[str] = field(default_factory=Counter)
    awaiting: int = 0
    blocking: dict[str, list[int]] = field(default_factory=dict)  # group -> partitions it holds back


class Releaser:
    """Releases the deliveries whose terminal on ``topic`` every group in ``groups`` passed.

    ``groups`` are the workflow's services that read ``topic`` (their group id is their
    name), ``services`` all of the workflow's services (their dedupe entries and effect
    answers go); ``extra_keys`` gives the records they declared for a delivery. ``cap`` bounds each
    partition's set of terminals awaiting release: past it (a listed service that never
    commits: not deployed, renamed) the oldest fall back to their TTLs, with a warning.
    """

    def __init__(self, client: redis.Redis, admin: AdminClient, topic: str, groups: list[str],
                 services: list[str], extra_keys: Callable[[str], list[str]], tombstone_ttl_s: int,
                 page: int = 2000, cap: int = 200_000, timeout_s: float = 5.0) -> None:
        self.client = client
        self.admin = admin
        self.topic = topic
        self.groups = groups
        self.services = services
        self.extra_keys = extra_keys
        self.tombstone_ttl_s = tombstone_ttl_s
        self.page = page
        self.cap = cap
        self.timeout_s = timeout_s
        self.committed = CommittedOffsets(timeout_s)
        self._release = StepScript(client, "release", _RELEASE)

    def passed_by_all(self, stats: ReleaseStats) -> dict[int, int]:
        """Per partition, the offset every group has committed past (the lowest commit); the
        group holding each partition back goes into ``stats.blocking``."""
        meta = self.admin.list_topics(self.topic, timeout=self.timeout_s).topics[self.topic]
        if meta.error is not None:
            raise RuntimeError(f"topic {self.topic}: {meta.error}")
        lowest: dict[int, tuple[int, str]] = {}
        for group in self.groups:
            for partition, offset in self.committed.on_topic(group, self.topic, meta.partitions).items():
                if partition not in lowest or offset < lowest[partition][0]:
                    lowest[partition] = (offset, group)
        for partition, (offset, group) in lowest.items():
            if offset <= 0:
                stats.blocking.setdefault(group, []).append(partition)
        return {partition: offset for partition, (offset, _) in lowest.items()}

    def release_due(self, now_ms: int) -> ReleaseStats:
        """One pass: every partition's terminals behind all groups, ``page`` at most each."""
        stats = ReleaseStats()
        for partition, passed in self.passed_by_all(stats).items():
            key = awaiting_key(self.topic, partition)
            if passed > 0:
                due = [text(m) for m in self.client.zrangebyscore(key, "-inf", f"({passed}",
                                                                  start=0, num=self.page)]
                if due:
                    stats.verdicts.update(self.release(due, now_ms))
                    self.client.zrem(key, *due)
            awaiting = int(self.client.zcard(key))
            if awaiting > self.cap:
                self.client.zremrangebyrank(key, 0, awaiting - self.cap - 1)
                stats.verdicts["dropped:cap"] += awaiting - self.cap
                awaiting = self.cap
            stats.awaiting += awaiting
        for verdict, n in stats.verdicts.items():
            RELEASES.labels(verdict).inc(n)
        AWAITING.set(stats.awaiting)
        return stats

    def release(self, delivery_ids: list[str], now_ms: int) -> list[str]:
        """Release these deliveries now (one round trip); each one's verdict, in order."""
        answers = run_together(self.client, [(self._release, [
            ([deadline_index(delivery_id), *state_keys(delivery_id, self.extra_keys)],
             [delivery_id, now_ms, self.tombstone_ttl_s, *self.services])
            for delivery_id in delivery_ids])])[0]
        return [text(v) for v in answers]

    def run_in_background(self, period_s: float, leading: Callable[[], bool], log: Any) -> threading.Thread:
        """Release every ``period_s`` while ``leading()``, on a thread of its own: the admin
        requests can wait seconds on a slow or moving group coordinator, and the supervisor's
        main loop must keep renewing its lease and scanning meanwhile."""
        def loop() -> None:
            warned = 0.0
            while True:
                time.sleep(period_s)
                if not leading():
                    continue
                try:
                    stats = self.release_due(int(time.time() * 1000))
                except (KafkaException, RuntimeError, redis.RedisError) as exc:
                    log.warning("release.unavailable", error=str(exc)[:300])
                    continue
                kept = {v: n for v, n in stats.verdicts.items() if not v.startswith(("released", "done"))}
                if kept:
                    log.info("release.kept", kept=kept, awaiting=stats.awaiting)
                if stats.blocking and stats.awaiting and time.monotonic() - warned > 60:
                    warned = time.monotonic()
                    log.warning("release.blocked", groups=stats.blocking, awaiting=stats.awaiting,
                                why="these groups have committed nothing on the terminal topic")

        thread = threading.Thread(target=loop, name="release", daemon=True)
        thread.start()
        return thread
