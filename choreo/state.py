"""The state table: per delivery and step, status, complete-by deadline, attempt token,
try count and failure count, in one Redis hash per delivery (``dl:{id}``; the braces are a
Redis Cluster hash tag). A sorted set ``deadlines`` indexes open steps by complete-by, so
the supervisor finds expired steps in O(expired), never by scanning every key.

Every transition is one Lua script with a condition: an attempt older than the recorded
token loses (a stale attempt cannot overwrite a newer one), a closed step stays closed.
The hash is the step's only record in Redis; Kafka remains the record of what happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

DEADLINE_INDEX = "deadlines"


class StepStatus(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


class Begin(StrEnum):
    """What the runtime may do with an input event for a step."""

    GO = "go"  # run the handler
    REPLAY = "replay"  # already completed: run again for the same (remembered) answers
    STALE = "stale"  # an older attempt than the current token: ignore
    CLOSED = "closed"  # failed or compensating: a late answer, record and ignore
    EXPIRED = "expired"  # deadline passed: start no new side effect, report it
    EXHAUSTED = "exhausted"  # the step's retry budget is spent: report it


def delivery_key(delivery_id: str) -> str:
    return f"dl:{{{delivery_id}}}"


def index_member(delivery_id: str, step: str) -> str:
    return f"{delivery_id}|{step}"


_OPEN = """
local f = ARGV[1] .. '.'
if redis.call('HEXISTS', KEYS[1], f .. 'status') == 1 then return 0 end
redis.call('HSET', KEYS[1], f .. 'status', 'pending', f .. 'complete_by', ARGV[2],
           f .. 'attempt', 1, f .. 'tries', 0, f .. 'failures', 0, f .. 'updated', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[4])
return 1
"""

_ABANDON = """
local f = ARGV[1] .. '.'
if redis.call('HGET', KEYS[1], f .. 'status') ~= 'pending' then return 0 end
for _, field in ipairs({'status', 'complete_by', 'attempt', 'tries', 'failures', 'updated'}) do
  redis.call('HDEL', KEYS[1], f .. field)
end
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

_BEGIN = """
-- a released delivery (choreo.release) is finished: nothing of it starts again
if redis.call('HEXISTS', KEYS[1], 'done') == 1 then return 'closed' end
local f = ARGV[1] .. '.'
local attempt, now = tonumber(ARGV[2]), tonumber(ARGV[3])
local status = redis.call('HGET', KEYS[1], f .. 'status')
if not status then
  local complete_by = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], f .. 'status', 'pending', f .. 'complete_by', complete_by,
             f .. 'attempt', attempt, f .. 'tries', 0, f .. 'failures', 0)
  redis.call('ZADD', KEYS[2], complete_by, ARGV[6])
  status = 'pending'
end
local token = tonumber(redis.call('HGET', KEYS[1], f .. 'attempt') or '1')
local origin = string.match(ARGV[7], '^[^|]*')
local joined = false
if attempt < token then
  -- a trigger the step already began at an older attempt is stale: the supervisor gave it
  -- away. One it never began (a fan-in's other half, queued before the requeue) joins the
  -- current attempt, or a delivery whose service was down past a deadline between the two
  -- halves would wait for a half it already has and fail at its budget. The input that
  -- joined joins again when it is replayed (its transaction aborted).
  -- (only a step with several trigger topics, ARGV[8] = '1', keeps the origins it began)
  if ARGV[8] ~= '1' then return 'stale' end
  local origins = ',' .. (redis.call('HGET', KEYS[1], f .. 'origins') or '') .. ','
  if ARGV[7] ~= redis.call('HGET', KEYS[1], f .. 'joined')
     and string.find(origins, ',' .. origin .. ',', 1, true) then return 'stale' end
  attempt, joined = token, true
  redis.call('HSET', KEYS[1], f .. 'joined', ARGV[7])
end
if status == 'completed' then
  if joined then return 'replay:' .. attempt end
  return 'replay'
end
if status ~= 'pending' and status ~= 'processing' then return 'closed' end
-- the service has now seen this input: remember where it lies even if it will not run it,
-- so the supervisor can requeue it (an expired trigger is consumed and would be lost)
redis.call('HSET', KEYS[1], f .. 'source', ARGV[7])
if now > tonumber(redis.call('HGET', KEYS[1], f .. 'complete_by')) then return 'expired' end
local tries = redis.call('HINCRBY', KEYS[1], f .. 'tries', 1)
if tries > tonumber(ARGV[5]) then return 'exhausted' end
redis.call('HSET', KEYS[1], f .. 'status', 'processing', f .. 'attempt', attempt, f .. 'updated', now)
if ARGV[8] == '1' then
  local known = redis.call('HGET', KEYS[1], f .. 'origins')
  if not known then
    redis.call('HSET', KEYS[1], f .. 'origins', origin)
  elseif not string.find(',' .. known .. ',', ',' .. origin .. ',', 1, true) then
    redis.call('HSET', KEYS[1], f .. 'origins', known .. ',' .. origin)
  end
end
if joined then return 'go:' .. attempt end
return 'go'
"""

