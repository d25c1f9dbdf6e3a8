"""What the supervisor does to the state table, as conditional Lua transitions, and the
bounded scan of the deadline index that finds its work.

Why Lua and not read-decide-write in Python: a step's fate must be decided on the state
as it is at the moment of the write. One script per due step reads the step, checks the
lease's fencing token and decides, atomically; no compare-and-set retry loop, no window in
which the owning service (finishing late) or a second supervisor (deposed, still running)
could slip a write in between. One scan is therefore one pipelined ``ZRANGEBYSCORE`` per
shard's deadline index (``choreo.keys``) + one pipelined script call per due step:
O(expired + shards), paged, never a walk over every key. A script touches one hash slot: the
step's delivery, its shard's index and its shard's copy of the lease's fence.

The transitions, for a step found due (deadline passed, or failed and re-indexed at once):

* the delivery already has a final ``outcome`` (and it is a forward step): drop it from
  the index; nothing can help it and nothing needs it;
* a fan-in step (``waits_for``) that is not failed, while an upstream step that owes it a
  half is open or closed less than one deadline ago: **wait**: ``complete_by`` follows the
  upstream's deadline, the token stays and no try is counted. The fan-in keeps its step
  open until both halves are in, and the awaited half carries its upstream's attempt: a new
  token would make it stale on arrival and the delivery could never decide;
* ``pending`` and never seen by its service (no ``<step>.source``: the service is down or
  behind): extend ``complete_by`` with back-off **without** a new token: the original
  trigger is still queued in Kafka and a bumped token would make it stale;
* ``processing``/``failed`` (or a requeue that was never picked up): **claim** it: a new
  token (attempt + 1) makes any older attempt stale at once, and the re-publication is due
  after an exponential back-off (phase 1); when the back-off is over, the scan finds it
  again and re-publishes its input to the step's retry topic (phase 2). Redis is written
  before the Kafka transaction commits; if that commit is lost, the step simply expires
  again and is claimed again: a requeue can be late, never lost;
* past the retry budget: a forward step fails the delivery (``outcome`` = failed, only if
  nobody decided first) with the list of steps to compensate; a compensation step ends
  ``compensation_failed`` on the step it was undoing, with an alert, and lists that step in
  its shard's ``awaiting-operator`` set (``choreo ops status`` reads it) until an operator's
  decision takes it out, or the state's expiry (the set is trimmed past the wait).

One end-to-end retry budget per step: the runner's ``<step>.tries`` already counts every
in-process try, redelivery and requeue that reached the service; the supervisor compares
it to the step's budget (the service's ``retry_budget``) and adds one try itself only for a
deadline period in which nobody tried at all (``tries_seen``), so a dead service cannot keep
a step open forever and a requeue is never counted twice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from choreo import keys
from choreo.effects import OnceEffect
from choreo.kafka import headers_if_readable
from choreo.redis_client import NodePipelines, raise_first, write_waited
from choreo.runtime_events import CompensationRecord
from choreo.state import (MAX_ERROR_CHARS, deadline_index, deadline_shard, deadline_shards, delivery_key,
                          index_member, text, with_steps)

# -- metrics (operators see detection delay, load and every decision) -----------------------

SCAN_SECONDS = Histogram("choreo_supervisor_scan_seconds", "Duration of one deadline scan",
                         buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PAGE_SIZE = Histogram("choreo_supervisor_page_size", "Due steps per scanned page",
                      buckets=(0, 1, 5, 10, 25, 50, 100, 250, 500, 1000))
EXPIRED = Gauge("choreo_supervisor_due_steps", "Due (expired or failed) steps found by the last scan")
DUE_BACKLOG = Gauge("choreo_supervisor_due_backlog", "Due steps still in the index after the last scan")
AWAITING_OPERATOR = Gauge("choreo_supervisor_undos_awaiting_operator",
                          "Steps whose undo failed for good, waiting for an operator's decision (alert while > 0)")
ACTIONS = Counter("choreo_supervisor_actions_total", "Supervisor decisions", ["action", "step"])
REQUEUES = Counter("choreo_supervisor_requeues_total", "Steps re-published to their retry topic", ["step"])
COMPENSATIONS = Counter("choreo_supervisor_compensations_total", "Compensation log records", ["step", "status"])
COMPENSATION_FAILURES = Counter("choreo_supervisor_compensation_failures_total",
                                "Compensations that failed past their budget (alert)", ["step"])
LEADER = Gauge("choreo_supervisor_leader", "1 while this instance holds the supervisor lease")
REPORTS = Counter("choreo_supervisor_reports_total", "Recovery reports recorded", ["kind", "verdict"])


# -- settings --------------------------------------------------------------------------------

def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class SupervisorSettings:
    """Every knob by environment; the defaults favour a 30 s step deadline.

    ``scan_period_s`` is the trade-off the issue asks to make visible: detection delay is up
    to one period (plus the back-off), the load is one ``ZRANGEBYSCORE`` per period plus one
    script per due step. At 1 s an idle index costs ~1 command/s; a deadline missed is seen
    within ~1 s, small beside 30 s deadlines.
    """

    scan_period_s: float = 1.0
    page_size: int = 200
    max_per_scan: int = 2000  # result cap: the rest waits for the next period
    scan_budget_s: float = 0.5  # time window of one scan (must stay well under the lease TTL)
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    max_tries: int = 0  # 0: each step's own service retry_budget (the one budget)
    lease_ttl_s: float = 5.0
    confirm_s: float = 10.0  # re-publish our delivery.failed if we have not seen it by then
    park_s: float = 600.0  # a step no workflow declares is looked at again this much later

    @classmethod
    def from_env(cls) -> SupervisorSettings:
        d = cls()
        return cls(
            scan_period_s=_env_float("SUPERVISOR_SCAN_PERIOD_S", d.scan_period_s),
            page_size=int(_env_float("SUPERVISOR_PAGE_SIZE", d.page_size)),
            max_per_scan=int(_env_float("SUPERVISOR_MAX_PER_SCAN", d.max_per_scan)),
            scan_budget_s=_env_float("SUPERVISOR_SCAN_BUDGET_S", d.scan_budget_s),
            backoff_base_s=_env_float("SUPERVISOR_BACKOFF_BASE_S", d.backoff_base_s),
            backoff_max_s=_env_float("SUPERVISOR_BACKOFF_MAX_S", d.backoff_max_s),
            max_tries=int(_env_float("SUPERVISOR_MAX_TRIES", d.max_tries)),
            lease_ttl_s=_env_float("SUPERVISOR_LEASE_TTL_S", d.lease_ttl_s),
            confirm_s=_env_float("SUPERVISOR_CONFIRM_S", d.confirm_s),
            park_s=_env_float("SUPERVISOR_PARK_S", d.park_s),
        )


# -- policies: what the supervisor knows about each step ---------------------------------------

FORWARD = "forward"
COMPENSATION = "compensation"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class StepPolicy:
    """One step as the supervisor treats it (derived from the workflow's declarations)."""

    step: str
    role: str  # forward | compensation | unknown
    budget: int
    deadline_ms: int
    service: str = ""
    target: str = ""  # for a compensation step: the forward step it undoes
    # for a fan-in step: the upstream steps whose results it joins (it waits for them)
    waits_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class Policies:
    steps: dict[str, StepPolicy]
    compensable: tuple[str, ...]  # forward steps that have a compensation, i.e. side effects
    decider: str = ""  # the step whose completion makes a delivery's ``outcome`` final
    # how long the state of a delivery the supervisor fails waits for the failure to be read
    # (the deciding join's ``unread_failure_s``), 0: no expiry
    unread_failure_s: int = 0

    def of(self, step: str) -> StepPolicy:
        return self.steps.get(step) or StepPolicy(step, UNKNOWN, 0, 0)


# -- the transitions (Lua) -------------------------------------------------------------------

_SETTLE = """
-- A failure's compensation has ended when an undo failed for good ('failed') or when no step
-- of ``undo.order`` is left compensating ('compensated' if one was undone, else 'failed').
-- The first answer is kept in ``outcome.told`` and returned once, so the delivery's
-- submitter is told exactly once (``choreo.outcomes``), an undo recovered later included.
local function settle(key)
  if redis.call('HEXISTS', key, 'outcome.told') == 1 then return '' end
  local order = redis.call('HGET', key, 'undo.order') or ''
  if order == '' then return '' end
  local told = 'failed'
  for s in string.gmatch(order, '[^,]+') do
    local st = step_get(key, s, 'status')
    if st == 'compensation_failed' then
      told = 'failed'
      break
    elseif st == 'compensating' then
      told = ''
    elseif st == 'compensated' and told ~= '' then
      told = 'compensated'
    end
  end
  if told ~= '' then redis.call('HSET', key, 'outcome.told', told) end
  return told
end
"""

# the error of a forward step closed because its delivery failed before it began (a rebuild
# closes such a step as the supervisor did: ``choreo.ops.rebuild``)
CLOSED_BY_FAILURE = "closed: its delivery failed first"

# A pending step of a failed delivery must not begin (its trigger may still be queued, or its
# requeue on the way): closed with a new token, out of the deadline index ``index``.
_CLOSE_PENDING = """
local function close_pending(key, index, delivery, step, now)
  step_set(key, step, {status = 'failed', attempt = (step_get(key, step, 'attempt') or 1) + 1, updated = now,
           error = '%s'})
  redis.call('ZREM', index, delivery .. '|' .. step)
end
""" % CLOSED_BY_FAILURE

# a step whose undo failed for good, in its delivery's hash while the compensation record
# the scan wrote of it is not known committed: [the undo's attempt, the step's status before,
# the outcome that record tells] (``_SUPERVISE``, ``_RECORDED``)
UNRECORDED = "undo.unrecorded."

_SUPERVISE = with_steps(_SETTLE + _CLOSE_PENDING + "local UNRECORDED = '%s'\n" % UNRECORDED + """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return cjson.encode({a = 'fenced'}) end
local step, member, now = ARGV[2], ARGV[3], tonumber(ARGV[4])
local score = redis.call('ZSCORE', KEYS[2], member)
if (not score) or tonumber(score) > now then return cjson.encode({a = 'gone'}) end
local function get(field) return redis.call('HGET', KEYS[1], field) end
local function of(name, value) return step_get(KEYS[1], name, value) end
local function set(values) step_set(KEYS[1], step, values) end
local status = of(step, 'status')
if not status then
  redis.call('ZREM', KEYS[2], member)
  return cjson.encode({a = 'drop', why = 'no state'})
end
local role = ARGV[10]
if role == 'unknown' then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[14]), member)
  return cjson.encode({a = 'park'})
end
local outcome = get('outcome')
if role == 'forward' and outcome then
  if outcome == 'failed' and get('fail.step') == step and not get('fail.seen') then
    -- our delivery.failed is not confirmed (its transaction may be lost): publish it again
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[9]), member)
    return cjson.encode({a = 'fail', again = 1, reason = get('fail.reason') or '',
      detail = get('fail.detail') or '', compensate = get('fail.compensate') or '',
      attempt = of(step, 'attempt') or 1, tries = of(step, 'tries') or 0})
  end
  -- an outcome is published once the decider's step completed, and a failure the supervisor
  -- decided is its own to publish (above). The decider's own 'failed' is written by its
  -- effect before its batch commits: a batch killed then, whose replay came past the
  -- deadline ('expired', not run), leaves it in Redis alone. So the decider's step stays
  -- watched until it completes: claimed and requeued, the replay tells the decision again
  local decider = ARGV[13]
  local published = decider == '' or of(decider, 'status') == 'completed'
  if outcome == 'failed' and (step ~= decider or get('fail.by') == 'supervisor') then published = true end
  if published then
    redis.call('ZREM', KEYS[2], member)
    return cjson.encode({a = 'drop', why = 'outcome ' .. outcome})
  end
end
if role == 'compensation' then
  -- an undo failed for good whose record is not known committed (``_RECORDED``): the scan's
  -- transaction that carried it may have aborted, so it is written again (the same ids)
  -- while its step still waits for an operator; decided since, it is not (a late
  -- COMPENSATION_FAILED after a COMPENSATED would end the compacted log wrong)
  local field = UNRECORDED .. ARGV[11]
  local raw = get(field)
  if raw then
    local unrecorded = cjson.decode(raw)
    if status == 'failed' and of(step, 'attempt') == unrecorded[1] + 1 then
      if of(ARGV[11], 'status') == 'compensation_failed' then
        redis.call('ZADD', KEYS[2], now + tonumber(ARGV[9]), member)
        return cjson.encode({a = 'comp_failed_again', target = ARGV[11], before = unrecorded[2],
          attempt = unrecorded[1], tries = of(step, 'tries') or 0, detail = of(ARGV[11], 'error') or '',
          told = unrecorded[3], undone = get('undo.order') or ''})
      end
      redis.call('HDEL', KEYS[1], field)
      redis.call('ZREM', KEYS[2], member)
      return cjson.encode({a = 'drop', why = 'decided before its record was known written'})
    end
    redis.call('HDEL', KEYS[1], field)  -- an earlier attempt's: the undo was asked again since
  end
end
if status ~= 'pending' and status ~= 'processing' and status ~= 'failed' then
  redis.call('ZREM', KEYS[2], member)
  return cjson.encode({a = 'drop', why = status})
end
local attempt = of(step, 'attempt') or 1
local deadline_ms = tonumber(ARGV[6])
if (of(step, 'requeue') or 0) == attempt then
  -- phase 2: the back-off of a claimed step is over: re-publish with the claimed token.
  -- A fan-in half that joined the claimed attempt meanwhile runs as it (Kafka replays it
  -- if its batch aborts): sent again it would run twice, and a fan-in that decided would
  -- publish its decision a second time
  local complete_by = now + deadline_ms
  local joined, sources = of(step, 'joined'), {}
  for entry in string.gmatch(of(step, 'source') or '', '[^;]+') do
    if entry ~= joined then table.insert(sources, entry) end
  end
  set({complete_by = complete_by, requeued = attempt, updated = now, requeue = cjson.null})
  redis.call('ZADD', KEYS[2], complete_by, member)
  return cjson.encode({a = 'requeue', attempt = attempt, source = table.concat(sources, ';'),
    joined = joined or '', complete_by = complete_by})
end
if ARGV[15] ~= '' and status ~= 'failed' then
  -- a fan-in step still waiting for a half is not stuck while the upstream step that owes
  -- that half is open (or closed less than a deadline ago: the half is on its way): the
  -- supervisor watches that step on its own. A new token here would make the awaited half,
  -- which carries its upstream's attempt, stale on arrival and the delivery would never
  -- decide; so keep the token, count no try, and follow the upstream's deadline
  local until_ms, on = 0, {}
  for name in string.gmatch(ARGV[15], '[^,]+') do
    local st = of(name, 'status')
    local due = 0
    if st == 'completed' then
      due = (of(name, 'completed_at') or 0) + deadline_ms
    elseif st then
      due = math.max(now, of(name, 'complete_by') or 0) + deadline_ms
    end
    if due > now then
      table.insert(on, name)
      if due > until_ms then until_ms = due end
    end
  end
  if #on > 0 then
    set({complete_by = until_ms, waiting = table.concat(on, ',')})
    redis.call('ZADD', KEYS[2], until_ms, member)
    return cjson.encode({a = 'wait', attempt = attempt, on = table.concat(on, ','),
      complete_by = until_ms, was = status})
  end
end
local tries = of(step, 'tries') or 0
if tries <= (of(step, 'tries_seen') or 0) then
  -- a whole deadline period without any try counts as one: the budget also bounds dead services
  tries = tries + 1
end
local failures = (of(step, 'failures') or 0) + 1
set({tries = tries, tries_seen = tries, failures = failures})
if tries >= tonumber(ARGV[5]) then
  local detail = step .. ' ' .. status .. ' after ' .. tries .. ' tries'
  local err = of(step, 'error')
  if err then detail = detail .. ': ' .. err end
  if role == 'compensation' then
    set({status = 'failed', attempt = attempt + 1, updated = now})
    local target = ARGV[11]
    local before = of(target, 'status') or ''
    -- the undo failed for good, whether or not its request was recorded yet (topics race)
    local told = ''
    if before ~= '' and before ~= 'compensated' and before ~= 'compensation_failed' then
      step_set(KEYS[1], target, {status = 'compensation_failed', updated = now, error = detail})
      -- listed while it waits for an operator's decision (``choreo ops status``)
      redis.call('ZADD', KEYS[4], now, string.sub(member, 1, #member - #step) .. target)
      told = settle(KEYS[1])
      -- its state waits for an operator's decision (``choreo ops mark-compensated``,
      -- ``retry-undo``) as long as an unread failure waits for its reading; either gives it
      -- the retention again
      if tonumber(ARGV[16]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[16]) end
      -- watched until its record is known committed (above)
      redis.call('HSET', KEYS[1], UNRECORDED .. target, cjson.encode({attempt, before, told}))
      redis.call('ZADD', KEYS[2], now + tonumber(ARGV[9]), member)
    else
      redis.call('ZREM', KEYS[2], member)
    end
    return cjson.encode({a = 'comp_failed', target = target, before = before, attempt = attempt,
      tries = tries, detail = detail, told = told, undone = get('undo.order') or ''})
  end
  -- fail the delivery: steps that may have side effects, the abandoned ones first, then
  -- the completed ones newest first (reverse order of completion); one still pending is
  -- closed
  local done, abandoned, closed = {}, {}, {}
  for name in string.gmatch(ARGV[12], '[^,]+') do
    local st = of(name, 'status')
    if st == 'completed' then
      table.insert(done, {name, of(name, 'completed_at') or 0})
    elseif st == 'processing' then
      table.insert(abandoned, name)
    elseif st == 'pending' and name ~= step then
      close_pending(KEYS[1], KEYS[2], string.sub(member, 1, #member - #step - 1), name, now)
      table.insert(closed, name)
    end
  end
  table.sort(done, function(x, y) return x[2] > y[2] end)
  for _, item in ipairs(done) do table.insert(abandoned, item[1]) end
  local compensate = table.concat(abandoned, ',')
  local reason = 'RETRY_BUDGET_SPENT'
  if status ~= 'failed' then reason = 'DEADLINE_MISSED' end
  redis.call('HSET', KEYS[1], 'outcome', 'failed', 'fail.by', 'supervisor', 'fail.step', step,
             'fail.reason', reason, 'fail.detail', detail, 'fail.compensate', compensate, 'fail.at', now)
  -- decided: its state goes in time, as the decider's own failures do (once read, with the retention)
  if tonumber(ARGV[16]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[16]) end
  set({status = 'failed', attempt = attempt + 1, updated = now})
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[9]), member)
  return cjson.encode({a = 'fail', again = 0, reason = reason, detail = detail, compensate = compensate,
    attempt = attempt + 1, tries = tries, closed = table.concat(closed, ',')})
end
-- the exponent counts the supervisor's own interventions (failures also counts the runner's)
local round = (of(step, 'backoffs') or 0) + 1
set({backoffs = round})
local backoff = math.floor(math.min(tonumber(ARGV[8]), tonumber(ARGV[7]) * 2 ^ (round - 1)))
if backoff < 1 then backoff = 1 end
local source = of(step, 'source') or ''
if source == '' then
  -- its service never saw it: the trigger is still queued in Kafka; wait longer, keep the
  -- token valid (a new one would make that queued trigger stale)
  local complete_by = now + backoff + deadline_ms
  set({complete_by = complete_by, updated = now})
  redis.call('ZADD', KEYS[2], complete_by, member)
  return cjson.encode({a = 'extend', attempt = attempt, backoff = backoff, tries = tries,
    failures = failures, complete_by = complete_by})
end
-- phase 1: claim with a new token (older attempts are stale from now on), publish after back-off
local claimed = attempt + 1
-- (an input that joined the attempt given away is given away with it: no longer 'joined')
set({attempt = claimed, status = 'pending', requeue = claimed, complete_by = now + backoff + deadline_ms,
     updated = now, joined = cjson.null})
redis.call('ZADD', KEYS[2], now + backoff, member)
return cjson.encode({a = 'claim', attempt = claimed, backoff = backoff, tries = tries,
  failures = failures, was = status})
""")

_RECORD_REPORT = with_steps("""
local K, step = KEYS[1], ARGV[1]
local status = step_get(K, step, 'status')
if not status then return 'unknown' end
step_set(K, step, {report = ARGV[3] .. ' attempt ' .. ARGV[2] .. ' at ' .. ARGV[4]})
if tonumber(ARGV[2]) < (step_get(K, step, 'attempt') or 1) then return 'stale' end
if status ~= 'pending' and status ~= 'processing' and status ~= 'failed' then return 'closed' end
if ARGV[6] ~= '' then step_set(K, step, {error = ARGV[6]}) end
redis.call('ZADD', KEYS[2], 'LT', ARGV[4], ARGV[5])
return 'due'
""")

# The scan's record of an undo failed for good committed (``Transitions.recorded_many``):
# the step leaves the index, unless its undo was asked again since. ARGV: the forward step,
# its undo step, the undo's member in the index, the undo's attempt that failed. The
# answer: 1 when it was waiting for this record.
_RECORDED = with_steps("""
local field = '%s' .. ARGV[1]
local raw = redis.call('HGET', KEYS[1], field)
if not raw then return 0 end
local unrecorded = cjson.decode(raw)
if tonumber(unrecorded[1]) ~= tonumber(ARGV[4]) then return 0 end
redis.call('HDEL', KEYS[1], field)
if step_get(KEYS[1], ARGV[2], 'status') == 'failed' and step_get(KEYS[1], ARGV[2], 'attempt') == unrecorded[1] + 1 then
  redis.call('ZREM', KEYS[2], ARGV[3])
end
return 1
""" % UNRECORDED)

# The steps of a failed delivery are undone one after another, newest completed first: its
# ``undo.order`` lists them; the next to ask is the first still ``compensating`` (not asked
# before its predecessor is confirmed, and never after one ended compensation_failed, which
# waits for an operator's decision).
_NEXT_UNDO = """
local function next_undo(key)
  for s in string.gmatch(redis.call('HGET', key, 'undo.order') or '', '[^,]+') do
    local st = step_get(key, s, 'status')
    if st == 'compensating' then return s end
    if st == 'compensation_failed' then return '' end
  end
  return ''
end
local function awaits_operator(key)
  for s in string.gmatch(redis.call('HGET', key, 'undo.order') or '', '[^,]+') do
    if step_get(key, s, 'status') == 'compensation_failed' then return true end
  end
  return false
end
"""

# Recording facts seen on topics: safe on any instance (not fenced), remembered per event id
# so an aborted-and-replayed batch is told the same answer and writes the same log records.
# ARGV: now, delivery, the failed step, the reason, the decided state's retention (s, 0:
# none), the steps that have an undo (comma-separated), then the steps to undo, newest
# first. A failed delivery's state waits for this reading (``Join.unread_failure_s``); read,
# it has the retention from now on, for its undos. A step with an undo that is pending (not
# begun, or claimed for a requeue) and not listed is closed with a new token, the failed step
# too, as the supervisor's own failure closes it: a failure written by hand may leave it out,
# and its queued trigger or requeue would take what nothing gives back.
MARK_COMPENSATING = OnceEffect("mark_compensating", with_steps(_SETTLE + _NEXT_UNDO + _CLOSE_PENDING + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- its state is gone (past its retention): nothing is left to undo it from
  if #ARGV >= 7 then return cjson.encode({told = 'failed'}) end
  return '{}'
end
local now, delivery = tonumber(ARGV[1]), ARGV[2]
redis.call('HSET', KEYS[1], 'fail.seen', now)
if not redis.call('HGET', KEYS[1], 'outcome') then redis.call('HSET', KEYS[1], 'outcome', 'failed') end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], delivery .. '|' .. ARGV[3]) end
redis.call('HSETNX', KEYS[1], 'undo.reason', ARGV[4])
redis.call('HSETNX', KEYS[1], 'undo.order', table.concat({select(7, unpack(ARGV))}, ','))
-- (not while an undo failed for good waits for an operator's decision: a second failure event)
if tonumber(ARGV[5]) > 0 and redis.call('HGET', KEYS[1], 'outcome') == 'failed' and not awaits_operator(KEYS[1]) then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
end
local marked = {}
for i = 7, #ARGV do
  local s = ARGV[i]
  local st = step_get(KEYS[1], s, 'status')
  if st and st ~= 'compensating' and st ~= 'compensated' and st ~= 'compensation_failed' then
    step_set(KEYS[1], s, {status = 'compensating', compensating_at = now, updated = now})
    redis.call('ZREM', KEYS[2], delivery .. '|' .. s)
    table.insert(marked, {step = s, before = st, attempt = step_get(KEYS[1], s, 'attempt') or 1})
  end
end
local outcome = redis.call('HGET', KEYS[1], 'outcome')
local closed = {}
if outcome == 'failed' then
  for s in string.gmatch(ARGV[6], '[^,]+') do
    if step_get(KEYS[1], s, 'status') == 'pending' then
      close_pending(KEYS[1], KEYS[2], delivery, s, now)
      table.insert(closed, s)
    end
  end
end
local answer = {next = next_undo(KEYS[1]), told = settle(KEYS[1]), outcome = outcome}
if #marked > 0 then answer.marked = marked end
if #closed > 0 then answer.closed = closed end
return cjson.encode(answer)
"""))

# The undo is a fact whatever order the topics are read in: a cancellation read before the
# delivery.failed that asked for it still marks the step compensated (and that one then
# skips it), so the two events never race each other into a wrong final state. The answer
# names the next step to undo, if any, and whether the compensation ended (``settle``):
# 'compensated:<status before>:<attempt>:<next>:<reason>\x1f<told>\x1f<undo order>'. The
# last two are appended after the free-text reason behind unit separators, so a version that
# knows only 'compensated:<before>:<attempt>:<next>:<reason>' still reads the rest, and this
# one reads an answer such a version remembered (no separator: nothing told). ARGV: the step,
# now, optionally the only status it is marked from (an operator's mark by hand:
# 'compensation_failed'; any other status is answered 'ignored:<status>'), and the decided
# state's retention (s, 0: none), which a step leaving compensation_failed gives it again, and
# its member in the shard's awaiting-operator set (KEYS[2], ARGV[5]), which it leaves.
UNIT = "\x1f"  # what separates the answer's appended fields (Lua's '\31')
MARK_COMPENSATED = OnceEffect("mark_compensated", with_steps(_SETTLE + _NEXT_UNDO + """
local st = step_get(KEYS[1], ARGV[1], 'status')
if not st then return 'ignored:none' end
if st == 'compensated' then return 'ignored:compensated' end
if ARGV[3] and ARGV[3] ~= '' and st ~= ARGV[3] then return 'ignored:' .. st end
local now = tonumber(ARGV[2])
step_set(KEYS[1], ARGV[1], {status = 'compensated', compensated_at = now, updated = now})
if st == 'compensation_failed' and tonumber(ARGV[4] or '0') > 0 then redis.call('EXPIRE', KEYS[1], ARGV[4]) end
redis.call('ZREM', KEYS[2], ARGV[5])
return 'compensated:' .. st .. ':' .. (step_get(KEYS[1], ARGV[1], 'attempt') or 1) .. ':' .. next_undo(KEYS[1])
  .. ':' .. (redis.call('HGET', KEYS[1], 'undo.reason') or '')
  .. '\\31' .. settle(KEYS[1]) .. '\\31' .. (redis.call('HGET', KEYS[1], 'undo.order') or '')
"""))


# An operator asks a failed undo again (``choreo ops retry-undo``): from compensation_failed
# alone, the forward step is compensating again and its undo step pending at a new attempt,
# with a full budget and a deadline, in the index, and not yet seen by its service (so the
# scan waits for the new request before it claims); what the failed attempts left (their
# error, report, requeue) goes, and the state has the retention again, as a failure's
# undos have from its reading; it leaves the shard's awaiting-operator set (KEYS[3]). ARGV: the
# forward step, its undo step, now, the undo's deadline (ms), the undo's member in the
# index, the retention (s, 0: none). The answer:
# 'asked:<attempt>:<the failure's reason>' or 'ignored:<status>'.
ASK_UNDO_AGAIN = OnceEffect("ask_undo_again", with_steps("""
local K, step, undo, now = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local st = step_get(K, step, 'status')
if st ~= 'compensation_failed' then return 'ignored:' .. (st or 'none') end
local attempt = (step_get(K, undo, 'attempt') or 1) + 1
local complete_by = now + tonumber(ARGV[4])
step_set(K, step, {status = 'compensating', updated = now, error = cjson.null})
step_set(K, undo, {status = 'pending', attempt = attempt, tries = 0, tries_seen = 0, failures = 0, backoffs = 0,
                   complete_by = complete_by, updated = now, source = cjson.null, requeue = cjson.null,
                   requeued = cjson.null, error = cjson.null, report = cjson.null, late = cjson.null,
                   joined = cjson.null})
redis.call('ZADD', KEYS[2], complete_by, ARGV[5])
redis.call('ZREM', KEYS[3], string.sub(ARGV[5], 1, #ARGV[5] - #undo) .. step)  -- waits no more
if tonumber(ARGV[6]) > 0 then redis.call('EXPIRE', K, ARGV[6]) end
return 'asked:' .. attempt .. ':' .. (redis.call('HGET', K, 'undo.reason') or '')
"""))


# A listed step waits no more once its record says otherwise: checked and taken out in one
# script, so a step that fails again meanwhile stays listed. ARGV: its member, the step.
# The answer: 1 while it waits.
_STILL_AWAITING = with_steps("""
if step_get(KEYS[1], ARGV[2], 'status') == 'compensation_failed' then return 1 end
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
""")


# -- results -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unrecorded:
    """An undo failed for good whose record a scan wrote: ``step``'s undo ``undo`` at ``attempt``."""

    delivery_id: str
    step: str
    undo: str
    attempt: int


@dataclass(frozen=True)
class Action:
    """One decision of a scan, for the caller to carry out in Kafka (requeue, fail, log)."""

    kind: str  # drop | park | wait | extend | claim | requeue | fail | comp_failed | comp_failed_again | gone | error
    delivery_id: str
    step: str
    data: dict[str, Any]


@dataclass
class ScanStats:
    pages: int = 0
    due: int = 0
    commands: int = 0  # Redis commands sent (ZRANGEBYSCORE + one script per due step)
    keys: set[str] = field(default_factory=set)  # distinct keys the scan read or wrote
    seconds: float = 0.0
    fenced: bool = False
    capped: bool = False
    page_sizes: list[int] = field(default_factory=list)


@dataclass
class ScanResult:
    actions: list[Action]
    stats: ScanStats


class Transitions:
    """The supervisor's scripts bound to one Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.supervise = client.register_script(_SUPERVISE)
        self._record_report = client.register_script(_RECORD_REPORT)
        self._recorded = client.register_script(_RECORDED)

    def record_report(self, delivery_id: str, step: str, attempt: int, kind: str, now_ms: int,
                      error: str) -> str:
        """Make a reported step due now (any instance may: it is idempotent and unfenced).
        The record waits for a replica (``write_waited``): the report's offset is committed
        on it, and a failover that lost it would leave the step to its deadline, late."""
        keys = [delivery_key(delivery_id), deadline_index(delivery_id)]
        args: list[str | int] = [step, attempt, kind, now_ms, index_member(delivery_id, step), error[:MAX_ERROR_CHARS]]
        result = write_waited(self.client, keys[0],
                              lambda pipe: self._record_report(keys=keys, args=args, client=pipe))
        return result.decode() if isinstance(result, bytes) else str(result)

    def recorded_many(self, items: Sequence[Unrecorded]) -> list[bool]:
        """The scan's records of these undos failed for good are committed: the scan need not
        write them again (``_SUPERVISE``). One round trip per Redis node; whether each was
        waiting for its record."""
        pipes = NodePipelines(self.client)
        for item in items:
            key = delivery_key(item.delivery_id)
            self._recorded(keys=[key, deadline_index(item.delivery_id)],
                           args=[item.step, item.undo, index_member(item.delivery_id, item.undo), item.attempt],
                           client=pipes.on(key))
        return [bool(answer) for answer in raise_first(pipes.execute())]


class Scanner:
    """The bounded, paged scan of every shard's deadline index (only the lease holder runs it)."""

    def __init__(self, client: redis.Redis, settings: SupervisorSettings) -> None:
        self.client = client
        self.settings = settings
        self.transitions = Transitions(client)
        self._first = 0  # the shard the next scan starts at: a capped scan must not favour shard 0
        self._still_awaiting = client.register_script(_STILL_AWAITING)

    def scan(self, fence: str, fence_key: Callable[[int], str], policies: Policies,
             now_ms: int) -> ScanResult:
        """Act on every step due at ``now_ms``, shard by shard and page by page, within the
        result cap and the time window; what is left is found by the next period (the backlog
        gauge shows it). ``fence_key(shard)``: where the scripts on a shard read the fence."""
        cfg = self.settings
        stats = ScanStats()
        actions: list[Action] = []
        started = time.perf_counter()
        shards = [(self._first + i) % keys.SHARDS for i in range(keys.SHARDS)]
        self._first = (self._first + 1) % keys.SHARDS
        first_pages = self._due(shards, [0] * len(shards), now_ms, stats)
        for shard, members in zip(shards, first_pages):
            skip = 0  # due members that stayed due (errors): page past them
            while members:
                want = min(cfg.page_size, cfg.max_per_scan - stats.due)
                page = self._supervise_page(members[:want], shard, fence, fence_key(shard), policies,
                                            now_ms, stats)
                stats.due += min(len(members), want)
                for action in page:
                    if action.kind == "fenced":
                        stats.fenced = True
                    elif action.kind == "error":
                        skip += 1
                    else:
                        actions.append(action)
                if stats.fenced:
                    break
                if stats.due >= cfg.max_per_scan or time.perf_counter() - started > cfg.scan_budget_s:
                    stats.capped = True
                    break
                if len(members) < cfg.page_size:
                    break
                members = self._due([shard], [skip], now_ms, stats)[0]
            if stats.fenced or stats.capped:
                break
        stats.seconds = time.perf_counter() - started
        SCAN_SECONDS.observe(stats.seconds)
        EXPIRED.set(stats.due)
        return ScanResult(actions, stats)

    def _due(self, shards: list[int], skips: list[int], now_ms: int, stats: ScanStats) -> list[list[str]]:
        """A page of due members of each shard's index, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for shard, skip in zip(shards, skips):
            pipe.zrangebyscore(deadline_shard(shard), "-inf", now_ms, start=skip, num=self.settings.page_size)
            stats.keys.add(deadline_shard(shard))
        pages = [[m.decode() if isinstance(m, bytes) else str(m) for m in raw] for raw in pipe.execute()]
        stats.commands += len(shards)
        for members in pages:
            if members:
                stats.pages += 1
                stats.page_sizes.append(len(members))
                PAGE_SIZE.observe(len(members))
        return pages

    def _supervise_page(self, members: list[str], shard: int, fence: str, fence_key: str,
                        policies: Policies, now_ms: int, stats: ScanStats) -> list[Action]:
        cfg = self.settings
        pipes = NodePipelines(self.client)
        parsed: list[tuple[str, str]] = []
        compensable = ",".join(policies.compensable)
        for member in members:
            delivery_id, _, step = member.rpartition("|")
            parsed.append((delivery_id, step))
            policy = policies.of(step)
            budget = cfg.max_tries or policy.budget
            self.transitions.supervise(
                keys=[delivery_key(delivery_id), deadline_shard(shard), fence_key, awaiting_operator_shard(shard)],
                args=[fence, step, member, now_ms, budget, policy.deadline_ms,
                      int(cfg.backoff_base_s * 1000), int(cfg.backoff_max_s * 1000),
                      int(cfg.confirm_s * 1000), policy.role, policy.target, compensable,
                      policies.decider, int(cfg.park_s * 1000), ",".join(policy.waits_for),
                      policies.unread_failure_s],
                client=pipes.on(delivery_key(delivery_id)),
            )
            stats.keys.add(delivery_key(delivery_id))
            stats.commands += 1
        results = pipes.execute()
        stats.commands += 1  # the pipeline's SCRIPT EXISTS check (redis-py loads missing scripts)
        actions = []
        for (delivery_id, step), result in zip(parsed, results):
            if isinstance(result, Exception):
                actions.append(Action("error", delivery_id, step, {"error": str(result)[:300]}))
                continue
            data = json.loads(result)
            kind = str(data.pop("a"))
            actions.append(Action(kind, delivery_id, step, data))
            ACTIONS.labels(kind, step).inc()
        return actions

    def backlog(self, now_ms: int) -> int:
        """Due steps still waiting (one ZCOUNT per shard, O(log n) each, in one round trip):
        the load/delay trade-off made visible."""
        pipe = self.client.pipeline(transaction=False)
        for index in deadline_shards():
            pipe.zcount(index, "-inf", now_ms)
        count = sum(int(n) for n in pipe.execute())
        DUE_BACKLOG.set(count)
        return count

    def awaiting(self, now_ms: int, wait_s: int) -> int:
        """The steps waiting for an operator's decision (the gauge), once the lists are rid of
        those that wait no more: listed longer than their state waits (``wait_s``, 0: it
        never expires, and a margin for the clocks), or whose record says otherwise (decided
        by an older version, rebuilt, its state gone). At most ``AWAITING_CHECKED`` a shard
        are checked each time; the rest count as listed."""
        shards = awaiting_operator_shards()
        pipe = self.client.pipeline(transaction=False)
        for index in shards:
            if wait_s > 0:
                pipe.zremrangebyscore(index, "-inf", f"({now_ms - (wait_s + AWAITING_MARGIN_S) * 1000}")
            pipe.zcard(index)
            pipe.zrange(index, 0, AWAITING_CHECKED - 1)
        replies = pipe.execute()
        each = len(replies) // len(shards)  # per shard: (the trim,) its count, its first members
        listed = [(int(replies[i + each - 2]), replies[i + each - 1]) for i in range(0, len(replies), each)]
        unchecked = sum(count - len(members) for count, members in listed)
        pipes = NodePipelines(self.client)
        for index, (_, members) in zip(shards, listed):
            for member in members:
                delivery_id, _, name = text(member).rpartition("|")
                self._still_awaiting(keys=[delivery_key(delivery_id), index], args=[member, name],
                                     client=pipes.on(index))
        count = unchecked + sum(int(n) for n in raise_first(pipes.execute()))
        AWAITING_OPERATOR.set(count)
        return count


# -- the steps waiting for an operator --------------------------------------------------------

AWAITING_CHECKED = 1000  # listed steps checked per shard and count
AWAITING_MARGIN_S = 300  # past the state's wait, for the clocks of the instances that trim


def awaiting_operator_shard(shard: int) -> str:
    """``awaiting-operator:{s<n>}``: the shard's steps whose undo failed for good
    (``<delivery>|<step>``, scored by when their wait began), in its deliveries' slot."""
    return keys.of_shard("awaiting-operator", shard)


def awaiting_operator_index(delivery_id: str) -> str:
    return awaiting_operator_shard(keys.shard_of(delivery_id))


def awaiting_operator_shards() -> list[str]:
    return [awaiting_operator_shard(shard) for shard in range(keys.SHARDS)]


# -- re-reading a step's input from Kafka -------------------------------------------------------

@dataclass(frozen=True)
class Fetched:
    value: bytes | None
    headers: list[tuple[str, bytes]]


class SourceReader:
    """Fetches single records by position with one cached consumer (assign + seek, no group
    commits): requeues are rare, so one fetch each is cheaper than keeping a cache of events."""

    def __init__(self, bootstrap: str, name: str, overrides: dict[str, Any] | None = None) -> None:
        self.consumer = Consumer({
            **(overrides or {}),
            "bootstrap.servers": bootstrap,
            "group.id": f"{name}-source-reader",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 10,
            "enable.partition.eof": True,
        })

    def fetch(self, topic: str, partition: int, offset: int, timeout_s: float = 5.0) -> Fetched | None:
        self.consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                msg = self.consumer.poll(0.2)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return None
                    continue
                if msg.offset() == offset:
                    raw_headers: Any = headers_if_readable(msg) or []
                    headers = [(str(k), v if isinstance(v, bytes) else str(v or "").encode())
                               for k, v in raw_headers]
                    return Fetched(msg.value(), headers)
                if (msg.offset() or 0) > offset:  # compacted or aborted away
                    return None
            return None
        finally:
            self.consumer.unassign()

    def close(self) -> None:
        self.consumer.close()


# -- the compensation log ----------------------------------------------------------------------

class KeyedCompensationRecord(CompensationRecord):
    """A compensation log record keyed by ``delivery|step``: the log is compacted, and keyed by
    delivery alone it would keep only the last step's record of each delivery."""

    @property
    def key(self) -> str:
        return f"{self.delivery_id}|{self.step}"


def undo_fields(order: Iterable[str], reason: str) -> dict[str, str]:
    """The fields MARK_COMPENSATING keeps of a failure (the undo order, newest first, and
    its reason), for the rebuild."""
    return {"undo.order": ",".join(order), "undo.reason": reason[:500]}


@dataclass(frozen=True)
class Marked:
    """MARK_COMPENSATING's answer: the steps it marked (step, status before, attempt) and
    the step whose undo to ask for now ('' when none is due), the outcome the delivery's
    submitter is told when its compensation ended already ('' when not), the delivery's
    outcome ('' when its state is gone, or in an answer remembered by a version before),
    and the steps it closed while they were pending."""

    steps: list[dict[str, Any]]
    next: str
    told: str = ""
    outcome: str = ""
    closed: tuple[str, ...] = ()

    def undone_with_holds(self, undone: Sequence[str]) -> list[str]:
        """The steps of ``undone`` whose undo gives back what they hold: all but those marked
        here from another status than ``completed`` (an abandoned attempt, still running,
        took what it holds before its service's undo could be asked, and an undo refused for
        good earlier in the chain would keep it)."""
        unfinished = {str(m["step"]) for m in self.steps if m.get("before") != "completed"}
        return [step for step in undone if step not in unfinished]


def parse_marked(raw: str | None) -> Marked:
    value = json.loads(raw or "{}")
    return Marked(list(value.get("marked") or []), str(value.get("next") or ""), str(value.get("told") or ""),
                  str(value.get("outcome") or ""), tuple(str(s) for s in value.get("closed") or ()))


def split_list(raw: str) -> list[str]:
    return [s for s in raw.split(",") if s]


def labels(items: Iterable[Action]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for action in items:
        counts[action.kind] = counts.get(action.kind, 0) + 1
    return counts
