"""The state table: per delivery and step, status, complete-by deadline, attempt token,
try count and failure count, in one Redis hash per delivery (``dl:{s<n>}<id>``, in its
shard's hash slot: ``choreo.keys``). A sorted set per shard (``deadlines:{s<n>}``) indexes
open steps by complete-by, so the supervisor finds expired steps in O(expired), never by
scanning every key, and a transition updates a step and its deadline in one slot.

Every transition is one Lua script with a condition: an attempt older than the recorded
token loses (a stale attempt cannot overwrite a newer one), a closed step stays closed.
The hash is the step's only record in Redis; Kafka remains the record of what happened.

A step's record is one field of the hash, named after the step: a JSON array of its values
in ``STEP_FIELDS`` order (``null`` for an absent one, trailing ones left out). A field per
value (``package.status``, ``package.complete_by``, ...) cost about 30 bytes each, eight or
more per step: the table was the largest thing a delivery kept in Redis (bench/README.md).
Scripts read and write records through ``STEP_LUA`` and Python through ``unpack_step`` /
``flat_fields``: the layout lives here only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from choreo import keys
from choreo.answers import answer_of
from choreo.batch import BatchScript, Item, run_in_order, run_together
from choreo.redis_client import NodePipelines, raise_first, write_waited


class StepStatus(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


class Begin(StrEnum):
    """What the runtime may do with an input event (for its step, if it has one)."""

    GO = "go"  # run the handler
    DUPLICATE = "duplicate"  # already handled from another position (choreo.dedupe): skip
    # another event for a step with one trigger that another event began (a copy under a new id): skip
    COPY = "copy"
    RELEASED = "released"  # its delivery is finished and its state released: skip
    # already completed, by this input as far as the dedupe knows: run again for the same (remembered) answers
    REPLAY = "replay"
    STALE = "stale"  # an older attempt than the current token: ignore
    CLOSED = "closed"  # failed or compensating: a late answer, record and ignore
    EXPIRED = "expired"  # deadline passed: start no new side effect, report it
    EXHAUSTED = "exhausted"  # the step's retry budget is spent: report it


# most often present first: a record leaves out its trailing absent values
STEP_FIELDS = ("status", "complete_by", "attempt", "tries", "failures", "updated", "source",
               "completed_at", "origins", "joined", "error", "late", "requeue", "requeued",
               "tries_seen", "backoffs", "waiting", "report", "compensating_at", "compensated_at")

# Around every script that touches a step: ``step_get(key, step, name)`` (nil when absent),
# ``step_set(key, step, {name = value, ...})`` (``cjson.null`` deletes a value; creates the
# record), ``step_incr(key, step, name, by)``, ``is_step_record(field, value)`` (as
# ``is_step_record`` below). A record is decoded once per script run (per item of a batched
# call), and written back once, by ``step_flush`` when it returns: a transition changes its
# step in several places.
STEP_LUA = """
local STEP_FIELDS = {%s}
local STEP_SLOT = {}
for i, name in ipairs(STEP_FIELDS) do STEP_SLOT[name] = i end
local step_records, step_dirty = {}, {}
local function step_record(key, step)
  local id = key .. '#' .. step
  local record = step_records[id]
  if record == nil then
    local raw = redis.call('HGET', key, step)
    if raw then record = cjson.decode(raw) else record = false end
    step_records[id] = record
  end
  return record
end
local function step_get(key, step, name)
  local record = step_record(key, step)
  if not record then return nil end
  local value = record[STEP_SLOT[name]]
  if value == cjson.null then return nil end
  return value
end
local function step_set(key, step, values)
  local record = step_record(key, step) or {}
  for name, value in pairs(values) do record[STEP_SLOT[name]] = value end
  step_records[key .. '#' .. step] = record
  step_dirty[key .. '#' .. step] = {key, step}
end
local function step_incr(key, step, name, by)
  local value = (tonumber(step_get(key, step, name)) or 0) + by
  step_set(key, step, {[name] = value})
  return value