_TRY_AGAIN = """
local f = ARGV[1] .. '.'
local token = tonumber(redis.call('HGET', KEYS[1], f .. 'attempt') or '1')
if tonumber(ARGV[2]) < token then return -1 end
return redis.call('HINCRBY', KEYS[1], f .. 'tries', 1)
"""

_FINISH = """
local f = ARGV[1] .. '.'
local attempt, now, outcome = tonumber(ARGV[2]), ARGV[3], ARGV[4]
local status = redis.call('HGET', KEYS[1], f .. 'status')
local token = tonumber(redis.call('HGET', KEYS[1], f .. 'attempt') or '1')
if attempt < token then
  redis.call('HSET', KEYS[1], f .. 'late', now)
  return 'stale'
end
if status ~= 'pending' and status ~= 'processing' then
  if status == outcome then return 'replay' end
  redis.call('HSET', KEYS[1], f .. 'late', now)
  return 'ignored'
end
redis.call('HSET', KEYS[1], f .. 'status', outcome, f .. 'updated', now)
if outcome == 'completed' then
  redis.call('HSET', KEYS[1], f .. 'completed_at', now)
  redis.call('ZREM', KEYS[2], ARGV[5])
else
  redis.call('HINCRBY', KEYS[1], f .. 'failures', 1)
  redis.call('HSET', KEYS[1], f .. 'error', ARGV[6])
  -- a failed step is due at once: the supervisor finds it even if its report was lost
  redis.call('ZADD', KEYS[2], now, ARGV[5])
end
return 'ok'
"""


