"""Run one handler of a service in memory: no broker, no Redis, scripted answers.

    outcome = run(drone_scheduler.service, request, answers={"pool_reserve": Reservation("drone-7")})
    assert outcome.only(DroneScheduled).drone_id == "drone-7"
    assert outcome.asked("pool_reserve")[0].args == (request.delivery_id, 2.5)

The handler is driven by the runner's own ``Attempt``, so what it may yield, how answers go
back, how a ``Retryable`` or ``Rejected`` ends it and how returned events become emits are
the runtime's rules, not a copy of them. Every operation it asks (a typed ``Op``, a
``ctx.effect(...)`` or a ``ctx.once(...)``) is answered from the test's script, by effect
name: an answer nobody scripted fails the test, since a silent default would let a rule pass
on an answer Redis never gives. ``ctx.redis`` is not there: touching it fails the test too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
from confluent_kafka import Message

from choreo.answers import dropped_by
from choreo.effects import EffectCall, OnceEffect, Op
from choreo.envelope import Envelope, derived_id
from choreo.errors import AttemptDropped, DeadLetterReason, Rejected, Retryable
from choreo.events import Event, disagrees_with
from choreo.join import Decision, Join, Joined, JoinFailed
from choreo.runner import Attempt, Work, _as_events, oversized
from choreo.serde import FRAME_BYTES, avro_body
from choreo.service import Context, Emitted, HandlerResult, Service

E = TypeVar("E", bound=Event)

__all__ = ["Asked", "HarnessError", "LATE", "Logged", "Outcome", "Raw", "Records", "WAIT",
           "complete", "failed", "run"]


class HarnessError(AssertionError):
    """The test, not the rule, is incomplete: an operation nobody scripted, ``ctx.redis``
    touched, no handler for the topic. An ``AssertionError``, so pytest reports a failure."""


@dataclass(frozen=True)
class Raw:
    """A scripted answer as Redis would give it (text, or ``None``): a typed operation
    decodes it as the runtime does, so the test covers the decoding too."""

    text: str | None


@dataclass
class Asked:
    """One operation the handler asked, in order: what a test asserts on."""

    name: str  # the effect's name, e.g. ``pool_reserve``
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...]
    typed: bool  # an ``Op`` (answered with its typed value) rather than a raw effect
    answer: Any = None  # what the handler was given back

    def matches(self, op: Op[Any] | EffectCall) -> bool:
        """Whether this is ``op`` (same effect, keys and args): ``Op`` holds a decoder, so
        two equal operations do not compare equal themselves."""
        return (self.name, self.keys, self.args) == (op.effect.name, tuple(op.keys), tuple(op.args))


@dataclass(frozen=True)
class Logged:
    level: str
    event: str
    fields: dict[str, Any]


class _Log:
    """A structlog-like logger that keeps what it is told, so a test may assert on it."""

    def __init__(self, into: list[Logged], bound: dict[str, Any] | None = None) -> None:
        self._into, self._bound = into, bound or {}

    def bind(self, **fields: Any) -> _Log:
        return _Log(self._into, {**self._bound, **fields})

    def _log(self, level: str, event: str, fields: dict[str, Any]) -> None:
        self._into.append(Logged(level, event, {**self._bound, **fields}))

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._log("error", event, fields)


class _NoRedis:
    """Stands for ``ctx.redis``: any use fails, naming what to do instead."""

    def __getattr__(self, name: str) -> Any:
        raise HarnessError(
            f"the handler used ctx.redis.{name}: there is no Redis in choreo.testing; a rule "
            "yields typed operations or ctx.effect(...), which a test scripts (integration "
            "tests cover what needs Redis itself)")


class _Script:
    """The test's answers by effect name: a value, a callable of the ``Asked``, or a list
    answered in order."""

    def __init__(self, service: str, handler: str, answers: Mapping[str, Any]) -> None:
        self.service, self.handler, self.answers = service, handler, answers
        self.used: dict[str, int] = {}
        self.asked: list[Asked] = []

    def answer(self, call: EffectCall, decode: Callable[[str | None], Any] | None) -> Any:
        """The answer to send the handler: typed for an ``Op`` (decoded when scripted as
        ``Raw``), text for a raw effect."""
        asked = Asked(call.effect.name, call.keys, call.args, decode is not None)
        self.asked.append(asked)
        if asked.name not in self.answers:
            raise HarnessError(
                f"{self.service}: {self.handler} asked {asked.name}(keys={asked.keys}, "
                f"args={asked.args}) and the test scripted no answer for it: pass "
                f"answers={{{asked.name!r}: ...}}")
        scripted = self.answers[asked.name]
        nth = self.used.get(asked.name, 0)
        self.used[asked.name] = nth + 1
        if isinstance(scripted, list):
            if nth >= len(scripted):
                raise HarnessError(f"{self.service}: {self.handler} asked {asked.name} "
                                   f"{nth + 1} times; the test scripted {len(scripted)} answers")
            scripted = scripted[nth]
        if callable(scripted):
            scripted = scripted(asked)
        if isinstance(scripted, Raw):
            answer = decode(scripted.text) if decode is not None and not dropped_by(scripted.text) else scripted.text
        else:
            answer = scripted
        asked.answer = answer
        return answer


@dataclass
class _Context(Context):
    """A ``Context`` whose ``once`` is answered from the script instead of Redis."""

    script: _Script | None = None

    def once(self, effect: OnceEffect, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> str | None:
        assert self.script is not None
        answer = self.script.answer(self.effect(effect, keys, args), None)
        if why := dropped_by(answer):
            raise AttemptDropped(self.delivery_id, why)
        return cast("str | None", answer)



@dataclass
class Outcome:
    """What one run of a handler did. ``emitted`` is what the runner would publish: the
    events emitted and returned, or nothing when the handler failed or an effect's answer
    dropped the attempt (``dropped``: its delivery ``released``, its step ``stale``; the
    runner drops that attempt's outputs)."""

    emitted: list[Emitted]
    effects: list[Asked]
    kept_open: bool
    error: Retryable | Rejected | None
    dropped: str
    result: HandlerResult
    logs: list[Logged]
    context: Context
    refused: str = ""  # why the runner dead-letters the event unread (``events.disagrees_with``)

    @property
    def released(self) -> bool:
        return self.dropped == "released"

    @property
    def events(self) -> list[Event]:
        return [e.event for e in self.emitted]

    @property
    def topics(self) -> list[str]:
        return [e.topic for e in self.emitted]

    def asked(self, name: str) -> list[Asked]:
        """The operations of effect ``name``, in order."""
        return [a for a in self.effects if a.name == name]

    def only(self, model: type[E]) -> E:
        """The one event emitted, which must be a ``model``."""
        if len(self.emitted) != 1 or not isinstance(self.emitted[0].event, model):
            raise AssertionError(f"expected one {model.__name__} emitted, got "
                                 f"{[type(e).__name__ for e in self.events]} (error: {self.error!r})")
        return self.emitted[0].event


def run(service: Service, event: Event, *, topic: str | None = None,
        answers: Mapping[str, Any] | None = None, event_id: str | None = None,
        attempt: int = 1, deadline_ms: int = 0, try_no: int = 1, partition: int = 0,
        offset: int = 0, delivery_id: str | None = None) -> Outcome:
    """Run ``service``'s handler of ``topic`` on ``event`` once, answering what it asks from
    ``answers`` (effect name -> answer, see ``_Script``). ``topic`` defaults to the event's
    own, or else to the one topic where the service reads its type.

    The envelope is made up: the delivery id is ``delivery_id`` (default: the event's own;
    another one is what a forged event's envelope says: such an event is ``refused``, as the
    runner dead-letters it unread), the event id ``event_id``
    (default: derived from the delivery and topic, stable across runs), with ``attempt`` and
    ``deadline_ms``; ``try_no`` is the in-process try (an agent's failures depend on it).
    A ``Retryable`` or ``Rejected`` is reported in ``error``, not raised: retrying and
    dead-lettering are the runner's business, the test checks which one the rule asked for.
    Anything else the handler raises is raised (the runner dead-letters its input as
    ``HANDLER_ERROR``), as is an output Avro cannot write (``serde.Unwritable``); an output
    too large for a consumer is the ``OVERSIZED`` refusal the runner makes of it.
    """
    target = topic or _topic_of(service, event)
    handler = service.handlers.get(target)
    if handler is None:
        raise HarnessError(f"{service.name} has no handler of {target!r}; it handles {service.topics}")
    if not isinstance(event, handler.model):
        raise HarnessError(f"{service.name} reads {target!r} as {handler.model.__name__}, "
                           f"not {type(event).__name__}")
    delivery_id = delivery_id or getattr(event, "delivery_id", None) or event.key
    envelope = Envelope(event_id=event_id or derived_id(delivery_id, target, "choreo.testing"),
                        correlation_id=delivery_id, attempt=attempt, deadline_ms=deadline_ms,
                        event_type=type(event).__name__, producer="choreo.testing")
    logs: list[Logged] = []
    log = _Log(logs, {"service": service.name, "topic": target})
    script = _Script(service.name, getattr(handler.fn, "__name__", target), answers or {})
    ctx = _Context(service.name, envelope, target, partition, offset, cast(redis.Redis, _NoRedis()),
                   log, try_no=try_no, step=handler.fenced_by, script=script)
    refused = disagrees_with(event, envelope)
    if refused:  # the runner dead-letters it before any handler reads it
        return Outcome(emitted=[], effects=[], kept_open=False, error=None, dropped="", result=None,
                       logs=logs, context=ctx, refused=refused)
    if handler.first_op_in_begin:
        _check_nothing_before_first_op(service, handler.fn, event, envelope, target, log, answers or {})
    # the runner's Attempt reads neither the message nor the step verdict: only the handler,
    # the event and the context
    run_ = Attempt(Work(cast(Message, None), target, handler, envelope, event, log))
    run_.ctx = ctx
    run_.start()
    while run_.request is not None:
        decode, run_.decode = run_.decode, None  # the answer goes back as scripted (typed)
        try:
            answer = script.answer(run_.request, decode)
        except (Retryable, Rejected) as exc:  # the decoding refused it, as in the runner's try
            run_.request, run_.error = None, exc
            break
        run_.resume(answer)
    if isinstance(run_.error, Rejected) and run_.error.reason is DeadLetterReason.HANDLER_ERROR:
        raise run_.error.__cause__ or run_.error  # a bug of the rule: the runner dead-letters its input
    ok = run_.error is None and not run_.dropped
    if ok:
        for out in _as_events(run_.result):
            ctx.emit(out)
        run_.error = _refusal_of_outputs(ctx.emitted)
        ok = run_.error is None
    if ok:
        # the writes a step left to its finish are applied there, after its other effects,
        # only when the handler ended well: asked of the script then (an in-memory record
        # applies them)
        for op in ctx.writes:
            script.answer(ctx.effect(op.effect, op.keys, op.args), op.decode)
    return Outcome(emitted=list(ctx.emitted) if ok else [], effects=script.asked,
                   kept_open=ctx.keep_step_open, error=run_.error, dropped=run_.dropped,
                   result=run_.result, logs=logs, context=ctx)


def _refusal_of_outputs(emitted: list[Emitted]) -> Rejected | None:
    """What the runner makes of the outputs before the step completes: one Avro cannot write
    is a bug of the rule (raised here, dead-lettered there), one too large for a consumer the
    input's refusal."""
    for out in emitted:
        size = FRAME_BYTES + len(avro_body(type(out.event), out.event.to_avro()))
        refusal = oversized(out, size)
        if refusal is not None:
            return refusal
    return None


def _check_nothing_before_first_op(service: Service, fn: Callable[..., Any], event: Event,
                                   envelope: Envelope, topic: str, log: _Log,
                                   answers: Mapping[str, Any]) -> None:
    """A handler declared ``first_op_in_begin`` is started before its input's begin, for copies
    too: before its first operation it may ask nothing and emit nothing."""
    script = _Script(service.name, getattr(fn, "__name__", topic), answers)
    probe = _Context(service.name, envelope, topic, 0, 0, cast(redis.Redis, _NoRedis()), log, script=script)
    started = fn(event, probe)
    try:
        started.send(None)
    except (StopIteration, Retryable, Rejected, AttemptDropped):
        return
    started.close()
    if script.asked or probe.emitted:
        raise HarnessError(f"{service.name}: {script.handler} is declared first_op_in_begin, but before "
                           f"its first operation it asked {[a.name for a in script.asked]} and emitted "
                           f"{[e.topic for e in probe.emitted]}: the runtime does that for every copy too")


def _topic_of(service: Service, event: Event) -> str:
    """The event's own topic, or else the one topic where ``service`` reads its type: some
    events go to a family of topics (an undo request goes to the undo topic of its step)."""
    if event.topic in service.handlers:
        return event.topic
    found = [t for t, h in service.handlers.items() if h.model is type(event) and not t.startswith("retry.")]
    if len(found) != 1:
        raise HarnessError(f"{service.name} reads a {type(event).__name__} on {found or 'no topic'}: "
                           f"name the topic (run(..., topic=...)); it handles {service.topics}")
    return found[0]


# -- a fan-in's decisions, for the join's part handlers (``join_record``'s answer) ---------------

WAIT = Decision("wait")  # not the deciding input: the other parts are not all in, or another decided
LATE = Decision("late")  # the delivery's outcome came from elsewhere (the supervisor) before this result


def complete(join: Join, results: Mapping[str, Event], completed: Sequence[str] | None = None) -> Decision:
    """The join decided success with these results (one per part, each its ``ok`` event);
    ``completed`` names the parts newest first (default: ``results`` in reverse order)."""
    if set(results) != set(join.parts):
        raise HarnessError(f"join {join.step!r} completes with parts {sorted(join.parts)}, "
                           f"not {sorted(results)}")
    for name, result in results.items():
        if not isinstance(result, join.parts[name].ok):
            raise HarnessError(f"part {name!r} completes with a {join.parts[name].ok.__name__}, "
                               f"not a {type(result).__name__}")
    order = tuple(completed) if completed is not None else tuple(reversed(list(results)))
    return Decision("complete", joined=Joined(dict(results), order))


def failed(join: Join, part: str, failure: Event, completed: Sequence[str] = ()) -> Decision:
    """The join decided failure: ``part`` failed with ``failure``, and ``completed`` (newest
    first) are the parts whose work is to be undone."""
    if part not in join.parts:
        raise HarnessError(f"join {join.step!r} has no part {part!r}; its parts: {sorted(join.parts)}")
    expected = join.parts[part].failed or join.parts[part].ok
    if not isinstance(failure, expected):
        raise HarnessError(f"part {part!r} fails with a {expected.__name__}, not a {type(failure).__name__}")
    if not set(completed) <= set(join.parts) - {part}:
        raise HarnessError(f"the parts completed beside the failed {part!r} are among "
                           f"{sorted(set(join.parts) - {part})}, not {list(completed)}")
    return Decision("fail", failed=JoinFailed(part, failure, tuple(completed)))


# -- records in memory -------------------------------------------------------------------------

class Records:
    """Every ``Record`` operation (put, update, set_once) against dicts, so a test can run
    several handlers in a row over one store: ``answers={**records.answers, ...}``. TTLs are
    not kept; values are kept as text, as Redis keeps them."""

    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, str]] = {}

    @property
    def answers(self) -> dict[str, Callable[[Asked], Raw]]:
        return {"record_put": self._put, "record_update": self._update, "record_set_once": self._set_once}

    def _put(self, asked: Asked) -> Raw:
        self.hashes.setdefault(asked.keys[0], {}).update(_fields(asked.args[1:]))
        return Raw("ok")

    def _update(self, asked: Asked) -> Raw:
        record = self.hashes.get(asked.keys[0])
        if record is None:
            return Raw("")
        record.update(_fields(asked.args[1:]))
        return Raw(record.get(str(asked.args[0]), ""))

    def _set_once(self, asked: Asked) -> Raw:
        record = self.hashes.setdefault(asked.keys[0], {})
        record.setdefault(str(asked.args[1]), _text(asked.args[2]))
        return Raw(record[str(asked.args[1])])


def _fields(pairs: Sequence[str | int | float]) -> dict[str, str]:
    return {str(pairs[i]): _text(pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)}


def _text(value: str | int | float) -> str:
    """A value as Redis stores it (redis-py sends floats with ``repr``)."""
    return value if isinstance(value, str) else repr(value)
