"""The handler API: a service is a name and a few decorated business rules.

    service = Service("notifier")

    @service.on("delivery.shipped")
    def notify(event: DeliveryShipped, ctx: Context) -> None:
        ...

Decoding, idempotency, exactly-once output, retries, dead letters, tracing, metrics and
shutdown come from the runtime (``choreo.runner``); ``choreo run module:service`` runs it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import redis

from choreo.answers import dropped_by
from choreo.effects import EffectCall, OnceEffect, Op, memo_field
from choreo.envelope import Envelope, derived_id
from choreo.errors import AttemptDropped
from choreo.events import Event
from choreo.join import UNREAD_FAILURE_S, Join, Part
from choreo.pool import Pool
from choreo.record import Record
from choreo.runtime_events import UndoRequested, undo_topic
from choreo.state import check_step_name

HandlerResult = Event | Iterable[Event] | None
Store = redis.Redis  # the client a start hook (``Service.on_start``) is given
R = TypeVar("R", bound=HandlerResult)
# what a handler that yields typed operations (``Op``: a record's, a pool's) or
# ``ctx.effect(...)`` returns: it gets each answer back from ``yield`` and returns its result at
# the end; the runner drives a batch's handlers side by side
Effects = Generator[EffectCall | Op[Any], Any, R]
EffectfulHandler = Effects[HandlerResult]
HandlerOutput = HandlerResult | EffectfulHandler


@dataclass(frozen=True)
class StepSpec:
    """A workflow step: a unit of work with a deadline, watched by the supervisor."""

    name: str
    service: str
    triggers: tuple[str, ...]
    deadline_s: float
    undoes: str = ""  # a compensation step: the forward step whose work it undoes
    confirmed_by: type[Event] | None = None  # ... and the event that says it was undone


def deadline_scale() -> float:
    """``CHOREO_DEADLINE_SCALE`` multiplies every declared deadline: demos and tests shorten
    them to show the supervisor at work without waiting minutes."""
    return float(os.environ.get("CHOREO_DEADLINE_SCALE", "1"))


def retry_topic(service: str, topic: str) -> str:
    """Where the supervisor requeues ``topic``'s events for ``service`` (same schema as ``topic``)."""
    return f"retry.{service}.{topic}"


@dataclass(frozen=True)
class Handler:
    topic: str
    model: type[Event]
    fn: Callable[[Any, Context], HandlerOutput]
    step: str | None
    deadline_s: float
    undoes: str = ""
    confirmed_by: type[Event] | None = None
    # the handler does nothing before it yields its first operation but work it out from its
    # event and context (no call out, no emit): the runner asks that operation in the input's
    # begin and hands the handler its answer (``choreo.runner``)
    first_op_in_begin: bool = False

    @property
    def fenced_by(self) -> str:
        """The step whose current attempt its effects must hold (``choreo.effects``): its own, if
        it is a forward step. An undo's effect is wanted whenever it comes (it gives back what
        its forward step took, and taking nothing twice is harmless), even from an attempt the
        supervisor gave up on: fenced, a slow last attempt would keep the drone."""
        return "" if self.undoes else self.step or ""


@dataclass
class Emitted:
    event: Event
    topic: str
    event_id: str
    cause: Envelope | None = None  # default: the input event being handled
    attempt: int | None = None  # default: the cause's attempt


@dataclass(frozen=True)
class Periodic:
    fn: Callable[[Context], None]
    period_s: float


