"""What ``choreo run`` creates for its service (``topology.ensure_service``): which topics, with
which partition count, and what it says when it may not create them. The broker is faked:
tests/integration/test_run_ensures_topics.py runs it for real."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from choreo import topology
from choreo.topology import DEFAULT_PARTITIONS, TopicsMissing, ensure_service, partitions_for
from consumers.delivery import service as delivery  # the fan-in
from consumers.package import service as package  # a step and an undo: retry topics, outputs
from consumers.workflow import WORKFLOW

FAN_IN = ["package.ready", "package.failed", "drone.scheduled", "drone.failed"]


def test_new_topics_take_the_count_of_the_existing_inputs() -> None:
    assert partitions_for(["t.in"], {"t.in": 3, "delivery.requested": 6}, ["delivery.requested"]) == 3


def test_a_missing_fan_in_input_takes_its_siblings_count() -> None:
    assert partitions_for(FAN_IN, {"package.ready": 4, "package.failed": 4, "drone.scheduled": 4}) == 4


def test_a_missing_input_whose_siblings_disagree_is_refused() -> None:
    with pytest.raises(TopicsMissing, match=r"drone\.failed.*package\.ready=4, package\.failed=2"):
        partitions_for(FAN_IN, {"package.ready": 4, "package.failed": 2, "drone.scheduled": 4})


def test_inputs_with_no_fan_in_need_not_be_co_partitioned() -> None:
    """The supervisor reads the shared recovery topic beside a prefixed workflow's own: its
    new input takes the count most of its inputs have."""
    existing = {"recovery": 6, "t.delivery.failed": 3, "t.delivery.shipped": 3}
    inputs = ["recovery", "t.delivery.failed", "t.delivery.shipped", "t.compensation.operator"]
    assert partitions_for(inputs, existing, co_partitioned=False) == 3
    with pytest.raises(TopicsMissing):
        partitions_for(inputs, existing)


def test_with_every_input_there_siblings_that_disagree_are_left_as_they_are() -> None:
    assert partitions_for(["a", "b"], {"a": 2, "b": 4}) == 2


def test_with_no_input_there_the_workflows_count_then_the_default() -> None:
    existing = {"delivery.requested": 2, "package.ready": 2, "recovery": 6, "elsewhere": 9}
    assert partitions_for(["t.new"], existing, ["delivery.requested", "package.ready", "recovery"]) == 2
    assert partitions_for(["t.new"], {"elsewhere": 9}, ["delivery.requested"]) == DEFAULT_PARTITIONS


def _broker(monkeypatch: pytest.MonkeyPatch, existing: dict[str, int], refuse: int | None = None,
            hidden: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """A broker holding ``existing`` (``hidden`` too, but this principal may not see them);
    returns the log of create calls (refused with ``refuse``)."""
    topics = {t: SimpleNamespace(partitions=dict.fromkeys(range(n))) for t, n in existing.items()}

    def list_topics(timeout: float, topic: str | None = None) -> SimpleNamespace:
        if topic is None:
            return SimpleNamespace(topics=topics)
        code = KafkaError.TOPIC_AUTHORIZATION_FAILED if topic in hidden else KafkaError.UNKNOWN_TOPIC_OR_PART
        return SimpleNamespace(topics={topic: SimpleNamespace(error=KafkaError(code))})

    monkeypatch.setattr(topology, "admin", lambda bootstrap=None: SimpleNamespace(list_topics=list_topics))
    created: list[dict[str, Any]] = []

    def ensure_topics(counts: dict[str, int], config: dict[str, str] | None = None, **_: Any) -> None:
        if refuse is not None:
            raise KafkaException(KafkaError(refuse))
        created.append({"counts": counts, "config": config})

    monkeypatch.setattr(topology, "ensure_topics", ensure_topics)
    return created


def test_only_the_missing_declared_topics_are_created(monkeypatch: pytest.MonkeyPatch) -> None:
    created = _broker(monkeypatch, {"delivery.requested": 3, "package.ready": 3})
    made = ensure_service(package, WORKFLOW)
    assert made == {"retry.package.delivery.requested": 3, "delivery.requested.dlq": 3,
                    "undo.package": 3, "retry.package.undo.package": 3, "undo.package.dlq": 3,
                    "package.failed": 3, "package.cancelled": 3}
    assert created == [{"counts": made, "config": None}]


def test_nothing_is_created_when_everything_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    created = _broker(monkeypatch, dict.fromkeys(topology.derive(WORKFLOW).partitions, 6),
                      refuse=KafkaError.TOPIC_AUTHORIZATION_FAILED)  # a principal with no CREATE
    assert ensure_service(delivery, WORKFLOW) == {} and created == []


def test_a_missing_topic_the_principal_may_not_create_names_it_and_the_admin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    present = dict.fromkeys(topology.derive(WORKFLOW).partitions, 6)
    del present["delivery.shipped"]
    _broker(monkeypatch, present, refuse=KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(TopicsMissing, match=r"topics delivery\.shipped do not exist.*the admin must create"):
        ensure_service(delivery, WORKFLOW)


def test_topics_the_principal_may_not_see_are_left_to_the_brokers_acls(monkeypatch: pytest.MonkeyPatch) -> None:
    # another service's credentials: its topics exist, but neither listing nor creating shows it
    created = _broker(monkeypatch, {}, refuse=KafkaError.TOPIC_AUTHORIZATION_FAILED,
                      hidden=frozenset(topology.derive(WORKFLOW).partitions))
    assert ensure_service(delivery, WORKFLOW) == {} and created == []


def test_a_compacted_topic_keeps_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from choreo.supervisor import service as supervisor

    present = dict.fromkeys(topology.derive(WORKFLOW).partitions, 6)
    del present["compensation.log"]
    created = _broker(monkeypatch, present)
    ensure_service(supervisor, WORKFLOW)
    assert created == [{"counts": {"compensation.log": 6}, "config": topology.COMPACTED}]
