"""Topics derived from the workflow's declarations: what exists, with which partitions and
configs, and the checks that keep a choreography sound (every consumed topic has a
producer, fan-in inputs are co-partitioned, dead-letter and retry topics exist)."""

from __future__ import annotations

from dataclasses import dataclass, field

from choreo.kafka import ensure_topics
from choreo.runner import RECOVERY_TOPIC, dlq_topic
from choreo.workflow import Workflow

DEFAULT_PARTITIONS = 6
COMPACTED = {"cleanup.policy": "compact"}


@dataclass
class Topology:
    partitions: dict[str, int] = field(default_factory=dict)
    configs: dict[str, dict[str, str]] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)  # topic -> services
    producers: dict[str, set[str]] = field(default_factory=dict)  # topic -> services


def derive(workflow: Workflow, partitions: int = DEFAULT_PARTITIONS) -> Topology:
    topo = Topology()
    for service in workflow.services:
        for topic, handler in service.handlers.items():
            topo.consumers.setdefault(topic, set()).add(service.name)
            topo.partitions[topic] = partitions
            if topic.startswith("retry.") or handler.undoes:  # requeues and undo requests
                topo.producers.setdefault(topic, set()).add("supervisor")
            if not topic.startswith("retry."):
                topo.partitions[dlq_topic(topic)] = partitions
        for model in service.outputs:
            topo.producers.setdefault(model.topic, set()).add(service.name)
            topo.partitions[model.topic] = partitions
    for topic, producer in workflow.extra_producers.items():
        topo.producers.setdefault(topic, set()).add(producer)
        topo.partitions[topic] = partitions
    topo.partitions[RECOVERY_TOPIC] = partitions
    topo.producers.setdefault(RECOVERY_TOPIC, set()).add("*")
    topo.partitions["compensation.log"] = partitions
    topo.configs["compensation.log"] = COMPACTED
    return topo


def problems(topo: Topology) -> list[str]:
    """Everything wrong with a topology, as sentences; empty when it is sound."""
    found = []
    for topic, services in sorted(topo.consumers.items()):
        if topic not in topo.producers:
            found.append(f"{topic} is consumed by {', '.join(sorted(services))} but no one produces it")
    return found


def create(workflow: Workflow, partitions: int = DEFAULT_PARTITIONS) -> Topology:
    topo = derive(workflow, partitions)
    plain = {t: n for t, n in topo.partitions.items() if t not in topo.configs}
    ensure_topics(plain)
    for topic, config in topo.configs.items():
        ensure_topics({topic: topo.partitions[topic]}, config=config)
    return topo