# a dead-lettered event keeps its delivery's state for the redrive (choreo.release); no
# table is created for an event of a delivery that has none
_NOTE_DEAD_LETTER = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'dead_letters', 1) end
return 0
"""


@dataclass(frozen=True)
class StepState:
    step: str
    status: str
    complete_by: int
    attempt: int
    tries: int
    failures: int
    error: str
    updated: int
    source: str


class StateTable:
    """Conditional step transitions; every call is one atomic script."""

    def __init__(self, client: redis.Redis, retention_s: int = 24 * 3600) -> None:
        self.client = client
        self.retention_s = retention_s
        self._open = client.register_script(_OPEN)
        self._abandon = client.register_script(_ABANDON)
        self._begin = client.register_script(_BEGIN)
        self._try_again = client.register_script(_TRY_AGAIN)
        self._finish = client.register_script(_FINISH)
        self._note_dead_letter = client.register_script(_NOTE_DEAD_LETTER)

    def open(self, delivery_id: str, step: str, complete_by_ms: int, now_ms: int,
             pipe: Any = None) -> None:
        """Register a step as pending before its trigger is published (no-op if it exists)."""
        self._open(
            keys=[delivery_key(delivery_id), DEADLINE_INDEX],
            args=[step, complete_by_ms, now_ms, index_member(delivery_id, step)],
            client=pipe or self.client,
        )

    def abandon(self, delivery_id: str, step: str) -> None:
        """Withdraw a step opened for a trigger that was never published (still pending)."""
        self._abandon(keys=[delivery_key(delivery_id), DEADLINE_INDEX],
                      args=[step, index_member(delivery_id, step)])

    def begin(self, delivery_id: str, step: str, attempt: int, now_ms: int,
              default_deadline_ms: int, budget: int, source: str, joinable: bool = False) -> Begin:
        """Start (or replay) an attempt; ``source`` (handler topic|topic|partition|offset)
        lets the supervisor fetch the input again to requeue it."""
        return self.begin_many([(delivery_id, step, attempt, now_ms, default_deadline_ms, source)],
                               budget, {step} if joinable else set())[0][0]

    def begin_many(self, items: list[tuple[str, str, int, int, int, str]], budget: int,
                   joinable: set[str] | frozenset[str] = frozenset()) -> list[tuple[Begin, int]]:
        """``begin`` for a whole batch in one round trip: (delivery, step, attempt, now,
        default deadline ms, source) per item; each verdict comes with the attempt the input
        runs as (the current one when it joins a step requeued meanwhile). ``joinable``: the
        steps with several trigger topics (a fan-in), whose other triggers may join."""
        if not items:
            return []
        pipe = self.client.pipeline(transaction=False)
        for delivery_id, step, attempt, now, default_deadline_ms, source in items:
            self._begin(keys=[delivery_key(delivery_id), DEADLINE_INDEX],
                        args=[step, attempt, now, default_deadline_ms, budget,
                              index_member(delivery_id, step), source, "1" if step in joinable else "0"],
                        client=pipe)
        return [_started(text(r), item[2]) for r, item in zip(pipe.execute(), items)]

    def complete_many(self, items: list[tuple[str, str, int]], now_ms: int) -> list[str]:
        """``finish(COMPLETED)`` for a whole batch in one round trip: (delivery, step, attempt)."""
        if not items:
            return []
        pipe = self.client.pipeline(transaction=False)
        for delivery_id, step, attempt in items:
            self._finish(keys=[delivery_key(delivery_id), DEADLINE_INDEX],
                         args=[step, attempt, now_ms, StepStatus.COMPLETED.value,
                               index_member(delivery_id, step), ""], client=pipe)
        return [text(r) for r in pipe.execute()]

    def try_again(self, delivery_id: str, step: str, attempt: int) -> int:
        """Count one more try against the step's budget; -1 when this attempt is stale."""
        return int(self._try_again(keys=[delivery_key(delivery_id)], args=[step, attempt]))

    def finish(self, delivery_id: str, step: str, attempt: int, now_ms: int,
               status: StepStatus, error: str = "") -> str:
        """``ok``; ``replay`` (already so: a replayed batch); ``stale`` (a newer attempt owns
        the step) or ``ignored`` (closed meanwhile): a late answer, whose outputs must go."""
        result = self._finish(
            keys=[delivery_key(delivery_id), DEADLINE_INDEX],
            args=[step, attempt, now_ms, status.value, index_member(delivery_id, step), error[:500]],
        )
        return str(result.decode())

    def note_dead_letters(self, delivery_ids: Iterable[str]) -> None:
        """Keep these deliveries' state when they finish: a redrive of their letters needs it
        (one round trip for a batch's dead letters)."""
        pipe = self.client.pipeline(transaction=False)
        for delivery_id in delivery_ids:
            self._note_dead_letter(keys=[delivery_key(delivery_id)], client=pipe)
        if len(pipe):
            pipe.execute()

    def steps(self, delivery_id: str) -> dict[str, StepState]:
        raw = {text(k): text(v) for k, v in self.client.hgetall(delivery_key(delivery_id)).items()}
        return parse_steps(raw)


def text(value: object) -> str:
    """A Redis reply (bytes, str or None) as text (clients may or may not decode responses)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_steps(raw: dict[str, str]) -> dict[str, StepState]:
    names = {k.rsplit(".", 1)[0] for k in raw if k.endswith(".status")}
    return {
        name: StepState(
            step=name,
            status=raw.get(f"{name}.status", ""),
            complete_by=int(raw.get(f"{name}.complete_by", "0")),
            attempt=int(raw.get(f"{name}.attempt", "1")),
            tries=int(raw.get(f"{name}.tries", "0")),
            failures=int(raw.get(f"{name}.failures", "0")),
            error=raw.get(f"{name}.error", ""),
            updated=int(raw.get(f"{name}.updated", "0")),
            source=raw.get(f"{name}.source", ""),
        )
        for name in names
    }


def _started(verdict: str, attempt: int) -> tuple[Begin, int]:
    """``go:<n>`` / ``replay:<n>``: another trigger of a requeued step, joining its attempt ``n``."""
    name, _, joined = verdict.partition(":")
    return Begin(name), int(joined) if joined else attempt
