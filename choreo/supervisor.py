"""Supervisor: the safety net of the choreography. It coordinates nothing; it watches.

* Every instance records what it reads (recovery reports, the failure outcome, the events
  that confirm undos) into the state table: these writes are conditional and idempotent, so
  any instance of the consumer group may make them and no report is lost while another
  instance leads. A failure marks the steps to undo and asks for the newest completed one's
  undo; each confirmation asks for the next.
* Only the holder of the ``supervisor`` lease scans the deadline index and acts: it extends
  steps whose service is down, requeues failed or stuck steps with exponential back-off,
  fails a delivery whose step spent its retry budget (the failure outcome event, so the
  services undo their work) and raises an alert when an undo itself fails past its budget.

It knows the workflow it supervises (``SUPERVISOR_WORKFLOW``, which ``choreo run`` sets from
``--workflow``; else the workflow that lists it) only by its declarations: which step undoes which and what proves it
(``Service.undo``), the join that decides a delivery and the events that publish its
outcome (``Service.join``). The failure outcome event carries ``delivery_id``, ``reason``,
``detail``, ``failed_step``, ``compensate`` (the steps to undo, newest first) and
``failed_at``: the supervisor reads the steps to undo from it, and publishes one when it
fails a delivery itself. The transitions live in ``choreo.supervision``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis

from choreo.config import settings
from choreo.envelope import Envelope, derived_id, now_ms
from choreo.errors import Rejected
from choreo.events import Event
from choreo.kafka import admin, base_config
from choreo.lease import Lease
from choreo.outcomes import COMPENSATED, undoes
from choreo.redis_client import is_cluster
from choreo.logs import get_logger
from choreo.release import AWAIT_RELEASE, Releaser, awaiting_key
from choreo.runner import RECOVERY_TOPIC
from choreo.serde import DecodeFailure, Decoder, RegistryUnavailable, registry_client
from choreo.service import Context, Effects, Service, Store, retry_topic
from choreo.state import StateTable, Source, StepStatus, deadline_index, delivery_key, index_member
from choreo.supervision import (
    ASK_UNDO_AGAIN, COMPENSATION, COMPENSATION_FAILURES, COMPENSATIONS, FORWARD, LEADER, MARK_COMPENSATED,
    MARK_COMPENSATING, REPORTS, REQUEUES, Action, KeyedCompensationRecord, Policies, Scanner,
    UNIT, SourceReader, StepPolicy, SupervisorSettings, Transitions, Unrecorded, awaiting_operator_index, labels,
    parse_marked, split_list,
)
from choreo.join import FAILED
from choreo.workflow import Workflow, load_workflow
from choreo.runtime_events import CompensationRecord, StepReport, UndoByOperator, UndoRequested, undo_topic

NAME = os.environ.get("SUPERVISOR_NAME", "supervisor")  # consumer group and lease name
PREFIX = os.environ.get("SUPERVISOR_TOPIC_PREFIX", "")  # isolates a test's topics
SETTINGS = SupervisorSettings.from_env()


def topic(name: str) -> str:
    return f"{PREFIX}{name}"


service = Service(NAME)


@dataclass(frozen=True)
class Watched:
    """The workflow this supervisor watches, and what it derives from it once."""

    flow: Workflow
    success: type[Event]  # the event that publishes a delivery's success
    failure: type[Event]  # ... and its failure (see the module doc for its fields)

    @property
    def failed_topic(self) -> str:
        return topic(self.failure.topic)

    @property
    def shipped_topic(self) -> str:  # the terminal after which a delivery's state is released
        return topic(self.success.topic)


_watched: Watched | None = None


def watched() -> Watched:
    """``SUPERVISOR_WORKFLOW``'s workflow (``choreo run`` sets it from ``--workflow``), else
    the first workflow that lists this service; resolved once, when first needed, since the
    workflow lists this very module."""
    global _watched
    if _watched is None:
        ref = os.environ.get("SUPERVISOR_WORKFLOW", "")
        if ref:
            flow = load_workflow(ref)
        elif service.workflows:
            flow = service.workflows[0]
        else:
            raise RuntimeError("no workflow to supervise: list choreo.supervisor:service in one, "
                               "or name it in SUPERVISOR_WORKFLOW (module:attribute)")
        _watched = Watched(flow, *outcome_events(flow))
    return _watched


def outcome_events(flow: Workflow) -> tuple[type[Event], type[Event]]:
    """The events that publish the deciding join's outcome: (success, failure)."""
    join = next((j for j in flow.joins if j.step == flow.decider), None)
    if join is None:
        raise ValueError(f"workflow {flow.name}: the supervisor needs the join that decides a delivery")
    failure = next(model for model, outcome in join.outcomes.items() if outcome == FAILED)
    success = next(model for model, outcome in join.outcomes.items() if outcome != FAILED)
    return success, failure


