"""Idempotent Redis effects that give the same answer when replayed.

A consumer's Redis write is not part of its Kafka transaction. If the transaction aborts
after Redis recorded an effect, the replay must be told the same outcome (e.g. "ship",
"drone-7"), or the output of the aborted transaction is lost forever. So every effect
runs inside one Lua script that first looks up the outcome remembered for this event id,
and otherwise applies the effect and remembers its outcome, atomically. Two kinds keep no
such copy: an effect whose own keys already say what it answered (``remembers_itself``: a
join's results with the input that decided, a record's field set once, an answer that is
always the same), and a step's write whose answer says nothing (``Op.write``), which the
step's finish applies instead (``choreo.runner``). A pool's reservation keeps its copy: the
member goes back to the pool when the delivery's success is read, while a stalled instance
or an operator's replay may still run the step's input again, and only the copy then answers
the member it had.

The outcomes are remembered as fields (``<service>:<effect>:<event id>``) of one hash per
delivery (``fx:{id}``), not as a key per effect per event: each such key cost about 190 bytes,
six per delivery (bench/README.md); a field costs its name and value. The hash lives
``CHOREO_ONCE_TTL_S`` after its last answer, or until its delivery is released
(``choreo.release``). An effect of a workflow service that finds its delivery released and
no answer remembered is not run: it answers ``RELEASED``, and the runner drops the attempt.
That is an attempt which began before the release and resumed after it (a stalled or
fenced instance): run, it would book a drone for a delivery that has already ended. In the
same way an effect asked in a step by an attempt that no longer owns the step (the
supervisor gave it to a newer attempt, or failed the delivery and undid the step) is not
run: it answers ``STALE``, and the runner drops the attempt. Run, a stalled attempt resuming
after the undo gave the drone back would book one again, held for a failed delivery for
good. An answer remembered before is replayed to either; an effect that remembers itself
(above) is refused, since its answer is not kept apart from what it did.

On a single node every effect runs with its memo in one script. An effect on keys of
another hash slot (a pool shared by all deliveries, a release index) cannot do so on a
Redis Cluster. There it runs in three calls instead: recall the answer (or learn the
delivery is released), run the body, remember the first answer given; in two when the body
remembers itself (nothing to remember). Such a body must itself be idempotent for the same
arguments (a pool's reservation for a holder answers the member already held), since a
crash between the last two calls runs it again; a delivery released (or a step given away)
between the recall and the remember gets ``RELEASED`` (``STALE``) and its effect stands
(RELIABILITY.md); in two calls the body's answer stands, and so does the effect.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis

from choreo import keys as layout
from choreo.answers import answer_of
from choreo.batch import BatchScript, Item, run_in_order, run_together
from choreo.dedupe import compact_id
from choreo.redis_client import is_cluster
from choreo.state import STEP_OWNED_LUA, HashWrite, Rider, delivery_key

# Before every effect body: ``refusal(table, refuse, step, attempt)``, the answer that keeps
# it from running (``RELEASED``, ``STALE``: an array, ``choreo.answers``) or nil. ``table``:
# the delivery's step table; ``refuse``: '1' to refuse a released delivery; ``step``,
# ``attempt``: the asking attempt's forward step ('' for none) and attempt, which must still
# own it.
_REFUSAL = STEP_OWNED_LUA + """
local function refusal(table_key, refuse, step, attempt)
  if refuse == '1' and redis.call('HEXISTS', table_key, 'done') == 1 then return {'released'} end
  if step ~= '' and not step_owned(table_key, step, tonumber(attempt)) then return {'stale'} end
  return nil
