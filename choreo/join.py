"""Fan-in as a primitive: a step that waits for one result of each of several parts of one
delivery, and calls its handler exactly once, with every part or with the first failure.

The parts' results are recorded in the delivery's hash (``fanin.<part>``) by one atomic
script that also decides, exactly once, in whatever order the results arrive and on
whichever instance reads them; a replay of the deciding input is told the same decision,
read from the results again (``fanin.by`` names that input), and any other input is told
to wait. A result after an outcome the join did not decide (the supervisor's) is recorded
and ignored (``late``). A failure waits for every part too, so the steps to undo are known:
the parts that completed, newest first.

A part is named after the upstream step that produces it, so the supervisor knows what the
join waits for (``choreo.supervision``) without being told twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from types import GeneratorType
from typing import TYPE_CHECKING, Any, TypeVar

from choreo.effects import OnceEffect, Op
from choreo.errors import DeadLetterReason, Rejected
from choreo.events import Event
from choreo.state import delivery_key

if TYPE_CHECKING:
    from choreo.service import Context, HandlerResult

E = TypeVar("E", bound=Event)
FAILED = "failed"  # a failed delivery's outcome; the join names the other one
UNREAD_FAILURE_S = 24 * 3600
# A part's result as the join keeps it (JSON: a control character is six), in the delivery's
# hash for hours and copied into the decision; this workflow's are a few hundred characters
MAX_PART_CHARS = 16 * 1024

# KEYS: the delivery's hash. ARGV: part, 'ok' | 'fail', the result (JSON), retention seconds of
# a shipped delivery, of a failed one until the supervisor reads its failure
# (``Join.unread_failure_s``), the outcome of success, then every part's name in declaration order.
# The decision is remembered by the results themselves and ``fanin.by``, the input that
# decided (``remembered_as``, its memo field): a replay of that input is answered the same
# decision from them, and no copy of the results is kept beside them (``choreo.effects``).
# Any other input once the join decided is told to ``wait``: the step is the decider's to
# complete (a half that waited and is read again must not complete it under a decider whose
# batch died, or the decision would never be published). An input finding an outcome the
# join did not decide (the supervisor's, a rebuild's) is ``late``.
_RECORD = OnceEffect("join_record", """
local part, ok, value = ARGV[1], ARGV[2], ARGV[3]
local field = 'fanin.' .. part
if redis.call('HEXISTS', KEYS[1], field) == 0 then
  redis.call('HSET', KEYS[1], field, ok .. ':' .. value)
  if ok == 'ok' then
    redis.call('HSET', KEYS[1], 'fanin.order', part .. ',' .. (redis.call('HGET', KEYS[1], 'fanin.order') or ''))
  end
end
local decided = redis.call('HEXISTS', KEYS[1], 'outcome') == 1
local by = redis.call('HGET', KEYS[1], 'fanin.by')
if decided and by ~= remembered_as then return cjson.encode({d = by and 'wait' or 'late'}) end
local results, failed = {}, nil
for i = 7, #ARGV do
  local got = redis.call('HGET', KEYS[1], 'fanin.' .. ARGV[i])
  if not got then return cjson.encode({d = 'wait'}) end
  if string.sub(got, 1, 3) == 'ok:' then
    results[ARGV[i]] = string.sub(got, 4)
  elseif not failed then
    failed = {ARGV[i], string.sub(got, 6)}
  end
end
local order = redis.call('HGET', KEYS[1], 'fanin.order') or ''
if not decided then
  local ttl = tonumber(failed and ARGV[5] or ARGV[4])
  if ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) end
  -- a refusal (_REFUSE) may turn the outcome to failed later: a replay decides as first
  redis.call('HSET', KEYS[1], 'outcome', failed and 'failed' or ARGV[6], 'fanin.by', remembered_as)
end
if failed then
  return cjson.encode({d = 'fail', part = failed[1], result = failed[2], order = order})