COMPENSATION_LOG = topic(CompensationRecord.topic)


@dataclass
class _Runtime:
    """Per-process state, built on first use (the workflow may list this very module)."""

    lease: Lease
    scanner: Scanner
    transitions: Transitions
    policies: Policies
    models: dict[tuple[str, str], type[Event]]  # (service, handler topic) -> event type
    reader: SourceReader | None = None
    leading: bool = False
    decoders: dict[tuple[type[Event], str], Decoder[Any]] | None = None
    awaiting_counted_ms: int = 0


_runtime: _Runtime | None = None
AWAITING_PERIOD_MS = 15_000  # how often the steps waiting for an operator are counted


def policies_of(flow: Workflow) -> Policies:
    """Each step's role, budget (its service's ``retry_budget``: the one budget), deadline,
    and for a fan-in step the upstream steps it waits for: all from the services'
    declarations (their compensations, the workflow's join)."""
    undo = flow.compensations()
    fan_in = flow.fan_in()
    undoing = {comp: forward for forward, (comp, _) in undo.items()}
    services = {s.name: s for s in flow.services}
    names = {spec.name for spec in flow.steps}
    steps = {
        spec.name: StepPolicy(
            spec.name, COMPENSATION if spec.name in undoing else FORWARD,
            services[spec.service].retry_budget, int(spec.deadline_s * 1000), spec.service,
            undoing.get(spec.name, ""),
            tuple(up for up in fan_in.get(spec.name, ()) if up in names),
        )
        for spec in flow.steps
    }
    return Policies(steps, compensable=tuple(f for f in undo if f in steps), decider=flow.decider,
                    unread_failure_s=flow.unread_failure_s)


def _rt(ctx: Context) -> _Runtime:
    global _runtime
    if _runtime is None:
        owner = f"{socket.gethostname()}:{os.getpid()}"
        flow = watched().flow
        models = {(s.name, t): h.model for s in flow.services for t, h in s.handlers.items()}
        _runtime = _Runtime(
            lease=Lease(ctx.redis, NAME, owner, int(SETTINGS.lease_ttl_s * 1000)),
            scanner=Scanner(ctx.redis, SETTINGS), transitions=Transitions(ctx.redis),
            policies=policies_of(flow), models=models,
        )
    return _runtime


def _decision(delivery_id: str, what: str) -> Envelope:
    """The envelope of an event the supervisor's scan starts for a delivery (its tick names
    none): it names the delivery, so its readers find it by it."""
    return Envelope.first(derived_id(delivery_id, NAME, what), delivery_id, "SupervisorDecision", NAME)


def _record(ctx: Context, delivery_id: str, step: str, status: str, attempt: int, reason: str,
            told: str = "", undone: Sequence[str] = (), cause: Envelope | None = None, run: str = "") -> None:
    """One compensation log record; its id is stable, so a replayed batch writes the same one.
    The record that ends a delivery's compensation says what its submitter is told (``told``,
    ``choreo.outcomes``: the runner copies it to the reply topic in this transaction); it has
    an id of its own, apart from any record of the same step and status written before, as
    have the records an operator's retry can bring again (``run``: the undo's attempt), its
    request and the undo's failure: a reader that skips a seen id would miss the second.
    A scan's record (its tick names no delivery) has an envelope of its own that names the
    delivery, as every event's does: the compacted log's readers find it by it."""
    if cause is None and not ctx.delivery_id:
        cause = _decision(delivery_id, "record")
    ctx.emit(
        KeyedCompensationRecord(delivery_id=delivery_id, step=step, status=status,
                                attempt=attempt, reason=reason[:500], recorded_at=datetime.now(UTC),
                                outcome=told, undone=list(undone) if told else []),
        topic=COMPENSATION_LOG, event_id=derived_id(delivery_id, step, status, *((told,) if told else ()),
                                                    *(("again", run) if run else ())),
        cause=cause,
    )
    COMPENSATIONS.labels(step, status).inc()


