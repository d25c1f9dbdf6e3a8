"""The workflow as data: derived from the services' own declarations, never kept twice.

The one hand-kept list is which services belong to the workflow (as a compose file lists
its services); topics, steps, deadlines and fan-in pairs come from their decorators.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from choreo.events import Event
from choreo.join import Join
from choreo.pool import Pool
from choreo.service import Service, StepSpec, load_service


@dataclass
class Workflow:
    name: str
    service_refs: list[str]
    # topics produced by entry points that are not services (e.g. HTTP ingestion)
    extra_producers: dict[str, str] = field(default_factory=dict)

    @cached_property
    def services(self) -> list[Service]:
        services = [load_service(ref) for ref in self.service_refs]
        for service in services:  # a service that watches its workflow learns which it is
            if all(known is not self for known in service.workflows):
                service.workflows.append(self)
        return services

    @cached_property
    def steps(self) -> list[StepSpec]:
        return [spec for s in self.services for spec in s.steps()]

    def steps_triggered_by(self, topic: str) -> list[StepSpec]:
        return [spec for spec in self.steps if topic in spec.triggers]

    def pending_steps(self, triggers: Iterable[tuple[str, str]],
                      now_ms: int) -> list[tuple[str, str, int, int]]:
        """(delivery, step, complete-by ms, attempt 1) for every step each ``(delivery id,
        topic)`` triggers: what is opened before the triggers are published
        (``StateTable.open_many``)."""
        return [(delivery_id, spec.name, now_ms + int(spec.deadline_s * 1000), 1)
                for delivery_id, topic in triggers for spec in self.steps_triggered_by(topic)]

    def consumer_groups(self, topic: str) -> list[str]:
        """The consumer groups that read ``topic`` (a service's group id is its name)."""
        return sorted({s.name for s in self.services if topic in s.topics})

    def released_keys(self, delivery_id: str) -> list[str]:
        """The per-delivery keys services declared to go with a finished delivery's state."""
        return [key(delivery_id) for s in self.services for key in s.per_delivery_keys]

    @cached_property
    def pools_returned_on_success(self) -> list[Pool]:
        """The pools whose members a delivery holds until the supervisor reads its success."""
        return [pool for s in self.services for pool in s.pools if pool.returned_on_success]

    def pools_not_undone(self, undone: Iterable[str]) -> list[Pool]:
        """The pools of the services none of whose steps ``undone`` names: what a failed
        delivery holds there (taken by a step that then failed, or by an attempt the
        supervisor gave away) no undo gives back, so the supervisor does."""
        steps = set(undone)
        owners = {spec.service for spec in self.steps if spec.name in steps}
        return [pool for s in self.services if s.name not in owners for pool in s.pools]

    def pools_of(self, step: str) -> list[Pool]:
        """The pools of ``step``'s service: what its work may hold, given back by the
        supervisor when an operator marks its undo done by hand (and left free by a rebuild
        after such a mark)."""
        owners = {spec.service for spec in self.steps if spec.name == step}
        return [pool for s in self.services if s.name in owners for pool in s.pools]

    def step(self, name: str) -> StepSpec:
        return next(s for s in self.steps if s.name == name)

    @property
    def joins(self) -> list[Join]:
        return [join for s in self.services for join in s.joins]

    @property
    def terminal_topics(self) -> tuple[str, ...]:
        """The topics whose event ends a delivery: those that publish the join's decision."""
        return tuple(model.topic for join in self.joins for model in join.outcomes)

    @cached_property
    def outcome_labels(self) -> dict[type[Event], str]:
        """The events that decide a delivery -> the outcome each means (the join's label:
        shipped, failed), whoever publishes them (the join, or the supervisor failing it) and
        on whichever topic. A failure that leaves work to undo is told later, as
        ``compensated`` or ``failed`` (``choreo.outcomes.told``). Kept once: the runner asks
        it of every event it produces."""
        return {model: label for join in self.joins for model, label in join.outcomes.items()}

    @cached_property
    def undoable(self) -> frozenset[str]:
        """The forward steps that have a compensation (``compensations``), kept once."""
        return frozenset(self.compensations())

    @property
    def decider(self) -> str:
        """The step whose decision is the delivery's outcome: the workflow's join."""
        steps = {join.step for join in self.joins}
        if len(steps) > 1:
            raise ValueError(f"workflow {self.name}: one join decides a delivery, not {sorted(steps)}")
        return next(iter(steps), "")

    @property
    def retention_s(self) -> int:
        """How long a decided delivery's state stays (its deciding join's), 0: no expiry."""
        return next((join.retention_s for join in self.joins if join.step == self.decider), 0)

    @property
    def unread_failure_s(self) -> int:
        """How long a failed delivery's state waits for the supervisor to read the failure
        (its deciding join's), 0: no expiry."""
        return next((join.unread_failure_s for join in self.joins if join.step == self.decider), 0)

    def fan_in(self) -> dict[str, tuple[str, ...]]:
        """Each join's step and the upstream steps it waits for (its parts are named after them)."""
        return {join.step: tuple(join.parts) for join in self.joins}

    def compensations(self) -> dict[str, tuple[str, type[Event]]]:
        """Forward step -> (the step that undoes it, the event that confirms it is undone)."""
        return {spec.undoes: (spec.name, spec.confirmed_by) for spec in self.steps
                if spec.undoes and spec.confirmed_by is not None}


def load_workflow(ref: str) -> Workflow:
    """``module:attribute`` (``WORKFLOW`` when left out) → the Workflow it names (the twin of
    ``load_service``)."""
    module, _, attr = ref.partition(":")
    flow = getattr(importlib.import_module(module), attr or "WORKFLOW", None)
    if not isinstance(flow, Workflow):
        raise TypeError(f"{ref} is not a Workflow")
    return flow