end
return cjson.encode({d = 'complete', results = results, order = order})
""", remembers_itself=True)

# ARGV: how long the failed delivery's state waits for the supervisor to read its failure
_REFUSE = OnceEffect("join_refuse", """
redis.call('HSET', KEYS[1], 'outcome', 'failed')
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 'failed'
""")


@dataclass(frozen=True)
class Part:
    """One awaited result: the event that brings it, and the event that says it failed."""

    ok: type[Event]
    failed: type[Event] | None = None


@dataclass(frozen=True)
class Joined:
    """Every part's result, typed; ``completed`` names the parts newest first."""

    results: Mapping[str, Event]
    completed: tuple[str, ...]

    def of(self, part: str, model: type[E]) -> E:
        result = self.results[part]
        if not isinstance(result, model):
            raise TypeError(f"part {part!r} holds a {type(result).__name__}, not a {model.__name__}")
        return result


@dataclass(frozen=True)
class JoinFailed:
    """The first part (in declaration order) that failed, its failure event, and the parts
    that completed, newest first: the steps whose work must be undone."""

    part: str
    failure: Event
    completed: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    kind: str  # complete | fail | wait | late
    joined: Joined | None = None
    failed: JoinFailed | None = None


Outcome = Callable[[Any, "Context"], Any]