# -- what any instance records ------------------------------------------------------------------

@service.on(RECOVERY_TOPIC, produces=[CompensationRecord])
def on_report(report: StepReport, ctx: Context) -> None:
    """A service could not finish a step: make it due now so the leader's next scan acts. A
    report of no step of the workflow is dead-lettered: the delivery's state has other fields
    (its outcome, the join's parts), which are no step records."""
    if report.step not in {spec.name for spec in watched().flow.steps}:
        raise Rejected(f"a report of no step of the workflow ({len(report.step)} characters)")
    verdict = _rt(ctx).transitions.record_report(report.delivery_id, report.step, report.attempt,
                                                 report.kind, now_ms(), report.error)
    REPORTS.labels(report.kind, verdict).inc()
    if verdict != "unknown":
        ctx.log.info("step.report_recorded", step=report.step, kind=report.kind,
                     reported_attempt=report.attempt, verdict=verdict, by=report.service)


def on_delivery_failed(failure: Any, ctx: Context) -> Effects[None]:
    """Whoever failed the delivery (the delivery service or us), the steps to undo are now
    ``compensating``, the compensation log says so, and the newest completed one is asked
    to undo its work (the others follow, one confirmation at a time). What a failed
    delivery holds in a pool comes back now, unless an undo will give it back: a step that
    failed (or was closed) after taking a member has no undo, and an abandoned one's undo
    may never be asked (``Marked.undone_with_holds``, ``Workflow.pools_not_undone``)."""
    reason = f"{failure.reason}: {failure.detail}"[:500]
    flow = watched().flow
    undone = undoes(failure.compensate, flow)
    # the failed step's deadline entry goes: only a step of the workflow names one (an id
    # with '|' in a step's place would name another delivery's entry)
    failed_step = failure.failed_step if failure.failed_step in {s.name for s in flow.steps} else ""
    raw = ctx.once(MARK_COMPENSATING, keys=[delivery_key(failure.delivery_id), deadline_index(failure.delivery_id)],
                   args=[now_ms(), failure.delivery_id, failed_step, reason,
                         flow.retention_s, ",".join(flow.compensations()), *undone])
    marked = parse_marked(raw)
    if marked.closed:  # left out of a failure written by hand: they must not run now
        ctx.log.warning("compensation.closed_unlisted", steps=list(marked.closed))
    for step in marked.steps:
        _record(ctx, failure.delivery_id, str(step["step"]), "COMPENSATING", int(step["attempt"]), reason)
        ctx.log.info("compensation.requested", step=step["step"], was=step["before"],
                     reason=failure.reason)
    _ask_undo(ctx, failure.delivery_id, marked.next, reason)
    if marked.told and undone:
        # its compensation ended before this failure was read (every undo already confirmed,
        # one already failed, or its state gone): this failure's record tells the submitter
        status = "COMPENSATED" if marked.told == COMPENSATED else "COMPENSATION_FAILED"
        _record(ctx, failure.delivery_id, undone[0], status, 1, reason, marked.told, undone)
        ctx.log.warning("compensation.ended_before_its_request", told=marked.told)
    if marked.outcome not in ("", FAILED):
        return  # a failure event for a delivery that shipped (a redrive, one written by hand)
    for pool in watched().flow.pools_not_undone(marked.undone_with_holds(undone)):
        yield pool.release(failure.delivery_id, "failed")


def _ask_undo(ctx: Context, delivery_id: str, step: str, reason: str, attempt: int | None = None,
              event_id: str = "") -> None:
    """Ask ``step``'s service to undo its work (its id is stable: asked twice, it runs once;
    asked again by an operator, it has an id and an attempt of its own)."""
    if not step:
        return
    ctx.emit(UndoRequested(delivery_id=delivery_id, step=step, reason=reason, requested_at=datetime.now(UTC)),
             topic=topic(undo_topic(step)), event_id=event_id or derived_id(delivery_id, "undo", step),
             attempt=attempt)
    ctx.log.info("compensation.undo_asked", step=step)


