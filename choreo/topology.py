"""Topics derived from the workflow's declarations: what exists, with which partitions and
configs, and the checks that keep a choreography sound (every consumed topic has a
producer, fan-in inputs are co-partitioned, dead-letter and retry topics exist)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from choreo.config import settings
from choreo.kafka import admin, ensure_topics
from choreo.runner import RECOVERY_TOPIC, dlq_topic
from choreo.runtime_events import UndoByOperator
from choreo.service import Service
from choreo.workflow import Workflow

DEFAULT_PARTITIONS = 6
COMPACTED = {"cleanup.policy": "compact"}
TOPIC_CONFIGS = {"compensation.log": COMPACTED}  # the supervisor's log is keyed by delivery|step
OPERATOR = "ops"  # the producer of what operators' tools write (``choreo ops``), beside the flow
# what the broker answers a principal with no CREATE (the secured stack's services)
_NOT_ALLOWED = (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.CLUSTER_AUTHORIZATION_FAILED)


class TopicsMissing(RuntimeError):
    """Topics a service declares do not exist and cannot be created: its principal may not
    create topics, or no partition count would co-partition them with their siblings."""


@dataclass
class Topology:
    partitions: dict[str, int] = field(default_factory=dict)
    configs: dict[str, dict[str, str]] = field(default_factory=dict)
    consumers: dict[str, set[str]] = field(default_factory=dict)  # topic -> services
    producers: dict[str, set[str]] = field(default_factory=dict)  # topic -> services


def derive(workflow: Workflow, partitions: int = DEFAULT_PARTITIONS) -> Topology:
    topo = Topology()
    for service in workflow.services:
        _declare(topo, service, partitions)
    for topic, producer in workflow.extra_producers.items():
        topo.producers.setdefault(topic, set()).add(producer)
        topo.partitions[topic] = partitions
    topo.partitions[RECOVERY_TOPIC] = partitions
    topo.producers.setdefault(RECOVERY_TOPIC, set()).add("*")
    topo.partitions["compensation.log"] = partitions
    topo.configs.update(TOPIC_CONFIGS)
    return topo


def _declare(topo: Topology, service: Service, partitions: int) -> None:
    """Add what one service declares: its inputs (retry topics included), the dead-letter
    topic of each input (retry topics share their origin's), its outputs."""
    for topic, handler in service.handlers.items():
        topo.consumers.setdefault(topic, set()).add(service.name)
        topo.partitions[topic] = partitions
        if topic.startswith("retry.") or handler.undoes:  # requeues and undo requests
            topo.producers.setdefault(topic, set()).add("supervisor")
        if handler.model is UndoByOperator:  # an operator's (``choreo ops mark-compensated``, ``retry-undo``)
            topo.producers.setdefault(topic, set()).add(OPERATOR)
        if not topic.startswith("retry."):
            topo.partitions[dlq_topic(topic)] = partitions
    for model in service.outputs:
        topo.producers.setdefault(model.topic, set()).add(service.name)
        topo.partitions[model.topic] = partitions


def problems(topo: Topology) -> list[str]:
    """Everything wrong with a topology, as sentences; empty when it is sound."""
    found = []
    for topic, services in sorted(topo.consumers.items()):
        if topic not in topo.producers:
            found.append(f"{topic} is consumed by {', '.join(sorted(services))} but no one produces it")
    return found


def create(workflow: Workflow, partitions: int = DEFAULT_PARTITIONS) -> Topology:
    topo = derive(workflow, partitions)
    _create(topo.partitions)
    return topo


def _create(counts: Mapping[str, int], bootstrap: str | None = None) -> None:
    """Create the topics of ``counts`` that do not exist yet, each with its config."""
    plain = {t: n for t, n in counts.items() if t not in TOPIC_CONFIGS}
    if plain:
        ensure_topics(plain, bootstrap=bootstrap)
    for topic in counts.keys() & TOPIC_CONFIGS.keys():
        ensure_topics({topic: counts[topic]}, config=TOPIC_CONFIGS[topic], bootstrap=bootstrap)


def partitions_for(inputs: Sequence[str], existing: Mapping[str, int],
                   workflow_topics: Iterable[str] = (), co_partitioned: bool = True) -> int:
    """How many partitions a service's new topics get: its existing inputs' count (the inputs
    of a fan-in must be co-partitioned, so a missing input can only take its siblings'), else
    the count most of the workflow's existing topics have, else ``DEFAULT_PARTITIONS``.

    Raises ``TopicsMissing`` when an input is missing and its existing siblings disagree:
    no count would co-partition it with all of them. Inputs that need not be co-partitioned
    (a service with no fan-in, such as the supervisor, which also reads the shared recovery
    topic) take the count most of them have."""
    siblings = {t: existing[t] for t in inputs if t in existing}
    if co_partitioned and len(set(siblings.values())) > 1 and len(siblings) < len(inputs):
        missing = ", ".join(t for t in inputs if t not in existing)
        found = ", ".join(f"{t}={n}" for t, n in siblings.items())
        raise TopicsMissing(f"cannot create {missing}: its sibling inputs are not co-partitioned ({found})")
    if siblings:
        return Counter(siblings.values()).most_common(1)[0][0]
    counts = Counter(existing[t] for t in workflow_topics if t in existing)
    return counts.most_common(1)[0][0] if counts else DEFAULT_PARTITIONS


def ensure_service(service: Service, workflow: Workflow | None = None,
                   bootstrap: str | None = None) -> dict[str, int]:
    """Create the topics ``service`` declares that do not exist yet (its inputs, their retry
    and dead-letter topics, its outputs), with the workflow's partition count
    (``partitions_for``), so a new subscriber needs no manual step.

    Existence is checked first, so a principal without CREATE (the secured stack's services)
    runs when everything exists; a missing topic it may not create raises ``TopicsMissing``.
    Returns what it created."""
    client = admin(bootstrap)
    # only the topics this principal may see
    listed = client.list_topics(timeout=settings().kafka_connect_timeout_s).topics
    existing = {name: len(meta.partitions) for name, meta in listed.items()}
    wanted = Topology()
    _declare(wanted, service, partitions_for(service.topics, existing,
                                             derive(workflow).partitions if workflow else (),
                                             co_partitioned=any(len(s.triggers) > 1 for s in service.steps())))
    missing = {t: n for t, n in wanted.partitions.items() if t not in existing}
    if not missing:
        return missing
    try:
        _create(missing, bootstrap)
    except KafkaException as exc:
        if exc.args[0].code() not in _NOT_ALLOWED:
            raise
        absent = sorted(set(missing) - _hidden(client, missing))
        if absent:
            raise TopicsMissing(
                f"service {service.name}: topics {', '.join(absent)} do not exist and its principal "
                "may not create topics: the admin must create them "
                "(infra.security.secured_topics creates the workflow's; see SECURITY.md)") from exc
        # the ACLs hide them, so they may well exist (only the admin can tell): if they are
        # not this principal's, the broker refuses the runner, as it would have without this
        return {}
    return missing


def _hidden(client: AdminClient, topics: Iterable[str]) -> set[str]:
    """The topics this principal may not even describe: the broker answers it the same
    whether they exist or not (another service's, run with the wrong credentials)."""
    hidden = set()
    for topic in topics:
        error = client.list_topics(topic=topic, timeout=30).topics[topic].error
        if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            hidden.add(topic)
    return hidden
