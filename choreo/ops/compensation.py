"""Marking an undo done by hand: the way out of ``compensation_failed``.

An undo that fails past its budget leaves its step ``compensation_failed`` with an alert,
and the chain of undos stops there: the steps after it are not asked, and what the step
holds in a pool (a drone) stays held. Once an operator has undone the step's work by hand
(cancelled the package in the warehouse's own system, say), ``mark_compensated`` tells the
supervisor so: it publishes a ``CompensatedByHand`` event to the topic the supervisor
reads. The supervisor, and only it, changes the state: it marks the step compensated (from
``compensation_failed`` alone), logs it, gives back the step's pool holds and asks the next
undo. Being an event, the mark is in Kafka: a ``rebuild-state`` after a Redis loss finds
the step compensated in the compensation log and leaves its hold freed.

Each mark has an id of its own: the supervisor's script refuses a second one (the step is
no longer ``compensation_failed``), so nobody can block a mark by publishing its id first.
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
from choreo.runtime_events import CompensatedByHand
from choreo.state import StateTable, StepStatus
from choreo.topology import OPERATOR
from choreo.workflow import Workflow

MAX_NOTE_CHARS = 500
MAX_ID_CHARS = 128  # a delivery id, a login: longer is not one


class MarkRefused(ValueError):
    """Why nothing was published (the step is not ``compensation_failed``, bad input)."""


@dataclass(frozen=True)
class MarkResult:
    """What the mark did, as far as the state table shows when the command ends."""

    delivery_id: str
    step: str
    topic: str
    event_id: str
    status: str  # the step's: compensated once the supervisor has acted on the mark
    undo_order: dict[str, str]  # each step of the delivery's undo order -> its status


def marks_topic() -> str:
    """The topic the supervisor reads operators' marks from (under its topic prefix, as the
    supervisor started with this environment names it)."""
    from choreo.supervisor import topic

    return topic(CompensatedByHand.topic)


def _checked(text: str, what: str, most: int) -> str:
    """``text`` when it is short and printable (it goes into an event and a log line)."""
    if len(text) > most or not text.isprintable():
        raise MarkRefused(f"{what}: at most {most} printable characters")
    return text


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in this environment (a container's user)
        raise MarkRefused("no login name found: give --by") from None


def mark_compensated(workflow: Workflow, delivery_id: str, step: str, note: str = "",
                     marked_by: str = "", wait_s: float = 30.0) -> MarkResult:
    """Publish the mark of ``step``'s undo as done by hand, once the state shows the step
    ``compensation_failed``; wait up to ``wait_s`` for the supervisor to act on it."""
    if not _checked(delivery_id, "the delivery id", MAX_ID_CHARS):
        raise MarkRefused("the delivery id is empty")
    _checked(note, "the note", MAX_NOTE_CHARS)
    by = _checked(marked_by or _login(), "marked by", MAX_ID_CHARS)
    undoable = sorted(workflow.compensations())
    if step not in undoable:
        raise MarkRefused(f"{step[:40]!r} has no undo in workflow {workflow.name} (steps with one: "
                          f"{', '.join(undoable)})")
    client = connect(settings().redis_url, socket_timeout=5)
    state = StateTable(client)
    status = state.fields(delivery_id).get(f"{step}.status", "")
    if status != StepStatus.COMPENSATION_FAILED.value:
        raise MarkRefused(f"step {step} of delivery {delivery_id} is {status or 'not in the state table'}: "
                          f"only a {StepStatus.COMPENSATION_FAILED.value} step is marked by hand")
    topic, event_id = marks_topic(), str(uuid.uuid4())
    publisher = Publisher(OPERATOR, redis_client=client)
    errors: list[str] = []
    publisher.publish(CompensatedByHand(delivery_id=delivery_id, step=step, note=note, marked_by=by,
                                        marked_at=datetime.now(UTC)), event_id, topic=topic,
                      on_delivery=lambda err, _: errors.append(str(err)) if err else None)
    publisher.flush(30)
    if errors:
        raise RuntimeError(f"Kafka refused the mark: {errors[0][:300]}")
    deadline = time.monotonic() + wait_s
    fields = state.fields(delivery_id)
    while fields.get(f"{step}.status") != StepStatus.COMPENSATED.value and time.monotonic() < deadline:
        time.sleep(0.2)
        fields = state.fields(delivery_id)
    order = {s: fields.get(f"{s}.status", "") for s in fields.get("undo.order", "").split(",") if s}
    return MarkResult(delivery_id, step, topic, event_id, fields.get(f"{step}.status", ""), order)