def _undone(ctx: Context, delivery_id: str, step: str, only_from: str = "") -> bool:
    """Mark ``step`` compensated (from any status, or from ``only_from`` alone), log it and
    ask the next undo of the chain; whether it was marked."""
    raw = ctx.once(MARK_COMPENSATED, keys=[delivery_key(delivery_id), awaiting_operator_index(delivery_id)],
                   args=[step, now_ms(), only_from, watched().flow.retention_s,
                         index_member(delivery_id, step)]) or ""
    verdict, _, rest = raw.partition(":")
    if verdict != "compensated":
        ctx.log.debug("compensation.not_marked", step=step, why=rest)
        return False
    before, attempt, following, tail = (rest.split(":", 3) + [""] * 3)[:4]
    reason, told, order = tail.rsplit(UNIT, 2) if tail.count(UNIT) >= 2 else (tail, "", "")
    if before not in ("compensating", "compensation_failed"):
        # the undo was read before the delivery.failed that asked for it (another topic, maybe
        # another instance): log the request too, first, so the compacted log ends COMPENSATED
        _record(ctx, delivery_id, step, "COMPENSATING", int(attempt or 1), "undo seen before its request")
    # the record that ends the compensation carries the failure's reason, for its outcome
    _record(ctx, delivery_id, step, "COMPENSATED", int(attempt or 1), reason if told else "", told,
            split_list(order))
    if before == "compensation_failed" and not only_from:  # confirmed after its alert (not an operator's mark)
        ctx.log.warning("compensation.recovered", step=step)  # the alert may be closed
    else:
        ctx.log.info("compensation.done", step=step, was=before)
    _ask_undo(ctx, delivery_id, following, reason)
    return True


def _on_undone(step: str) -> Callable[[Event, Context], None]:
    def on_undone(_: Event, ctx: Context) -> None:
        _undone(ctx, ctx.delivery_id, step)

    return on_undone


def on_undo_by_operator(decision: UndoByOperator, ctx: Context) -> Effects[None]:
    """An operator's word on a ``compensation_failed`` step. Done by hand: the step is
    compensated, the chain of undos goes on, and what the step's service holds for the
    delivery in a pool comes back (its undo, which would have given it back, never ran).
    Asked again: the undo runs again at a new attempt with a full budget. A step in any
    other status is left as it is: its own undo is still under way or done."""
    step, flow = decision.step, watched().flow
    if step not in flow.compensations():  # the state's other fields are no steps
        ctx.log.warning("compensation.operator_ignored", step=step[:80], why="no step with an undo")
        return
    if decision.action == "ASK_AGAIN":
        _undo_again(ctx, step, decision.by)
        return
    if not _undone(ctx, ctx.delivery_id, step, only_from=StepStatus.COMPENSATION_FAILED.value):
        ctx.log.warning("compensation.operator_ignored", step=step, why="not compensation_failed")
        return
    ctx.log.warning("compensation.marked_by_hand", step=step, by=decision.by[:80])
    for pool in flow.pools_of(step):
        yield pool.release(ctx.delivery_id, "by_hand")


def _undo_again(ctx: Context, step: str, by: str) -> None:
    flow, delivery_id = watched().flow, ctx.delivery_id
    undo = flow.compensations()[step][0]
    raw = ctx.once(ASK_UNDO_AGAIN, keys=[delivery_key(delivery_id), deadline_index(delivery_id),
                                         awaiting_operator_index(delivery_id)],
                   args=[step, undo, now_ms(), int(flow.step(undo).deadline_s * 1000),
                         index_member(delivery_id, undo), flow.retention_s]) or ""
    verdict, _, rest = raw.partition(":")
    if verdict != "asked":
        ctx.log.warning("compensation.operator_ignored", step=step, why="not compensation_failed")
        return
    attempt, _, reason = rest.partition(":")
    _record(ctx, delivery_id, step, "COMPENSATING", int(attempt), "undo asked again by an operator",
            run=attempt)
    ctx.log.warning("compensation.undo_asked_again", step=step, by=by[:80], undo_attempt=int(attempt))
    # a request of its own: its service runs it afresh and calls its remote with a new call id
    # (the old one's refusal may be remembered there), at the new attempt the step waits for
    _ask_undo(ctx, delivery_id, step, reason, attempt=int(attempt),
              event_id=derived_id(delivery_id, "undo", step, "again", attempt))