class Join:
    """``service.join(step, parts=..., outcomes=...)``: decorate one handler with
    ``on_complete`` and one with ``on_failure``; the runtime subscribes to every part's
    topics. ``outcomes`` names the events that publish the decision: the rebuild and the
    operators' tools read a delivery's outcome from them."""

    def __init__(self, step: str, parts: Mapping[str, Part], *, outcomes: Mapping[type[Event], str],
                 retention_s: int, unread_failure_s: int = UNREAD_FAILURE_S, prefix: str = "") -> None:
        if len(parts) < 2:
            raise ValueError(f"join {step!r}: a join waits for two parts or more")
        for name in parts:  # a part names a field (fanin.<part>) and an entry of comma lists
            if not name or name in ("order", "by") or any(c in name for c in ",:|."):
                raise ValueError(f"join {step!r}: part {name!r}: not empty, not 'order' or 'by', "
                                 "no ',', ':', '|' or '.'")
        success = [name for name in outcomes.values() if name != FAILED]
        if len(success) != 1 or FAILED not in outcomes.values():
            raise ValueError(f"join {step!r}: name one event of success and one of {FAILED!r}")
        self.step = step
        self.parts = dict(parts)
        self.outcomes = dict(outcomes)  # the events that publish the decision, and its name
        self.outcome = success[0]
        self.retention_s = retention_s
        # a failed delivery's state stays until the supervisor reads its failure (which then
        # gives it ``retention_s``): its undos are asked from it, and a supervisor down past
        # the retention would otherwise find nothing to undo (drones held for good)
        self.unread_failure_s = max(unread_failure_s, retention_s) if retention_s > 0 else 0  # 0: no expiry
        self.prefix = prefix
        self.complete_handler: Outcome | None = None
        self.failure_handler: Outcome | None = None

    def on_complete(self, fn: Outcome) -> Outcome:
        self.complete_handler = fn
        return fn

    def on_failure(self, fn: Outcome) -> Outcome:
        self.failure_handler = fn
        return fn

    def topics(self) -> Iterable[tuple[str, type[Event], str, bool]]:
        """(topic, event type, part, ok) for every event a part may bring."""
        for name, part in self.parts.items():
            yield self.prefix + part.ok.topic, part.ok, name, True
            if part.failed is not None:
                yield self.prefix + part.failed.topic, part.failed, name, False

    def refuse(self, delivery_id: str) -> Op[None]:
        """The delivery fails after all (its complete handler could not carry it out): its
        outcome becomes ``failed``, as a failed part would have made it."""
        return Op(_REFUSE, (delivery_key(delivery_id),), (self.unread_failure_s,), lambda _: None)

    def record(self, delivery_id: str, part: str, ok: bool, event: Event) -> Op[Decision]:
        """Record ``event`` as ``part``'s result and decide, at most once per input event; a
        result over ``MAX_PART_CHARS`` is refused (``OVERSIZED``): it is kept in the delivery's
        hash and copied into the decision."""
        kept = result_text(event)
        if len(kept) > MAX_PART_CHARS:
            raise Rejected(f"{part}'s {type(event).__name__} would be kept as {len(kept)} characters of JSON, "
                           f"over the {MAX_PART_CHARS} a join keeps", DeadLetterReason.OVERSIZED)
        return Op(_RECORD, (delivery_key(delivery_id),),
                  (part, "ok" if ok else "fail", kept, self.retention_s, self.unread_failure_s,
                   self.outcome, *self.parts),
                  lambda raw: self._decision(delivery_id, raw))

    def handler(self, part: str, ok: bool) -> Callable[[Any, Context], Generator[Any, Any, HandlerResult]]:
        """The runtime's handler of one part's event: record, then call the outcome's handler
        once the join has decided."""

        def handle(event: Event, ctx: Context) -> Generator[Any, Any, HandlerResult]:
            decision: Decision = yield self.record(ctx.delivery_id, part, ok, event)
            if decision.kind == "complete" and self.complete_handler is not None:
                return (yield from _call(self.complete_handler, decision.joined, ctx))
            if decision.kind == "fail" and self.failure_handler is not None:
                return (yield from _call(self.failure_handler, decision.failed, ctx))
            if decision.kind == "wait":
                ctx.keep_open()  # the step is done only when every part is in
            elif decision.kind == "late":
                ctx.log.info("result.late", part=part)
            return None

        handle.__name__ = f"{self.step}_{part}_{'ok' if ok else 'failed'}"
        return handle

    def _decision(self, delivery_id: str, raw: str | None) -> Decision:
        """The script's answer, typed. A result the join cannot read (written by a version that
        kept another layout, or an event the current model refuses) dead-letters the input
        with the reason, where a crash would replay the same answer for ever."""
        try:
            return self._read_decision(delivery_id, raw)
        except (ValueError, TypeError, KeyError) as exc:
            raise Rejected(f"join {self.step}: a recorded result cannot be read: "
                           f"{type(exc).__name__}: {str(exc)[:200]}") from exc

    def _read_decision(self, delivery_id: str, raw: str | None) -> Decision:
        answer = json.loads(raw or "{}")
        kind = str(answer.get("d", ""))
        completed = tuple(p for p in str(answer.get("order", "")).split(",") if p)
        if kind == "complete":
            results = answer.get("results") or {}
            return Decision(kind, joined=Joined(
                {name: self._event(self.parts[name].ok, delivery_id, text) for name, text in results.items()},
                completed))
        if kind == "fail":
            name = str(answer["part"])
            model = self.parts[name].failed or self.parts[name].ok
            return Decision(kind, failed=JoinFailed(name, self._event(model, delivery_id, answer["result"]),
                                                    completed))
        return Decision(kind)

    @staticmethod
    def _event(model: type[E], delivery_id: str, text: str) -> E:
        return model.model_validate({**json.loads(text), "delivery_id": delivery_id})


def fanin_fields(results: Mapping[str, tuple[int, bool, str]]) -> dict[str, str]:
    """The hash fields the join script writes for these results (part -> (time, ok, result)),
    for the rebuild: a result per part, and the completed parts newest first."""
    fields = {f"fanin.{part}": f"{'ok' if ok else 'fail'}:{text}" for part, (_, ok, text) in results.items()}
    done = sorted((ts, part) for part, (ts, ok, _) in results.items() if ok)
    if done:
        fields["fanin.order"] = "".join(f"{part}," for _, part in reversed(done))
    return fields


def result_text(event: Event) -> str:
    """A part's result as the join keeps it: the event's JSON less the delivery id (the key
    says it), so a delivery's hash stays small."""
    return event.model_dump_json(exclude={"delivery_id"})


def _call(fn: Outcome, arg: Any, ctx: Context) -> Generator[Any, Any, HandlerResult]:
    """A handler's result, whether it is a plain function or yields effects itself."""
    called = fn(arg, ctx)
    if isinstance(called, GeneratorType):
        result: HandlerResult = yield from called
        return result
    return called  # type: ignore[no-any-return]