end
"""

# KEYS: the memo hash, the delivery's step table, the body's keys. ARGV: the memo field, the
# memo TTL, then ``refusal``'s refuse, step and attempt, then the body's args.
ONCE_TEMPLATE = _REFUSAL + """
local remembered = redis.call('HGET', KEYS[1], ARGV[1])
if remembered then return remembered end
local refused = refusal(KEYS[2], ARGV[3], ARGV[4], ARGV[5])
if refused then return refused end
local outcome = (function(KEYS, ARGV)
%s
end)({select(3, unpack(KEYS))}, {select(6, unpack(ARGV))})
if not outcome then return false end
redis.call('HSET', KEYS[1], ARGV[1], outcome)
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[2]) then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return outcome
"""

# An effect whose own keys remember what it answered: no copy of its answer in the memo hash.
# The body must answer a replay of the same input as the first run was answered; it sees the
# memo field as ``remembered_as`` (the join records by it who decided). The refusal comes
# first: a replay of an attempt that lost its step, or of a released delivery, is not
# answered (the begin refuses those inputs before any effect; this is the fence for an
# effect a handler asks after it).
SELF_REMEMBERING_TEMPLATE = _REFUSAL + """
local refused = refusal(KEYS[2], ARGV[3], ARGV[4], ARGV[5])
if refused then return refused end
local remembered_as = ARGV[1]
return (function(KEYS, ARGV)
%s
end)({select(3, unpack(KEYS))}, {select(6, unpack(ARGV))})
"""

# an effect on another slot's keys, in two or three calls (see the module doc). KEYS: the memo hash,
# the step table. ARGV: the memo field, then ``refusal``'s refuse, step and attempt
_RECALL = _REFUSAL + """
local remembered = redis.call('HGET', KEYS[1], ARGV[1])
if remembered then return remembered end
return refusal(KEYS[2], ARGV[2], ARGV[3], ARGV[4]) or false
"""

# ARGV: as ``_RECALL``'s, then the body's answer and the memo TTL
_REMEMBER = _REFUSAL + """
local refused = refusal(KEYS[2], ARGV[2], ARGV[3], ARGV[4])
if refused then return refused end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[5])
if redis.call('TTL', KEYS[1]) < tonumber(ARGV[6]) then redis.call('EXPIRE', KEYS[1], ARGV[6]) end
return redis.call('HGET', KEYS[1], ARGV[1])
"""

T = TypeVar("T")


class OnceEffect:
    """A Lua body run at most once per (event, effect); its string result is replayed after.

    The body sees its own ``KEYS``/``ARGV`` (without the runtime's bookkeeping) and
    returns a string (``cjson.encode`` for structure), or ``false`` when it did nothing
    (a transient "not now"): that is not remembered, so a retry asks again.

    ``remembers_itself``: the body answers a replay from its own keys as it answered first,
    for as long as a replay can come (``SELF_REMEMBERING_TEMPLATE``): a copy in the memo hash
    would only double it. A body that reads ``remembered_as`` needs the memo field in its
    script, so its keys must lie in the delivery's slot.
    """

    def __init__(self, name: str, body: str, *, remembers_itself: bool = False) -> None:
        self.name = name
        self.body = body
        self.remembers_itself = remembers_itself
        self.reads_memo_field = remembers_itself and "remembered_as" in body
        self.source = (SELF_REMEMBERING_TEMPLATE if remembers_itself else ONCE_TEMPLATE) % body
        self._scripts: dict[tuple[int, str], BatchScript] = {}

    def run(self, client: redis.Redis, delivery_id: str, memo_field: str, keys: Sequence[str],
            args: Sequence[str | int | float], ttl_s: int) -> str | None:
        return EffectCall(self, delivery_id, memo_field, tuple(keys), tuple(args), ttl_s).run(client)

    def script(self, client: redis.Redis) -> BatchScript:
        """The body with its memo, for keys in the delivery's slot."""
        return self._script(client, self.name, self.source)

    def bare(self, client: redis.Redis) -> BatchScript:
        """The body alone, for keys of another slot."""
        return self._script(client, f"{self.name}.bare", self.body)

    def _script(self, client: redis.Redis, name: str, source: str) -> BatchScript:
        script = self._scripts.get((id(client), source))
        if script is None:
            script = self._scripts[(id(client), source)] = BatchScript(client, f"effect:{name}", source)
        return script


@dataclass(frozen=True)
class EffectCall:
    """One effect for one input event, ready to run: alone (``run``) or with the effects of
    every other event of a batch in one round trip (``run_all``)."""

    effect: OnceEffect
    delivery_id: str  # its answers are remembered in the delivery's hash, ``memo_key``
    memo_field: str  # the answer's field there, for this (event, effect)
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...]
    ttl_s: int
    refuse_released: bool = False  # a workflow service's effect (see the module doc)
    # the step and attempt of the handler that asks it: not run once a newer attempt holds
    # the step or it is closed (a stalled attempt resuming after the supervisor gave its step
    # away, or failed its delivery and undid the step). '': asked outside any step
    step: str = ""
    attempt: int = 0

    def item(self, fenced: bool = True) -> Item:
        """Its keys and args for the memo template; ``fenced=False`` leaves out the step's
        check (an effect riding in the begin that just let its attempt run)."""
        step, attempt = (self.step, self.attempt) if fenced else ("", 0)
        return ([memo_key(self.delivery_id), delivery_key(self.delivery_id), *self.keys],
                [self.memo_field, self.ttl_s, self.refuse, step, attempt, *self.args])

    @property
    def refuse(self) -> str:
        return "1" if self.refuse_released else "0"

    @property
    def local(self) -> bool:
        """Whether its keys lie in its delivery's slot, so it runs with its memo in one script
        on a cluster too."""
        local = all(layout.in_slot_of(key, self.delivery_id) for key in self.keys)
        if not local and self.effect.reads_memo_field:
            raise ValueError(f"effect {self.effect.name} reads its memo field (remembered_as): "
                             "its keys must lie in the delivery's slot")
        return local

    def run(self, client: redis.Redis) -> str | None:
        return run_all(client, [self])[0]

    def rider(self) -> Rider:
        """This call riding in its input's begin (``StateTable.begin_riding``)."""
        keys, args = self.item(fenced=False)
        return Rider(self.effect.name, self.effect.source, tuple(keys), tuple(args))