end
-- args[first], args[first + 1], ...: (step, complete-by ms, deadline index member, attempt)
-- of steps to open as pending, each unless it exists; their deadlines go in one ZADD
local function open_steps(key, index, args, first, now)
  local deadlines = {}
  for i = first, #args, 4 do
    if not step_get(key, args[i], 'status') then
      step_set(key, args[i], {status = 'pending', complete_by = tonumber(args[i + 1]),
               attempt = tonumber(args[i + 3]) or 1, tries = 0, failures = 0, updated = now})
      deadlines[#deadlines + 1] = args[i + 1]
      deadlines[#deadlines + 1] = args[i + 2]
    end
  end
  if #deadlines > 0 then redis.call('ZADD', index, unpack(deadlines)) end
  return #deadlines / 2
end
local function is_step_record(name, value)
  return not string.find(name, '.', 1, true) and string.sub(value, 1, 1) == '['
end
local function step_flush()
  local writes = {}  -- per hash: one HSET of all its records written
  for id, where in pairs(step_dirty) do
    -- values past STEP_FIELDS were written by a newer version running beside this one
    -- (choreo.layout): kept as they are
    local record, last = step_records[id], 0
    for i = 1, math.max(#STEP_FIELDS, table.maxn(record)) do
      if record[i] ~= nil and record[i] ~= cjson.null then last = i end
    end
    -- no status, no step: a late answer or a try for a step the table does not know (Redis
    -- lost mid-attempt) leaves nothing behind, where a record would look like a step
    if record[1] ~= nil and record[1] ~= cjson.null then
      local packed = {}
      for i = 1, last do
        if record[i] == nil then packed[i] = cjson.null else packed[i] = record[i] end
      end
      local fields = writes[where[1]] or {}
      fields[#fields + 1] = where[2]
      fields[#fields + 1] = cjson.encode(packed)
      writes[where[1]] = fields
    end
  end
  for key, fields in pairs(writes) do redis.call('HSET', key, unpack(fields)) end
  step_records, step_dirty = {}, {}
end
""" % ", ".join(f"'{name}'" for name in STEP_FIELDS)


# ``step_owned(key, step, attempt)``: whether ``attempt`` still owns ``step`` in the delivery's
# hash ``key``, for an effect it asks (``choreo.effects``): no newer attempt holds the step and
# it is not closed (failed, compensating...). A step the hash does not know (Redis lost
# mid-attempt) has nothing to fence: it is owned. Reads the stored record: not for a script
# that changed the step before (its records are written back at its end).
STEP_OWNED_LUA = """
local function step_owned(key, step, attempt)
  local raw = redis.call('HGET', key, step)
  if not raw then return true end
  local record = cjson.decode(raw)
  if (tonumber(record[%(attempt)d]) or 1) > attempt then return false end
  local status = record[%(status)d]
  return status == 'pending' or status == 'processing' or status == 'completed'
end
""" % {"attempt": STEP_FIELDS.index("attempt") + 1, "status": STEP_FIELDS.index("status") + 1}

def with_steps(script: str) -> str:
    """A script that reads or writes step records (``STEP_LUA``'s functions in scope)."""
    return STEP_LUA + """
local step_result = (function()
%s
end)()
step_flush()
return step_result
""" % script


class StepScript(BatchScript):
    """A step transition run for a batch of items in one call (``choreo.batch``): each item
    writes back its records before the next one reads."""

    def __init__(self, client: redis.Redis, name: str, body: str, helpers: str = "") -> None:
        """``helpers``: functions of the body's own, defined once per call beside ``STEP_LUA``'s."""
        super().__init__(client, name, body, prelude=STEP_LUA + helpers, after_each="step_flush()")


def delivery_key(delivery_id: str) -> str:
    return keys.of_delivery("dl", delivery_id)


def deadline_index(delivery_id: str) -> str:
    """The deadline index of the delivery's shard."""
    return deadline_shard(keys.shard_of(delivery_id))


def deadline_shard(shard: int) -> str:
    return keys.of_shard("deadlines", shard)


def deadline_shards() -> list[str]:
    """Every shard's deadline index: what the supervisor and the operators' tools walk."""
    return [deadline_shard(shard) for shard in range(keys.SHARDS)]


def index_member(delivery_id: str, step: str) -> str:
    return f"{delivery_id}|{step}"


def _opening(delivery_id: str, step: str, complete_by_ms: int, attempt: int) -> tuple[str, int, str, int]:
    """A step to open as ``open_steps`` reads it: (step, complete-by ms, deadline index member,
    attempt), the one form every script that opens steps takes."""
    return step, complete_by_ms, index_member(delivery_id, step), attempt


# one delivery's steps: ARGV[1] = now, then open_steps' quadruples
_OPEN = """
return open_steps(KEYS[1], KEYS[2], ARGV, 2, tonumber(ARGV[1]))
"""

_ABANDON = """
if step_get(KEYS[1], ARGV[1], 'status') ~= 'pending' then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[2])
return 1
"""

# what the begin calls, defined once per call beside STEP_LUA's (its body runs per item)
_BEGIN_HELPERS = """
-- whether the step's source (the last input that began it) carried another event than
-- ``prefix``'s (``<service>:<event>:``): dedupe fields are ``<service>:<event>:<attempt>``
-- (a service's name has no ':', an event id may), each with the position that first
-- carried it (``topic|partition|offset``, which a source ends with; a replay's is
-- ``<group>:topic|partition|offset``, and a topic's name has no ':'). A hash past 64
-- entries (a delivery has about six) is not read: the check answers no, and the copy runs
local function begun_by_another(K, step, seen, prefix)
  local source = step_get(K, step, 'source')
  local event = string.match(prefix, '^[^:]*:(.*):$')
  if not source or not event or redis.call('HLEN', seen) > 64 then return false end
  local sightings = redis.call('HGETALL', seen)
  for i = 1, #sightings, 2 do
    local other = string.match(sightings[i], '^[^:]*:(.*):[0-9]+$')
    local at = string.match(sightings[i + 1], '[^:]*$')
    if other and other ~= event and (source == at or string.sub(source, -(#at + 1)) == '|' .. at) then
      return true
    end
  end
  return false
end
"""

_BEGIN = """
local K, step = KEYS[1], ARGV[1]
-- a released delivery (choreo.release) is finished: nothing of it starts again, and a
-- workflow's own service (ARGV[12] = '1') ignores its events outright
local released = redis.call('HEXISTS', K, 'done') == 1
if released and ARGV[12] == '1' then return 'released' end
-- the service's dedupe (choreo.dedupe; KEYS[3]: its hash, ARGV[9]: the event's field there
-- without its attempt, ARGV[10]: this input's position, ARGV[11]: the hash's TTL): the
-- position that first carried the event at this attempt runs (again, when its transaction
-- aborted); another position is a copy whose outputs were committed from the first
local first = false  -- the service sees this input for the first time
if KEYS[3] then
  local field = ARGV[9] .. ARGV[2]
  local previous = redis.call('HGET', KEYS[3], field)
  if previous and previous ~= ARGV[10] then return 'duplicate' end
  if not previous then
    first = true
    redis.call('HSET', KEYS[3], field, ARGV[10])
    redis.call('EXPIRE', KEYS[3], ARGV[11])
  end
end
-- no step: an input deduplicated only (a handler outside any step, an input to dead-letter)
if step == '' then return 'go' end
if released then return 'closed' end
local attempt, now = tonumber(ARGV[2]), tonumber(ARGV[3])
local status = step_get(K, step, 'status')
-- an attempt past the one after the step's was given by no one: the supervisor raises the
-- attempt by one before it requeues (one past it when Redis lost that claim), and an output
-- starts its steps at attempt 1. Taken, a forged attempt header of 1000 would give the step
-- away from its live attempt, to one the supervisor could requeue no more (1001 is past
-- what consumers take). Not remembered: a requeue at that attempt is no copy of it
if attempt > (step_get(K, step, 'attempt') or 1) + 1 then
  if first then redis.call('HDEL', KEYS[3], ARGV[9] .. ARGV[2]) end
  return 'stale'
end
if not status then
  local complete_by = now + tonumber(ARGV[4])
  step_set(K, step, {status = 'pending', complete_by = complete_by, attempt = attempt, tries = 0,
           failures = 0})
  redis.call('ZADD', KEYS[2], complete_by, ARGV[6])
  status = 'pending'
end
local token = step_get(K, step, 'attempt') or 1
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
  local origins = ',' .. (step_get(K, step, 'origins') or '') .. ','
  if ARGV[7] ~= step_get(K, step, 'joined')
     and string.find(origins, ',' .. origin .. ',', 1, true) then return 'stale' end
  -- the same event may be on its way at the current attempt from another position: the
  -- supervisor's requeue of this very half, sent before it joined. The first position the
  -- service's dedupe saw at that attempt runs, the other is a copy
  if KEYS[3] then
    local taken = redis.call('HGET', KEYS[3], ARGV[9] .. token)
    if taken and taken ~= ARGV[10] then return 'stale' end
  end
  attempt, joined = token, true
  step_set(K, step, {joined = ARGV[7]})
end
-- an event this service sees first, for a step with one trigger that another event began
-- (whatever the step's status now), is a copy under a new id: run, it would call out beside
-- or after that event under new call ids and publish under new ids. Which event began it:
-- the one a sighting (any service's) names at the step's source. None found (expired,
-- forgotten by a redrive, lost with Redis), or this very event: the step's own input, read
-- again or requeued (an attempt of the same event), runs. An undo asked again has no
-- source yet (its step is reset). The copy leaves no sighting, so it stays one when its own
-- batch is read again
if first and ARGV[8] ~= '1' and begun_by_another(K, step, KEYS[3], ARGV[9]) then
  redis.call('HDEL', KEYS[3], ARGV[9] .. ARGV[2])
  return 'copy'
end
if status == 'completed' then
  if joined then return 'replay:' .. attempt end
  return 'replay'
end
if status ~= 'pending' and status ~= 'processing' then return 'closed' end
-- the service has now seen this input: remember where it lies even if it will not run it,
-- so the supervisor can requeue it (an expired trigger is consumed and would be lost).
-- A fan-in's other half that was seen and never ran (no 'go': its origin is not in
-- origins) stays listed before this one: a requeue of the last input alone would leave
-- the delivery waiting for a half it was given (sources are ';'-separated, see Source)
local source = ARGV[7]
if ARGV[8] == '1' then
  local ran = ',' .. (step_get(K, step, 'origins') or '') .. ','
  local unran = ''
  for entry in string.gmatch(step_get(K, step, 'source') or '', '[^;]+') do
    local from = string.match(entry, '^[^|]*')
    if from ~= origin and not string.find(ran, ',' .. from .. ',', 1, true) then
      unran = unran .. entry .. ';'
    end
  end
  source = unran .. source
end
step_set(K, step, {source = source})
if now > step_get(K, step, 'complete_by') then return 'expired' end
local tries = step_incr(K, step, 'tries', 1)
if tries > tonumber(ARGV[5]) then return 'exhausted' end
local changes = {status = 'processing', attempt = attempt, updated = now}
if ARGV[8] == '1' then
  local known = step_get(K, step, 'origins')
  if not known then
    changes.origins = origin
  elseif not string.find(',' .. known .. ',', ',' .. origin .. ',', 1, true) then
    changes.origins = known .. ',' .. origin
  end
end
step_set(K, step, changes)
if joined then
  -- claimed at this attempt: the requeued copy of this half is a duplicate when it comes
  if KEYS[3] then redis.call('HSET', KEYS[3], ARGV[9] .. attempt, ARGV[10]) end
  return 'go:' .. attempt
end
return 'go'
"""

# A begin with an effect riding in it (``begin_many``'s riders): the effect's script runs in
# the same item when the input will run (go, replay), and the item answers {verdict, the
# effect's answer}. ARGV[13]: how many of KEYS are the begin's (the rest are the effect's);
# ARGV[14..]: the effect's ARGV.
_BEGIN_RIDING = """
local function begin(KEYS, ARGV)
%s
end
local function ride(KEYS, ARGV)
--[[the effect]]
end
local own = tonumber(ARGV[13])
local verdict = begin({unpack(KEYS, 1, own)}, ARGV)
if string.sub(verdict, 1, 2) ~= 'go' and string.sub(verdict, 1, 6) ~= 'replay' then return verdict end
return {verdict, ride({unpack(KEYS, own + 1)}, {unpack(ARGV, 14)})}
""" % _BEGIN


_TRY_AGAIN = with_steps("""
if tonumber(ARGV[2]) < (step_get(KEYS[1], ARGV[1], 'attempt') or 1) then return -1 end
return step_incr(KEYS[1], ARGV[1], 'tries', 1)
""")

_FINISH = """
local K, step = KEYS[1], ARGV[1]
local attempt, now, outcome = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local status = step_get(K, step, 'status')
local token = step_get(K, step, 'attempt') or 1
if attempt < token then
  step_set(K, step, {late = now})
  return 'stale'
end
if status ~= 'pending' and status ~= 'processing' then
  if status == outcome then return 'replay' end
  step_set(K, step, {late = now})
  return 'ignored'
end
if outcome == 'completed' then
  step_set(K, step, {status = outcome, updated = now, completed_at = now})
  redis.call('ZREM', KEYS[2], ARGV[5])
else
  step_incr(K, step, 'failures', 1)
  step_set(K, step, {status = outcome, updated = now, error = ARGV[6]})
  -- a failed step is due at once: the supervisor finds it even if its report was lost
  redis.call('ZADD', KEYS[2], now, ARGV[5])
end
return 'ok'
"""


# A rebuild's restore of one delivery's steps (``StateTable.restore_many``): the open, begin
# and finish each step went through, all in one script item (not three calls' items a
# step), so the state is what those transitions write. ARGV[1] = now, ARGV[2] = the budget
# of tries, ARGV[3] = how many steps ended; then (step, attempt, index member, source,
# status, error) of each step that ended; then open_steps' quadruples, every step. The
# begin gets no dedupe hash (KEYS[3]) and no default deadline: the open just made its step.
_RESTORE = """
local function begin(KEYS, ARGV)
%s
end
local function finish(KEYS, ARGV)
%s
end
local now, ended, own = tonumber(ARGV[1]), tonumber(ARGV[3]), {KEYS[1], KEYS[2]}
local at = 4 + 6 * ended
open_steps(KEYS[1], KEYS[2], ARGV, at, now)
for i = 4, at - 1, 6 do
  begin(own, {ARGV[i], ARGV[i + 1], ARGV[1], 0, ARGV[2], ARGV[i + 2], ARGV[i + 3], '0', '', '', 0, '0'})
  finish(own, {ARGV[i], ARGV[i + 1], ARGV[1], ARGV[i + 4], ARGV[i + 2], ARGV[i + 5]})
end
return 0
""" % (_BEGIN, _FINISH)


# A finish that also applies its attempt's writes and opens the steps its outputs start, when
# it lets them be published: one script item where there were three, and no round trip of
# its own for either. The writes (ARGV[7]: how many; each its TTL seconds, 0 for none, its
# pairs' count, then name, value pairs, on KEYS[3], KEYS[4], ...) go only with 'ok': a
# 'replay' finds them applied by the finish that completed the step. Then (step,
# complete-by, index member, attempt) of each step to open, all of the same delivery.
_FINISH_OPENING = """
local verdict = (function()
%s
end)()
local at = 8
for w = 1, tonumber(ARGV[7]) do
  local ttl, pairs_count = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  if verdict == 'ok' then
    if pairs_count > 0 then redis.call('HSET', KEYS[2 + w], unpack(ARGV, at + 2, at + 1 + 2 * pairs_count)) end
    if ttl > 0 then redis.call('EXPIRE', KEYS[2 + w], ttl) end
  end
  at = at + 2 + 2 * pairs_count
end
if verdict == 'ok' or verdict == 'replay' then open_steps(KEYS[1], KEYS[2], ARGV, at, tonumber(ARGV[3])) end
return verdict
""" % _FINISH


# Writes a test, a benchmark or the rebuild makes outside a transition: ARGV = (step, value
# name, JSON value) triples; a step of '' sets a plain field of the hash (outcome, fanin.*).
_PUT = with_steps("""
for i = 1, #ARGV, 3 do
  local value = cjson.decode(ARGV[i + 2])
  if ARGV[i] == '' then
    redis.call('HSET', KEYS[1], ARGV[i + 1], value)
  else
    step_set(KEYS[1], ARGV[i], {[ARGV[i + 1]] = value})
  end
end
return 0
""")


# a dead-lettered event keeps its delivery's state for the redrive (choreo.release); no
# table is created for an event of a delivery that has none
_NOTE_DEAD_LETTER = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'dead_letters', 1) end
return 0
"""


@dataclass(frozen=True)
class Rider:
    """An effect riding in an input's begin (``StateTable.begin_riding``): its name, its script
    (whose ``KEYS`` and ``ARGV`` are these); on a Redis Cluster all of its keys are in the
    delivery's slot."""

    name: str
    source: str
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...]


@dataclass(frozen=True)
class HashWrite:
    """Fields set on a hash in the delivery's slot, its TTL restarted (0: none): a write whose
    answer no handler reads (a record's ``put``). In a step it is applied by the step's finish,
    in the same script item, and only when that finish completes the step (``ok``): not by a
    replay's finish, which finds it applied, nor for a late answer."""

    key: str
    ttl_s: int
    pairs: tuple[str | int | float, ...]  # name, value, name, value...

    def args(self) -> list[str | int | float]:
        return [self.ttl_s, len(self.pairs) // 2, *self.pairs]


@dataclass(frozen=True)
class Source:
    """Where a step's last started input lies (its record's ``source``): the handler's topic,
    then the topic, partition and offset it was read from. Written ``topic|partition|offset``
    when the two topics are the same (they are but for a retry topic): a record must stay
    under the Redis listpack value limit (bench/README.md), and the long form pushed a fan-in
    step's record past it. A fan-in's record may list several, ``;``-separated: the halves it
    was given and never ran, then the last input (``_BEGIN``); a requeue sends them all."""

    handler_topic: str
    topic: str
    partition: int
    offset: int

    @property
    def position(self) -> str:
        """``topic|partition|offset``: the record itself, whichever handler reads it."""
        return f"{self.topic}|{self.partition}|{self.offset}"

    def text(self) -> str:
        return self.position if self.handler_topic == self.topic else f"{self.handler_topic}|{self.position}"

    @classmethod
    def parse_all(cls, raw: str) -> list[Source | None]:
        """Every input a step's ``source`` lists (``None`` for one that cannot be read)."""
        return [cls.parse(entry) for entry in raw.split(";")]

    @classmethod
    def parse(cls, raw: str) -> Source | None:
        parts = raw.split("|")
        if len(parts) == 3:
            parts.insert(0, parts[0])
        if len(parts) != 4:
            return None
        try:
            return cls(parts[0], parts[1], int(parts[2]), int(parts[3]))
        except ValueError:
            return None


@dataclass(frozen=True)
class Sighting:
    """Where the service's dedupe (``choreo.dedupe``) keeps an input's event: the hash, the
    event's field there without its attempt, and the input's position. The begin checks it
    first, in the same script item. A fan-in half that joins a newer attempt claims its event
    at that attempt there too, so the supervisor's requeue of the same half, sent before the
    join, is a copy and does not publish the decision again (a chaos run published 146
    terminal events twice, RELIABILITY.md)."""

    key: str
    field_prefix: str
    position: str


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


MAX_ERROR_CHARS = 500  # of a failed step's error in its record
# a restored step's begin counts its one try against a budget no restore runs out of
RESTORE_BUDGET = 1 << 30


@dataclass(frozen=True)
class Restored:
    """A step as a rebuild restores it: opened at its trigger's attempt, due by
    ``complete_by_ms``; ``ended`` (its status and error) when its service consumed the
    trigger, begun from ``source`` (``Source.text``)."""

    step: str
    attempt: int
    complete_by_ms: int
    source: str
    ended: tuple[StepStatus, str] | None


class StateTable:
    """Conditional step transitions; every call is one atomic script."""

    def __init__(self, client: redis.Redis, retention_s: int = 24 * 3600) -> None:
        self.client = client
        self.retention_s = retention_s
        self._open = StepScript(client, "open", _OPEN)
        self._abandon = StepScript(client, "abandon", _ABANDON)
        self._begin = StepScript(client, "begin", _BEGIN, _BEGIN_HELPERS)
        self._riders: dict[tuple[str, str], StepScript] = {}
        self._try_again = client.register_script(_TRY_AGAIN)
        self._finish = StepScript(client, "finish", _FINISH)
        self._finish_opening = StepScript(client, "finish_opening", _FINISH_OPENING)
        self._restore = StepScript(client, "restore", _RESTORE, _BEGIN_HELPERS)
        self._note_dead_letter = client.register_script(_NOTE_DEAD_LETTER)
        self._put = client.register_script(_PUT)

    def open(self, delivery_id: str, step: str, complete_by_ms: int, now_ms: int,
             attempt: int = 1) -> None:
        """Register a step as pending before its trigger is published (no-op if it exists).
        ``attempt``: the attempt its trigger carries (a rebuild restoring a requeued step
        whose retry nobody has read yet: the supervisor's next claim must go past it)."""
        self.open_many([(delivery_id, step, complete_by_ms, attempt)], now_ms)

    def open_many(self, items: Sequence[tuple[str, str, int, int]], now_ms: int) -> None:
        """``open`` for many (delivery, step, complete-by ms, attempt) in one round trip."""
        self._open.run(self._open_items(items, now_ms))

    @staticmethod
    def _open_items(items: Sequence[tuple[str, str, int, int]], now_ms: int) -> list[Item]:
        """One script item per delivery, opening all of its steps."""
        opens: dict[str, list[str | int]] = {}
        for delivery_id, step, complete_by_ms, attempt in items:
            opens.setdefault(delivery_id, [now_ms]).extend(_opening(delivery_id, step, complete_by_ms, attempt))
        return [([delivery_key(delivery_id), deadline_index(delivery_id)], args)
                for delivery_id, args in opens.items()]

    def abandon_many(self, items: Sequence[tuple[str, str]]) -> None:
        """Withdraw steps opened for triggers that were never published (still pending):
        (delivery, step) items, one round trip."""
        self._abandon.run([([delivery_key(delivery_id), deadline_index(delivery_id)],
                            [step, index_member(delivery_id, step)]) for delivery_id, step in items])

    def begin(self, delivery_id: str, step: str, attempt: int, now_ms: int,
              default_deadline_ms: int, budget: int, source: str, joinable: bool = False) -> Begin:
        """Start (or replay) an attempt; ``source`` (``Source.text``) lets the supervisor
        fetch the input again to requeue it."""
        return self.begin_many([(delivery_id, step, attempt, now_ms, default_deadline_ms, source)],
                               budget, {step} if joinable else set())[0][0]

    def begin_many(self, items: list[tuple[str, str, int, int, int, str]], budget: int,
                   joinable: set[str] | frozenset[str] = frozenset(),
                   sightings: Sequence[Sighting | None] = (), dedupe_ttl_s: int = 0,
                   refuse_released: bool = False) -> list[tuple[Begin, int]]:
        """``begin`` for a whole batch in one round trip: (delivery, step, attempt, now,
        default deadline ms, source) per item; each verdict comes with the attempt the input
        runs as (the current one when it joins a step requeued meanwhile). A step of ``""``:
        an input that is deduplicated only. ``joinable``: the steps with several trigger
        topics (a fan-in), whose other triggers may join.

        ``sightings``: where each item's event is deduplicated, kept for ``dedupe_ttl_s``
        (``None``: not deduplicated), checked before the step: a copy is ``DUPLICATE``.
        ``refuse_released``: every event of a released delivery is ``RELEASED`` (a workflow's
        own services); else a step of one is ``CLOSED``."""
        return self.begin_riding(items, budget, joinable, sightings, dedupe_ttl_s, refuse_released)[0]

    def begin_riding(self, items: list[tuple[str, str, int, int, int, str]], budget: int,
                     joinable: set[str] | frozenset[str] = frozenset(),
                     sightings: Sequence[Sighting | None] = (), dedupe_ttl_s: int = 0,
                     refuse_released: bool = False, riders: Sequence[Rider | None] = (),
                     ) -> tuple[list[tuple[Begin, int]], list[str | None]]:
        """``begin_many``, with an effect riding in the begin of some items (``riders``): run
        in the same script item when the input will run (``GO``, ``REPLAY``), where it would
        take an item and a round trip of its own. The verdicts come back, and each rider's
        answer (``None`` where none rode or it did not run)."""
        seen: Sequence[Sighting | None] = sightings or [None] * len(items)
        riding: Sequence[Rider | None] = riders or [None] * len(items)
        if dedupe_ttl_s < 1 and any(seen):  # EXPIRE 0 would delete every service's entries
            raise ValueError(f"a dedupe window of {dedupe_ttl_s} s: the entries must live")
        refuse = "1" if refuse_released else "0"
        ordered: list[tuple[BatchScript, Item]] = []
        for (delivery_id, step, attempt, now, default_deadline_ms, source), at, rider in zip(
                items, seen, riding, strict=True):
            keys = [delivery_key(delivery_id), deadline_index(delivery_id), *([at.key] if at else [])]
            args: list[str | int | float] = [
                step, attempt, now, default_deadline_ms, budget, index_member(delivery_id, step), source,
                "1" if step in joinable else "0",
                *((at.field_prefix, at.position, dedupe_ttl_s) if at else ("", "", 0)), refuse]
            script = self._begin
            if rider is not None:
                script = self._riding_script(rider)
                keys, args = [*keys, *rider.keys], [*args, len(keys), *rider.args]
            ordered.append((script, (keys, args)))
        replies = run_in_order(self.client, ordered)
        started, answers = [], []
        for reply, item in zip(replies, items):
            verdict, answer = (reply[0], reply[1] if len(reply) > 1 else None) if isinstance(reply, list) \
                else (reply, None)
            started.append(_started(text(verdict), item[2]))
            answers.append(answer_of(answer))
        return started, answers

    def _riding_script(self, rider: Rider) -> StepScript:
        script = self._riders.get((rider.name, rider.source))
        if script is None:
            script = self._riders[(rider.name, rider.source)] = StepScript(
                self.client, f"begin+{rider.name}", _BEGIN_RIDING.replace("--[[the effect]]", rider.source),
                _BEGIN_HELPERS)
        return script

    def complete_many(self, items: list[tuple[str, str, int]], now_ms: int,
                      opening: Sequence[Sequence[tuple[str, int, int]]] = (),
                      also_open: Sequence[tuple[str, str, int, int]] = (),
                      writes: Sequence[Sequence[HashWrite]] = ()) -> list[str]:
        """``finish(COMPLETED)`` for a whole batch, (delivery, step, attempt) each, in one
        round trip. ``opening``: per item, the steps of its own delivery that its outputs
        start, (step, complete-by ms, attempt), opened only if the finish lets them be
        published; ``writes``: per item, its attempt's writes, applied only when the finish
        completes the step (``ok``). ``also_open``: steps to open whatever the finishes answer
        (``open_many``'s items), in the same round trip."""
        openings = list(opening) or [()] * len(items)
        applied = list(writes) or [()] * len(items)
        finishes = [
            ([delivery_key(delivery_id), deadline_index(delivery_id), *(w.key for w in its_writes)],
             [step, attempt, now_ms, StepStatus.COMPLETED.value, index_member(delivery_id, step), "",
              len(its_writes), *(arg for w in its_writes for arg in w.args()),
              *(value for name, complete_by, opened_attempt in opens
                for value in _opening(delivery_id, name, complete_by, opened_attempt))])
            for (delivery_id, step, attempt), opens, its_writes
            in zip(items, openings, applied, strict=True)]
        runs: list[tuple[BatchScript, Sequence[Item]]] = [(self._finish_opening, finishes)]
        if also_open:
            runs.append((self._open, self._open_items(also_open, now_ms)))
        return [text(r) for r in run_together(self.client, runs)[0]]

    def try_again(self, delivery_id: str, step: str, attempt: int) -> int:
        """Count one more try against the step's budget; -1 when this attempt is stale. The
        count waits for a replica (``write_waited``): one a failover lost would give the step
        tries beyond its budget."""
        key = delivery_key(delivery_id)
        return int(write_waited(self.client, key,
                                lambda pipe: self._try_again(keys=[key], args=[step, attempt], client=pipe)))

    def finish(self, delivery_id: str, step: str, attempt: int, now_ms: int,
               status: StepStatus, error: str = "") -> str:
        """``ok``; ``replay`` (already so: a replayed batch); ``stale`` (a newer attempt owns
        the step) or ``ignored`` (closed meanwhile): a late answer, whose outputs must go."""
        return self.finish_many([(delivery_id, step, attempt, status, error)], now_ms)[0]

    def finish_many(self, items: Sequence[tuple[str, str, int, StepStatus, str]],
                    now_ms: int) -> list[str]:
        """``finish`` for many (delivery, step, attempt, status, error) in one round trip."""
        answers = self._finish.run([
            ([delivery_key(delivery_id), deadline_index(delivery_id)],
             [step, attempt, now_ms, status.value, index_member(delivery_id, step), error[:MAX_ERROR_CHARS]])
            for delivery_id, step, attempt, status, error in items])
        return [text(r) for r in answers]

    def restore_many(self, items: Sequence[tuple[str, Sequence[Restored]]], now_ms: int) -> None:
        """A rebuild's steps, per delivery: each opened at its attempt, and a step whose trigger
        its service consumed begun and finished as it ended (``Restored.ended``), as the
        transitions would have written them, in one script item per delivery. A delivery
        names each step once (its steps are the workflow's: a few, far below Lua's limit of
        about 8,000 values an item)."""
        runs: list[Item] = []
        for delivery_id, steps in items:
            if len({step.step for step in steps}) < len(steps):  # each begun and finished in turn
                raise ValueError(f"a step restored twice for one delivery: {[step.step for step in steps]}")
            ended = [(step, step.ended) for step in steps if step.ended is not None]
            args: list[str | int | float] = [now_ms, RESTORE_BUDGET, len(ended)]
            for step, (status, error) in ended:
                args += [step.step, step.attempt, index_member(delivery_id, step.step), step.source, status.value,
                         error[:MAX_ERROR_CHARS]]
            for step in steps:
                args += _opening(delivery_id, step.step, step.complete_by_ms, step.attempt)
            runs.append(([delivery_key(delivery_id), deadline_index(delivery_id)], args))
        self._restore.run(runs)

    def note_dead_letters(self, delivery_ids: Iterable[str]) -> None:
        """Keep these deliveries' state when they finish: a redrive of their letters needs it
        (one round trip for a batch's dead letters)."""
        pipes = NodePipelines(self.client)
        for delivery_id in delivery_ids:
            self._note_dead_letter(keys=[delivery_key(delivery_id)], client=pipes.on(delivery_key(delivery_id)))
        if len(pipes):
            raise_first(pipes.execute())

    def steps(self, delivery_id: str) -> dict[str, StepState]:
        return parse_steps(self.raw(delivery_id))

    def raw(self, delivery_id: str) -> dict[str, str]:
        return {text(k): text(v) for k, v in self.client.hgetall(delivery_key(delivery_id)).items()}

    def fields(self, delivery_id: str) -> dict[str, str]:
        """The delivery's hash as ``<step>.<name>`` = text (and its plain fields as they are):
        the view an operator's tool or a test reads."""
        return flat_fields(self.raw(delivery_id))

    def put(self, delivery_id: str, values: Mapping[str, str | int],
            pipes: NodePipelines | None = None) -> None:
        """Set values named as ``fields`` names them, outside any transition's conditions: for
        the rebuild, tests and benchmarks that stage a state (queued on ``pipes`` if given)."""
        args: list[str] = []
        for name, value in values.items():
            step, _, part = name.rpartition(".") if _is_step_value(name) else ("", "", name)
            if step and isinstance(value, str) and value.lstrip("-").isdigit():
                value = int(value)  # as ``fields`` shows it: scripts compare numbers as numbers
            args += [step, part, json.dumps(value)]
        key = delivery_key(delivery_id)
        self._put(keys=[key], args=args, client=pipes.on(key) if pipes is not None else self.client)


def text(value: object) -> str:
    """A Redis reply (bytes, str or None) as text (clients may or may not decode responses)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


# the hash's plain fields: these names, and ``fanin.*``, ``fail.*`` and ``undo.*`` (named as step values are)
RESERVED_FIELDS = frozenset({"outcome", "done", "dead_letters", "fanin", "fail", "undo"})


def check_step_name(step: str) -> str:
    """A step's name is a field of its delivery's hash: it must not be a plain field's name or
    contain a dot (``<step>.<name>`` is how the views name its values)."""
    if not step or "." in step or step in RESERVED_FIELDS:
        raise ValueError(f"step name {step!r}: not empty, no '.', not one of {sorted(RESERVED_FIELDS)}")
    return step


def is_step_record(name: str, value: str) -> bool:
    """Whether a field of a delivery's hash is a step's record (the others are plain values:
    ``outcome``, ``fanin.*``, ``fail.*``, ``undo.*``, ``done``, ``dead_letters``: each has a dot in
    its name or is no JSON array)."""
    return "." not in name and value.startswith("[")


def unpack_step(value: str) -> dict[str, str]:
    """A step's record as name = text, absent values left out."""
    return {name: str(v) for name, v in zip(STEP_FIELDS, json.loads(value)) if v is not None}


def flat_fields(raw: Mapping[str, str]) -> dict[str, str]:
    flat: dict[str, str] = {}
    for name, value in raw.items():
        if is_step_record(name, value):
            flat.update({f"{name}.{part}": v for part, v in unpack_step(value).items()})
        else:
            flat[name] = value
    return flat


def _is_step_value(name: str) -> bool:
    """``<step>.<one of STEP_FIELDS>`` (``fanin.drone``, ``fail.step`` are plain fields)."""
    step, _, part = name.rpartition(".")
    return part in STEP_FIELDS and step not in RESERVED_FIELDS


def parse_steps(raw: Mapping[str, str]) -> dict[str, StepState]:
    steps = {name: unpack_step(value) for name, value in raw.items() if is_step_record(name, value)}
    return {
        name: StepState(
            step=name,
            status=r.get("status", ""),
            complete_by=int(r.get("complete_by", "0")),
            attempt=int(r.get("attempt", "1")),
            tries=int(r.get("tries", "0")),
            failures=int(r.get("failures", "0")),
            error=r.get("error", ""),
            updated=int(r.get("updated", "0")),
            source=r.get("source", ""),
        )
        for name, r in steps.items()
    }


def _started(verdict: str, attempt: int) -> tuple[Begin, int]:
    """``go:<n>`` / ``replay:<n>``: another trigger of a requeued step, joining its attempt ``n``."""
    name, _, joined = verdict.partition(":")
    return Begin(name), int(joined) if joined else attempt
