"""The workflow as data: derived from the services' own declarations, never kept twice.

The one hand-kept list is which services belong to the workflow (as a compose file lists
its services); topics, steps, deadlines and fan-in pairs come from their decorators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from choreo.service import Service, StepSpec, load_service


@dataclass
class Workflow:
    name: str
    service_refs: list[str]
    # topics produced by entry points that are not services (e.g. HTTP ingestion)
    extra_producers: dict[str, str] = field(default_factory=dict)

    @cached_property
    def services(self) -> list[Service]:
        return [load_service(ref) for ref in self.service_refs]

    @cached_property
    def steps(self) -> list[StepSpec]:
        return [spec for s in self.services for spec in s.steps()]

    def steps_triggered_by(self, topic: str) -> list[StepSpec]:
        return [spec for spec in self.steps if topic in spec.triggers]

    def step(self, name: str) -> StepSpec:
        return next(s for s in self.steps if s.name == name)
