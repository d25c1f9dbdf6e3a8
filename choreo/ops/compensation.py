"""The ways out of ``compensation_failed``: an undo done by hand, or asked again.

An undo that fails past its budget leaves its step ``compensation_failed`` with an alert,
and the chain of undos stops there: the steps after it are not asked, and what the step
holds in a pool (a drone) stays held. The operator then decides, and ``decide`` tells the
supervisor by an ``UndoByOperator`` event on the topic the supervisor reads:

* ``DONE_BY_HAND`` (``choreo ops mark-compensated``): the step's work was undone outside
  the pipeline (the package cancelled in the warehouse's own system, say). The supervisor
  marks the step compensated, logs it, gives back the step's pool holds and asks the next
  undo. Being an event, the mark is in Kafka: a ``rebuild-state`` after a Redis loss finds
  the step compensated in the compensation log and leaves its hold freed.
* ``ASK_AGAIN`` (``choreo ops retry-undo``): what made the undo fail is fixed (its service,
  its remote). The supervisor asks the undo again at a new attempt with a full budget; its
  confirmation goes on with the chain as any other.

The supervisor, and only it, changes the state, and only from ``compensation_failed``.
Each decision has an id of its own: the supervisor's script refuses a second one (the step
is no longer ``compensation_failed``), so nobody can block one by publishing its id first.
"""

from __future__ import annotations

import getpass
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from choreo.config import settings
from choreo.publisher import Publisher
from choreo.redis_client import connect
from choreo.runtime_events import UndoByOperator
from choreo.state import StateTable, StepStatus
from choreo.topology import OPERATOR
from choreo.workflow import Workflow

MAX_NOTE_CHARS = 500
MAX_ID_CHARS = 128  # a delivery id, a login: longer is not one


DONE_BY_HAND, ASK_AGAIN = "DONE_BY_HAND", "ASK_AGAIN"


class DecisionRefused(ValueError):
    """Why nothing was published (the step is not ``compensation_failed``, bad input)."""


@dataclass(frozen=True)
class DecisionResult:
    """What the decision did, as far as the state table shows when the command ends."""

    delivery_id: str
    step: str
    action: str
    topic: str
    event_id: str
    acted_on: bool  # the supervisor marked the step compensated, or asked its undo again
    status: str  # the step's when the command ended
    undo_order: dict[str, str]  # each step of the delivery's undo order -> its status


def decisions_topic() -> str:
    """The topic the supervisor reads operators' decisions from (under its topic prefix, as
    the supervisor started with this environment names it)."""
    from choreo.supervisor import topic

    return topic(UndoByOperator.topic)


def _checked(text: str, what: str, most: int) -> str:
    """``text`` when it is short and printable (it goes into an event and a log line)."""
    if len(text) > most or not text.isprintable():
        raise DecisionRefused(f"{what}: at most {most} printable characters")
    return text


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in this environment (a container's user)
        raise DecisionRefused("no login name found: give --by") from None


def decide(workflow: Workflow, delivery_id: str, step: str, action: str, note: str = "",
           decided_by: str = "", wait_s: float = 30.0) -> DecisionResult:
    """Publish the operator's ``action`` on ``step``'s undo, once the state shows the step
    ``compensation_failed``; wait up to ``wait_s`` for the supervisor to act on it (for an
    undo asked again, also for its confirmation)."""
    if action not in (DONE_BY_HAND, ASK_AGAIN):
        raise DecisionRefused(f"no such decision: {action[:40]!r}")
    if not _checked(delivery_id, "the delivery id", MAX_ID_CHARS):
        raise DecisionRefused("the delivery id is empty")
    _checked(note, "the note", MAX_NOTE_CHARS)
    by = _checked(decided_by or _login(), "decided by", MAX_ID_CHARS)
    undoable = sorted(workflow.compensations())
    if step not in undoable:
        raise DecisionRefused(f"{step[:40]!r} has no undo in workflow {workflow.name} (steps with one: "
                              f"{', '.join(undoable)})")
    client = connect(settings().redis_url, socket_timeout=5)
    state = StateTable(client)
    fields = state.fields(delivery_id)
    status, undo = fields.get(f"{step}.status", ""), workflow.compensations()[step][0]
    asked_before = int(fields.get(f"{undo}.attempt") or 0)  # asked again: a higher attempt
    if status != StepStatus.COMPENSATION_FAILED.value:
        raise DecisionRefused(f"step {step} of delivery {delivery_id} is {status or 'not in the state table'}: "
                              f"only a {StepStatus.COMPENSATION_FAILED.value} step's undo is decided by hand")
    topic, event_id = decisions_topic(), str(uuid.uuid4())
    publisher = Publisher(OPERATOR, redis_client=client)
    errors: list[str] = []
    publisher.publish(UndoByOperator(delivery_id=delivery_id, step=step, action=action, note=note, by=by,
                                     decided_at=datetime.now(UTC)), event_id, topic=topic,
                      on_delivery=lambda err, _: errors.append(str(err)) if err else None)
    publisher.flush(30)
    if errors:
        raise RuntimeError(f"Kafka refused the decision: {errors[0][:300]}")
    deadline = time.monotonic() + wait_s
    while True:
        fields = state.fields(delivery_id)
        status = fields.get(f"{step}.status", "")
        acted = status == StepStatus.COMPENSATED.value if action == DONE_BY_HAND else \
            int(fields.get(f"{undo}.attempt") or 0) > asked_before
        # done: compensated, or asked again and failed for good again
        if status == StepStatus.COMPENSATED.value or (acted and status == StepStatus.COMPENSATION_FAILED.value) \
                or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    order = {s: fields.get(f"{s}.status", "") for s in fields.get("undo.order", "").split(",") if s}
    return DecisionResult(delivery_id, step, action, topic, event_id, acted, status, order)