def _watch_compensations(flow: Workflow) -> None:
    """Subscribe to the event that confirms each declared compensation: it marks its forward
    step compensated and writes the compensation log."""
    for forward, (_, confirmed_by) in flow.compensations().items():
        service.subscribe(topic(confirmed_by.topic), confirmed_by, _on_undone(forward),
                          produces=[CompensationRecord])


def on_shipped(shipment: Event, ctx: Context) -> Effects[None]:
    """A shipped delivery is finished: its state goes once every reader of this event has
    committed past it (``choreo.release``), and the members it holds of pools returned on
    success come back now (the drone's flight is over). On one node both are one script, in
    the begin of this event; on a Redis Cluster each pool, in a slot of its own, takes an
    effect of its own."""
    pools = watched().flow.pools_returned_on_success
    together, apart = ([], pools) if is_cluster(ctx.redis) else (pools, [])
    yield ctx.effect(AWAIT_RELEASE, keys=[awaiting_key(ctx.topic, ctx.partition),
                                          *(key for pool in together for key in pool.give_back_keys)],
                     args=[ctx.offset, ctx.delivery_id])
    for pool in apart:
        yield pool.release(ctx.delivery_id, "return")


# -- what only the leader does ----------------------------------------------------------------

@service.every(SETTINGS.scan_period_s)
def scan(ctx: Context) -> None:
    """Renew (or take) the lease, then act on the due steps; a non-leader does nothing."""
    rt = _rt(ctx)
    leading = rt.lease.acquire()
    if leading != rt.leading:
        ctx.log.warning("supervisor.leadership", leading=leading, lease_token=rt.lease.token,
                        lease_holder=rt.lease.owner)
        rt.leading = leading
    LEADER.set(1 if leading else 0)
    now = now_ms()
    if now - rt.awaiting_counted_ms >= AWAITING_PERIOD_MS:  # every instance: it decides nothing
        rt.awaiting_counted_ms = now
        try:
            rt.scanner.awaiting(now, rt.policies.unread_failure_s)
        except redis.RedisError as exc:  # the gauge waits for the next period; supervision goes on
            ctx.log.warning("supervisor.awaiting_not_counted", error=str(exc)[:300])
    if not leading or rt.lease.fence is None:
        return
    result = rt.scanner.scan(rt.lease.fence, rt.lease.shard_key, rt.policies, now)
    if result.stats.fenced:
        rt.lease.lost()
        rt.leading = False
        LEADER.set(0)
        ctx.log.warning("supervisor.fenced", note="lease lost mid-scan; decisions stop here")
    recorded: list[Unrecorded] = []
    for action in result.actions:
        try:
            _carry_out(ctx, rt, action, recorded)
        except (DecodeFailure, ValueError, KeyError) as exc:
            ctx.log.error("supervisor.action_failed", delivery_id=action.delivery_id,
                          step=action.step, action=action.kind, error=str(exc)[:300])
    if recorded:  # those undos are watched until this scan's transaction is known committed
        ctx.after_commit(lambda: rt.transitions.recorded_many(recorded))
    if result.stats.due or result.stats.capped:
        ctx.log.info("supervisor.scan", due=result.stats.due, pages=result.stats.pages,
                     seconds=round(result.stats.seconds, 4), capped=result.stats.capped,
                     actions=labels(result.actions), backlog=rt.scanner.backlog(now))


