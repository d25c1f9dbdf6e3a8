"""The runtime's own events: what a service reports on the recovery topic, what the
supervisor asks a service to undo, what it writes to the compensation log, and an
operator's word on an undo that failed for good.

They belong to the runtime, not to any one workflow: every service the runner hosts may
report a step, whatever its domain, so their ``.avsc`` contracts live beside this module.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from choreo.events import MAX_ITEMS, Event

HERE = Path(__file__).parent


class StepReport(Event):
    schema_file: ClassVar[Path] = HERE / "StepReport.avsc"
    topic: ClassVar[str] = "recovery"

    delivery_id: str
    step: str
    kind: Literal["FAILED", "DEADLINE_MISSED", "RETRIES_EXHAUSTED"]
    attempt: int
    service: str
    source_topic: str
    source_event_id: str
    error: str = ""
    reported_at: datetime


class CompensationRecord(Event):
    schema_file: ClassVar[Path] = HERE / "CompensationRecord.avsc"
    topic: ClassVar[str] = "compensation.log"

    delivery_id: str
    step: str
    status: Literal["COMPENSATING", "COMPENSATED", "COMPENSATION_FAILED"]
    attempt: int
    reason: str = ""
    recorded_at: datetime
    # on the record that ends a delivery's compensation: what its submitter is told
    # (``choreo.outcomes``) and the steps the compensation covered
    outcome: Literal["", "compensated", "failed"] = ""
    undone: list[str] = Field(default=[], max_length=MAX_ITEMS)


def undo_topic(step: str) -> str:
    """Where the undo of ``step`` is asked (one topic per compensated step: its service alone
    reads it)."""
    return f"undo.{step}"


class UndoRequested(Event):
    """The supervisor's request to undo ``step``'s work; published to ``undo_topic(step)``."""

    schema_file: ClassVar[Path] = HERE / "UndoRequested.avsc"
    topic: ClassVar[str] = "undo"  # a family of topics: see ``undo_topic``

    delivery_id: str
    step: str
    reason: str = ""
    requested_at: datetime


class UndoByOperator(Event):
    """An operator's word on a ``compensation_failed`` step (``choreo ops mark-compensated``,
    ``choreo ops retry-undo``): its work was undone by hand, and the supervisor goes on as if
    its undo had been confirmed, giving back what the step held in a pool; or its undo is
    asked again, as a new attempt with a full budget."""

    schema_file: ClassVar[Path] = HERE / "UndoByOperator.avsc"
    topic: ClassVar[str] = "compensation.operator"

    delivery_id: str
    step: str
    action: Literal["DONE_BY_HAND", "ASK_AGAIN"]
    note: str = ""
    by: str
    decided_at: datetime


class DeliveryOutcome(Event):
    """A delivery's outcome for its submitter, on the reply topic it named (``choreo.outcomes``)."""

    schema_file: ClassVar[Path] = HERE / "DeliveryOutcome.avsc"
    topic: ClassVar[str] = "replies"  # a family of topics: each request names its own

    delivery_id: str
    outcome: str
    reason: str = ""
    compensate: list[str] = Field(default=[], max_length=MAX_ITEMS)
    event_type: str
    event_id: str
    trace_id: str = ""
    decided_at: datetime


# written by the runtime whichever services a workflow lists, so a workflow's contracts
# (``contracts.topic_models(workflow, RUNTIME_EVENTS)``) include them
RUNTIME_EVENTS: tuple[type[Event], ...] = (StepReport, CompensationRecord)
# every contract of the runtime: the undo requests' topics are the compensating services' own
# (and the outcome copies' topics are the submitters')
RUNTIME_CONTRACTS: tuple[type[Event], ...] = (*RUNTIME_EVENTS, UndoRequested, UndoByOperator, DeliveryOutcome)