@dataclass
class Context:
    """What a handler may see and do besides its event: the envelope, Redis, emitting."""

    service: str
    envelope: Envelope
    topic: str
    partition: int
    offset: int
    redis: redis.Redis
    log: Any
    try_no: int = 1  # in-process try of this attempt (1-based)
    step: str = ""  # the step whose attempt its effects must hold (``Handler.fenced_by``), if any
    # replays come within minutes (aborted transactions, supervisor requeues within the step
    # deadlines x retry budget); rebuild-state relies on business-key idempotency, not on these
    once_ttl_s: int = int(os.environ.get("CHOREO_ONCE_TTL_S", "3600"))
    emitted: list[Emitted] = field(default_factory=list)
    keep_step_open: bool = False
    refuse_released: bool = False  # a workflow service: see choreo.effects
    asked: dict[str, int] = field(default_factory=dict)  # effects asked for so far, by kind
    writes: list[Op[Any]] = field(default_factory=list)  # left to the step's finish (choreo.runner)
    periodic: bool = False  # a periodic task's run (``Service.every``), not a handler's
    # see ``after_commit``; made by its first call (a handler's context, made for every
    # event, never needs one)
    committed: list[Callable[[], object]] | None = None

    def defer(self, op: Op[Any]) -> None:
        """Leave ``op``, a write whose answer says nothing, to the step's finish (``choreo.runner``)."""
        self.writes.append(op)

    def after_commit(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` once the transaction that carries this periodic run's outputs has
        committed. Never if it aborts, nor if its commit is reported failed though it went
        through, nor if the process dies in between, nor again if ``fn`` fails (logged): what
        ``fn`` marks must be safe to find unmarked. A decision a tick wrote in Redis may wait
        for its events to be known published; a handler's input is read again after an
        abort, a tick's is not: only a tick needs it."""
        if not self.periodic:
            raise TypeError("after_commit is for a periodic task's run (Service.every)")
        if self.committed is None:
            self.committed = []
        self.committed.append(fn)

    def keep_open(self) -> None:
        """The step is not done with this input (a fan-in still waiting for its other half):
        it stays ``processing`` under its deadline instead of completing."""
        self.keep_step_open = True

    @property
    def event_id(self) -> str:
        return self.envelope.event_id

    @property
    def delivery_id(self) -> str:
        return self.envelope.correlation_id

    @property
    def attempt(self) -> int:
        return self.envelope.attempt

    @property
    def call_id(self) -> str:
        """A stable id for a remote call: the same on replay, so the remote side can dedupe."""
        return derived_id(self.event_id, self.service)

    @property
    def try_label(self) -> str:
        return f"{self.attempt}.{self.try_no}"

    @property
    def trace_id(self) -> str:
        return self.envelope.trace_id

    @property
    def deadline(self) -> datetime | None:
        ms = self.envelope.deadline_ms
        return datetime.fromtimestamp(ms / 1000, UTC) if ms else None

    def emit(self, event: Event, topic: str | None = None, event_id: str | None = None, *,
             cause: Envelope | None = None, attempt: int | None = None) -> None:
        """Publish ``event`` in this batch's transaction.

        Its id is derived from the input's id (a redo gives the same id) unless the rule
        names a business-level id (e.g. one shipment per delivery, whoever decides it).
        ``cause`` continues another event's story and trace (a supervisor requeueing it).
        """
        target = topic or event.topic
        eid = event_id or derived_id(self.event_id, self.service, target, str(len(self.emitted)))
        self.emitted.append(Emitted(event, target, eid, cause, attempt))

    def once(self, effect: OnceEffect, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> str | None:
        """Run ``effect`` at most once for this input event, now; a replay gets the same answer."""
        answer = self.effect(effect, keys, args).run(self.redis)
        if why := dropped_by(answer):
            raise AttemptDropped(self.delivery_id, why)
        return answer

    def effect(self, effect: OnceEffect, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> EffectCall:
        """``effect`` for this input event, to ``yield`` from the handler: the runner runs the
        effects of every event of the batch in one Redis round trip and sends each handler its
        answer (what ``once`` would have returned). A round trip per event was the largest
        cost of every service (bench/README.md).

        The n-th effect of a kind for this event has its own answer: a handler that updates a
        record twice gets each update's answer, and a replay asks in the same order."""
        nth = self.asked.get(effect.name, 0)
        self.asked[effect.name] = nth + 1
        return EffectCall(effect, self.delivery_id, memo_field(self.service, effect, self.event_id, nth),
                          tuple(keys), tuple(args), self.once_ttl_s, self.refuse_released,
                          self.step, self.attempt)


class Service:
    """A named consumer group with its handlers; instances of one service share the group."""

    def __init__(self, name: str, *, max_hops: int = 20, batch_size: int = 500,
                 retry_budget: int = 10, in_process_retries: int = 1) -> None:
        if not name or ":" in name:  # it leads the service's dedupe fields, ``<service>:<event id>:<attempt>``
            raise ValueError(f"a service's name is not empty and has no ':' ({name!r})")
        self.name = name
        self.max_hops = max_hops
        self.batch_size = batch_size
        self.retry_budget = retry_budget
        self.in_process_retries = in_process_retries
        self._handlers: dict[str, Handler] = {}
        self._deferred: list[Callable[[], None]] = []
        self.workflows: list[Any] = []  # the workflows that list this service (``Workflow.services``)
        self.outputs: set[type[Event]] = set()
        self.startup: list[Callable[[redis.Redis], object]] = []
        self.periodic: list[Periodic] = []
        self.records: list[Record] = []
        self.pools: list[Pool] = []
        self.joins: list[Join] = []

    def every(self, period_s: float) -> Callable[[Callable[[Context], None]], Callable[[Context], None]]:
        """Run the decorated function every ``period_s`` between batches; what it emits is
        produced in its own transaction."""

        def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
            self.periodic.append(Periodic(fn, period_s))
            return fn

        return register

    def on_start(self, fn: Callable[[redis.Redis], None]) -> Callable[[redis.Redis], None]:
        """Run ``fn`` once per instance before consuming (e.g. seed reference data idempotently)."""
        self.startup.append(fn)
        return fn

    def record(self, name: str, *, ttl_s: int, released_with_delivery: bool = False) -> Record:
        """Declare a record this service owns, one per delivery (``choreo.record``). With
        ``released_with_delivery`` it is deleted with the runtime's state once the delivery
        is finished (``choreo.release``): kept past that it would only cost memory, since
        every event that could still read it is gone."""
        record = Record(name, ttl_s, released_with_delivery)
        self.records.append(record)
        return record

    def pool(self, pool: Pool) -> Pool:
        """Declare a pool this service reserves from (``choreo.pool``); each instance grows
        it to its seed before consuming."""
        self.pools.append(pool)
        self.startup.append(pool.grow)
        return pool

    def join(self, step: str, *, parts: dict[str, Part], outcomes: dict[type[Event], str],
             deadline_s: float = 60.0, retention_s: int = 3600, unread_failure_s: int = UNREAD_FAILURE_S,
             prefix: str = "") -> Join:
        """A fan-in step (``choreo.join``): waits for one result of each part (named after
        the step that produces it) and sets the delivery's ``outcome`` once decided; the
        events of ``outcomes`` publish it. Its handlers are the returned join's
        ``on_complete`` and ``on_failure``. A decided delivery's state stays ``retention_s``
        (0: no expiry); a failed one's up to ``unread_failure_s`` (never less than the
        retention) until the supervisor reads the failure, then ``retention_s`` from then."""
        join = Join(check_step_name(step), parts, outcomes=outcomes, retention_s=retention_s,
                    unread_failure_s=unread_failure_s, prefix=prefix)
        for topic, model, part, ok in join.topics():
            self.subscribe(topic, model, join.handler(part, ok), step=step, deadline_s=deadline_s,
                           produces=list(outcomes), first_op_in_begin=True)
        self.joins.append(join)
        return join

    @property
    def per_delivery_keys(self) -> list[Callable[[str], str]]:
        """The records that go with a finished delivery's state (``choreo.release``)."""
        return [record.key for record in self.records if record.released_with_delivery]

    def on(self, topic: str, *, step: str | None = None, deadline_s: float = 30.0,
           produces: Sequence[type[Event]] = (), first_op_in_begin: bool = False,
           ) -> Callable[[Callable[..., HandlerOutput]], Callable[..., HandlerOutput]]:
        """Subscribe the decorated function to ``topic``; the event type is its first parameter's annotation.

        ``step`` makes the handler a supervised workflow step with a complete-by deadline;
        it then also consumes the step's retry topic, where the supervisor requeues it.
        ``first_op_in_begin``: the handler does nothing before its first ``yield`` but work
        out that operation from its event and context (no call out, no emit), so the runtime
        may ask it in the same Redis script item as the input's dedupe and step, where it
        would take an item and a round trip of its own.
        """

        def register(fn: Callable[..., HandlerOutput]) -> Callable[..., HandlerOutput]:
            self.subscribe(topic, _event_type(fn), fn, step=step, deadline_s=deadline_s, produces=produces,
                           first_op_in_begin=first_op_in_begin)
            return fn

        return register

    def undo(self, forward: str, *, step: str, confirmed_by: type[Event], deadline_s: float = 30.0,
             prefix: str = "") -> Callable[[Callable[..., HandlerOutput]], Callable[..., HandlerOutput]]:
        """Declare the decorated function as the compensation of step ``forward``: a step of its
        own (``step``), run when the supervisor asks for it (an ``UndoRequested`` on
        ``undo_topic(forward)``), whose ``confirmed_by`` event says the work is undone. The
        supervisor derives from these what to undo, in which order (newest completed first,
        one after another) and when each is done."""

        def register(fn: Callable[..., HandlerOutput]) -> Callable[..., HandlerOutput]:
            self.subscribe(prefix + undo_topic(forward), UndoRequested, fn, step=step, deadline_s=deadline_s,
                           undoes=forward, confirmed_by=confirmed_by)
            return fn

        return register

    def subscribe(self, topic: str, model: type[Event], fn: Callable[[Any, Context], HandlerOutput], *,
                  step: str | None = None, deadline_s: float = 30.0,
                  produces: Sequence[type[Event]] = (), undoes: str = "",
                  confirmed_by: type[Event] | None = None, first_op_in_begin: bool = False) -> None:
        """``on`` with the event type given, for handlers the runtime or a tool builds."""
        if (undoes or confirmed_by) and not (step and undoes and confirmed_by):
            raise ValueError(f"{topic}: a compensation names its step, what it undoes and its confirmation")
        if first_op_in_begin and not inspect.isgeneratorfunction(fn):
            raise ValueError(f"{topic}: first_op_in_begin needs a handler that yields its operations")
        handler = Handler(topic, model, fn, step if step is None else check_step_name(step),
                          deadline_s * deadline_scale(), undoes, confirmed_by, first_op_in_begin)
        self._handlers[topic] = handler
        if step is not None:
            self._handlers[retry_topic(self.name, topic)] = handler
        self.outputs.update(produces)
        if confirmed_by is not None:
            self.outputs.add(confirmed_by)

    @property
    def handlers(self) -> dict[str, Handler]:
        """Topic -> handler; subscriptions deferred with ``defer`` are made first."""
        while self._deferred:
            self._deferred.pop(0)()  # taken off first: a hook may read the handlers itself
        return self._handlers

    def defer(self, subscribe: Callable[[], None]) -> None:
        """Make subscriptions only once the handlers are first read, for a service whose topics
        depend on a workflow that may list the service itself (the supervisor)."""
        self._deferred.append(subscribe)

    @property
    def topics(self) -> list[str]:
        return list(self.handlers)

    def steps(self) -> list[StepSpec]:
        found: dict[str, StepSpec] = {}
        for topic, h in self.handlers.items():
            if h.step is None or topic.startswith("retry."):
                continue
            spec = found.get(h.step)
            triggers = (*spec.triggers, topic) if spec else (topic,)
            found[h.step] = StepSpec(h.step, self.name, triggers, h.deadline_s, h.undoes, h.confirmed_by)
        return list(found.values())


def _event_type(fn: Callable[..., Any]) -> type[Event]:
    """The event type a handler takes: its first parameter's annotation."""
    hints = typing.get_type_hints(fn)
    params = [p for p in fn.__code__.co_varnames[: fn.__code__.co_argcount]]
    model = hints.get(params[0]) if params else None
    if not (isinstance(model, type) and issubclass(model, Event)):
        raise TypeError(f"{fn.__name__}: annotate the first parameter with an Event type")
    return model


def load_service(ref: str) -> Service:
    """``module:attribute`` → the Service it names (what ``choreo run`` takes)."""
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    service = getattr(module, attr or "service")
    if not isinstance(service, Service):
        raise TypeError(f"{ref} is not a choreo Service")
    return service