def _carry_out(ctx: Context, rt: _Runtime, action: Action, recorded: list[Unrecorded]) -> None:
    data: dict[str, Any] = action.data
    log = ctx.log.bind(delivery_id=action.delivery_id, step=action.step)
    if action.kind == "requeue":
        _requeue(ctx, rt, action, log)
    elif action.kind == "fail":
        compensate = split_list(str(data.get("compensate", "")))
        cause = _story(ctx, rt, action.delivery_id) or _decision(action.delivery_id, "fail")
        ctx.emit(
            watched().failure.model_validate({"delivery_id": action.delivery_id, "reason": str(data["reason"]),
                                    "detail": str(data["detail"])[:500], "failed_step": action.step,
                                    "compensate": compensate, "failed_at": datetime.now(UTC)}),
            # the id the deciding service gives its own failure: one failure whoever decides
            topic=watched().failed_topic, event_id=derived_id(action.delivery_id, watched().failure.topic),
            cause=cause,
        )
        log.warning("delivery.failed_by_supervisor", reason=data["reason"], detail=data["detail"],
                    tries=data.get("tries"), compensate=compensate, again=bool(data.get("again")),
                    closed=data.get("closed", ""))
    elif action.kind in ("comp_failed", "comp_failed_again"):
        target = str(data["target"])
        before = str(data.get("before", ""))
        if before not in ("", "compensated", "compensation_failed"):
            attempt = int(data["attempt"])
            if before != "compensating":  # its request is not logged yet: log it first
                _record(ctx, action.delivery_id, target, "COMPENSATING", attempt, "request logged with its failure")
            told = str(data.get("told") or "")
            _record(ctx, action.delivery_id, target, "COMPENSATION_FAILED", attempt,
                    str(data["detail"]), told, split_list(str(data.get("undone", ""))),
                    # the input its undo was given carries the reply topic its outcome goes to
                    _story(ctx, rt, action.delivery_id) if told else None, run=str(attempt))
            recorded.append(Unrecorded(action.delivery_id, target, action.step, attempt))
            if action.kind == "comp_failed_again":
                log.warning("compensation.failure_recorded_again", target=target, undo_attempt=attempt,
                            note="its first record's transaction is not known to have committed")
                return
            COMPENSATION_FAILURES.labels(target).inc()
            log.error("alert.compensation_failed", target=target, tries=data["tries"],
                      detail=data["detail"],
                      action_needed=f"undo by hand, then: choreo ops mark-compensated {action.delivery_id} {target}; "
                                    f"or once fixed: choreo ops retry-undo {action.delivery_id} {target}")
        else:
            log.warning("compensation.step_failed", target=target, target_status=data.get("before"),
                        detail=data["detail"])
    elif action.kind == "extend":
        log.info("step.extended", attempt=data["attempt"], backoff_ms=data["backoff"],
                 tries=data["tries"], failures=data["failures"])
    elif action.kind == "wait":
        log.info("step.waiting", attempt=data["attempt"], on=data["on"], was=data["was"],
                 complete_by=data["complete_by"])
    elif action.kind == "claim":
        log.info("step.claimed", attempt=data["attempt"], backoff_ms=data["backoff"],
                 tries=data["tries"], failures=data["failures"], was=data["was"])
    elif action.kind == "park":
        log.warning("step.unknown", note="no workflow step of this name; looked at again later")


def _requeue(ctx: Context, rt: _Runtime, action: Action, log: Any) -> None:
    """Re-publish the step's input to its retry topic with the claimed token as attempt;
    for a fan-in, also each half it was given and never ran (``Source``), and never a half
    that joined the claimed attempt: that one runs as it already.

    The event keeps its id: a requeue is the same input tried again, so every remembered
    answer (``ctx.once``) and the remote call id stay the same (a fan-in that already decided
    "ship" is told "ship" again, a remote booking is not made twice); the attempt header is
    what makes the older deliveries of it stale.
    """
    listed = str(action.data.get("source", ""))
    if not listed and action.data.get("joined"):
        log.info("step.requeue_not_needed", attempt=action.data["attempt"], why="its input joined the attempt")
        return
    for source in Source.parse_all(listed):
        _requeue_input(ctx, rt, action, source, log)


def _reader(rt: _Runtime) -> SourceReader:
    if rt.reader is None:
        rt.reader = SourceReader(settings().kafka_bootstrap_servers, NAME, base_config())
    return rt.reader


