"""The topology check: the rules that keep a choreography sound, run in the test suite and
by ``choreo ops topology check`` against the live broker and registry.

* every consumed topic has a producer (``choreo.topology.problems``) and a registered schema;
* the inputs of a fan-in step (one step, several trigger topics) are co-partitioned and
  keyed by the delivery id, or the two halves of a pair land on different partitions (and
  instances) and the correlation in Redis is no longer per partition in order;
* no cycle of services without a hop guard: a loop of events is allowed only where every
  service on it dead-letters events past a bounded hop count.

The services' own declarations are the only input (``choreo.topology.derive``); the broker
(real partition counts) and the registry (subjects) are consulted when given.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from choreo.events import Event
from choreo.service import Service, retry_topic
from choreo.topology import Topology, derive, problems
from choreo.workflow import Workflow

HOP_GUARD_CEILING = 1000  # a max_hops at or above this guards nothing in practice


@dataclass(frozen=True)
class Finding:
    rule: str  # producer | schema | co-partitioned | keyed | cycle
    subject: str
    message: str


@dataclass(frozen=True)
class FanIn:
    service: str
    step: str
    topics: tuple[str, ...]
    models: tuple[type[Event], ...]


def fan_ins(workflow: Workflow) -> list[FanIn]:
    """Steps with more than one trigger topic: the joins of the choreography."""
    found = []
    for service in workflow.services:
        for spec in service.steps():
            if len(spec.triggers) > 1:
                found.append(FanIn(service.name, spec.name, spec.triggers,
                                   tuple(service.handlers[t].model for t in spec.triggers)))
    return found


def keyed_by_delivery(model: type[Event]) -> bool:
    """The event's partition key is its delivery id (the base ``Event.key``, not overridden)."""
    return "delivery_id" in model.model_fields and getattr(model, "key") is getattr(Event, "key")


def cycles(workflow: Workflow, topo: Topology) -> list[list[str]]:
    """Strongly connected groups of services (a service feeding itself counts)."""
    names = {s.name for s in workflow.services}
    edges: dict[str, set[str]] = {n: set() for n in names}
    for topic, consumers in topo.consumers.items():
        for producer in topo.producers.get(topic, ()):
            if producer in names:
                edges[producer] |= consumers & names
    return strongly_connected(edges)


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (Tarjan), each sorted: those of more than one
    node, and a node with an edge to itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1 or node in edges.get(node, ()):
                groups.append(sorted(group))

    for name in sorted(edges):
        if name not in index:
            visit(name)
    return groups


def check(workflow: Workflow, *, partitions: dict[str, int] | None = None,
          subjects: Iterable[str] | None = None, topo: Topology | None = None) -> list[Finding]:
    """Everything wrong with the workflow's topology; empty when it is sound.

    ``partitions``: the broker's real partition counts (default: the derived ones);
    ``subjects``: the registry's subjects (default: the schema rule is skipped).
    """
    topo = topo or derive(workflow)
    counts = {**topo.partitions, **(partitions or {})}
    found = [Finding("producer", p.split(" ", 1)[0], p) for p in problems(topo)]
    if subjects is not None:
        registered = set(subjects)
        for topic in sorted(topo.consumers):
            if f"{topic}-value" not in registered:
                found.append(Finding("schema", topic, f"{topic} is consumed but {topic}-value is not in the registry"))
    for join in fan_ins(workflow):
        service = _service(workflow, join.service)
        inputs = [*join.topics, *(retry_topic(service.name, t) for t in join.topics if retry_topic(service.name, t) in counts)]
        sizes = {t: counts.get(t) for t in inputs}
        if len({n for n in sizes.values()}) > 1:
            found.append(Finding("co-partitioned", join.step, f"fan-in step {join.step} of {join.service} joins topics "
                                 f"with different partition counts: {', '.join(f'{t}={n}' for t, n in sizes.items())}"))
        for topic, model in zip(join.topics, join.models):
            if not keyed_by_delivery(model):
                found.append(Finding("keyed", topic, f"fan-in input {topic} ({model.__name__}) is not keyed by delivery_id"))
    guards = {s.name: s.max_hops for s in workflow.services}
    for group in cycles(workflow, topo):
        unguarded = [n for n in group if not 0 <= guards[n] < HOP_GUARD_CEILING]
        if unguarded:
            found.append(Finding("cycle", " → ".join(group), f"services {', '.join(group)} feed each other and "
                                 f"{', '.join(unguarded)} have no hop guard (max_hops < {HOP_GUARD_CEILING})"))
    return found


def _service(workflow: Workflow, name: str) -> Service:
    return next(s for s in workflow.services if s.name == name)