@dataclass(frozen=True)
class Op(Generic[T]):
    """A typed effect on state a service declared (a record, a pool, a join): what a handler
    ``yield``s. The runtime runs it as a ``OnceEffect`` for the input event (at most once,
    the same answer on replay) and sends the handler back ``decode(answer)``, so business
    code names the operation and gets a typed answer, never Lua or raw Redis replies."""

    effect: OnceEffect
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...]
    decode: Callable[[str | None], T]
    # the same operation as a plain write, when its answer says nothing (``decode(None)``): a
    # step's handler gets that answer at once, and its finish applies the write (``choreo.runner``)
    write: HashWrite | None = None


def run_all(client: redis.Redis, calls: Sequence[EffectCall]) -> list[str | None]:
    """Every call's answer, in order: in one round trip, but for those on another slot of a
    cluster, in two or three (see the module doc)."""
    answers: list[str | None] = [None] * len(calls)
    together = not is_cluster(client)  # one node: a script may take any keys
    local = [i for i, call in enumerate(calls) if together or call.local]
    for i, answer in zip(local, _in_order(client, [calls[i] for i in local], _with_memo)):
        answers[i] = answer
    foreign = [i for i, call in enumerate(calls) if not (together or call.local)]
    if foreign:
        for i, answer in zip(foreign, _elsewhere(client, [calls[i] for i in foreign])):
            answers[i] = answer
    return answers


def _with_memo(client: redis.Redis, call: EffectCall) -> tuple[BatchScript, Item]:
    return call.effect.script(client), call.item()


def _bare(client: redis.Redis, call: EffectCall) -> tuple[BatchScript, Item]:
    return call.effect.bare(client), (call.keys, call.args)


def _in_order(client: redis.Redis, calls: Sequence[EffectCall],
              how: Callable[[redis.Redis, EffectCall], tuple[BatchScript, Item]]) -> list[str | None]:
    """Consecutive calls of one effect go in one script call (``choreo.batch``). Order
    matters between deliveries: a release followed by a reserve of the same fleet must not
    be turned around."""
    return [answer_of(reply) for reply in run_in_order(client, [how(client, call) for call in calls])]


def _elsewhere(client: redis.Redis, calls: Sequence[EffectCall]) -> list[str | None]:
    """Effects on another slot: recall, run what none remembers, remember the first answer
    (unless the body remembers itself)."""
    recall = BatchScript.of(client, "effect_recall", _RECALL)
    memo_items: list[Item] = [([memo_key(c.delivery_id), delivery_key(c.delivery_id)],
                               [c.memo_field, c.refuse, c.step, c.attempt]) for c in calls]
    answers = [answer_of(reply) for reply in run_together(client, [(recall, memo_items)])[0]]
    todo = [i for i, answer in enumerate(answers) if answer is None]
    ran = _in_order(client, [calls[i] for i in todo], _bare)
    for i, answer in zip(todo, ran):
        answers[i] = answer
    given = [(i, answer) for i, answer in zip(todo, ran)
             if answer is not None and not calls[i].effect.remembers_itself]
    if not given:
        return answers
    remember = BatchScript.of(client, "effect_remember", _REMEMBER)
    kept = run_together(client, [(remember, [
        (memo_items[i][0], [*memo_items[i][1], answer, calls[i].ttl_s]) for i, answer in given])])[0]
    for (i, _), answer in zip(given, kept):
        answers[i] = answer_of(answer)
    return answers


def memo_key(delivery_id: str) -> str:
    return layout.of_delivery("fx", delivery_id)


def memo_field(service: str, effect: OnceEffect, event_id: str, nth: int = 0) -> str:
    """``<service>:<effect>:<event id>`` (the service's prefix: see ``seen_field``), and
    ``#<n>`` after it for the n-th further effect of the kind for the same event."""
    field = f"{service}:{effect.name}:{compact_id(event_id)}"
    return f"{field}#{nth}" if nth else field