def _story(ctx: Context, rt: _Runtime, delivery_id: str) -> Envelope | None:
    """The envelope a failure we decide continues: that of an input one of the delivery's
    steps was given (its trace, and the reply topic and owner its outcome goes to); None
    when no step has one to read (the failure then starts a story of its own)."""
    state = StateTable(ctx.redis).fields(delivery_id)
    for name in sorted(k for k in state if k.endswith(".source")):
        for source in Source.parse_all(state[name]):
            fetched = _reader(rt).fetch(source.topic, source.partition, source.offset) if source else None
            found = Envelope.from_headers(fetched.headers) if fetched else None
            if found is not None:
                return Envelope(event_id=derived_id(delivery_id, NAME, "fail"), correlation_id=delivery_id,
                                traceparent=found.traceparent, event_type="SupervisorDecision",
                                producer=NAME, reply_to=found.reply_to, owner=found.owner)
    return None


def _requeue_input(ctx: Context, rt: _Runtime, action: Action, source: Source | None, log: Any) -> None:
    data = action.data
    policy = rt.policies.of(action.step)
    model = rt.models.get((policy.service, source.handler_topic)) if source else None
    if source is None or model is None:
        log.error("alert.requeue_impossible", source=data.get("source"), service=policy.service)
        return
    started = time.perf_counter()
    fetched = _reader(rt).fetch(source.topic, source.partition, source.offset)
    fetch_ms = round((time.perf_counter() - started) * 1000, 1)
    original = Envelope.from_headers(fetched.headers) if fetched else None
    if fetched is None or original is None:
        log.error("alert.requeue_source_missing", source=data.get("source"))
        return  # the claimed step expires again; past its budget the delivery fails
    if rt.decoders is None:
        rt.decoders = {}
    decoder = rt.decoders.get((model, source.topic))
    if decoder is None:
        decoder = rt.decoders[(model, source.topic)] = Decoder(model, source.topic, registry_client())
    try:
        event = decoder(fetched.value)
    except RegistryUnavailable as exc:
        log.warning("requeue.registry_unavailable", error=str(exc)[:200])
        return
    # continue the original story: same trace and cause, a new deadline and attempt
    cause = Envelope(event_id=original.causation_id, correlation_id=action.delivery_id,
                     traceparent=original.traceparent, attempt=original.attempt,
                     deadline_ms=int(data["complete_by"]), hops=original.hops,
                     event_type=original.event_type, producer=NAME,
                     reply_to=original.reply_to, owner=original.owner)
    target = retry_topic(policy.service, source.handler_topic)
    ctx.emit(event, topic=target, event_id=original.event_id, cause=cause, attempt=int(data["attempt"]))
    REQUEUES.labels(action.step).inc()
    log.info("step.requeued", attempt=data["attempt"], topic=target, event_id=original.event_id,
             fetch_ms=fetch_ms)


@service.on_start
def start_releasing(client: Store) -> None:
    """The leader releases shipped deliveries' state (``choreo.release``) on a thread of its
    own, so that slow admin requests never hold up the lease renewal and the scans."""
    flow, shipped = watched().flow, watched().shipped_topic
    groups = flow.consumer_groups(shipped)
    log = get_logger(service=NAME, component="release")
    if groups == [NAME]:  # e.g. a topic prefix the workflow's services do not use
        log.warning("release.waits_for_no_reader", topic=shipped)
    releaser = Releaser(client, admin(), shipped, groups, [s.name for s in flow.services],
                        flow.released_keys, settings().dedupe_ttl_s)
    releaser.run_in_background(SETTINGS.scan_period_s, lambda: _runtime is not None and _runtime.leading, log)


def _subscribe() -> None:
    """What this supervisor reads of the workflow it watches: the failure outcome, the success
    (its state is released after it) and every undo's confirmation."""
    supervised = watched()
    service.outputs.add(supervised.failure)
    service.subscribe(supervised.failed_topic, supervised.failure, on_delivery_failed,
                      produces=[CompensationRecord])
    service.subscribe(supervised.shipped_topic, supervised.success, on_shipped, first_op_in_begin=True)
    _watch_compensations(supervised.flow)
    service.subscribe(topic(UndoByOperator.topic), UndoByOperator, on_undo_by_operator,
                      produces=[CompensationRecord])


service.defer(_subscribe)
