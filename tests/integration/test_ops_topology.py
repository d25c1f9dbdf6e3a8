"""The topology check against the live broker and registry: the real workflow is sound, and
deliberately broken topologies fail (also through the CLI, with exit code 1)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from choreo import topology
from choreo.kafka import ensure_topics
from choreo.ops.cli import app
from consumers.workflow import WORKFLOW
from tests.services.ops_broken import FAN_LEFT, FAN_RIGHT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def topics(stack: None) -> None:
    topology.create(WORKFLOW)
    ensure_topics({FAN_LEFT: 3, FAN_RIGHT: 6})


def _check(workflow: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(app, ["topology", "check", "--workflow", workflow, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_the_real_workflow_is_sound_on_the_live_broker_and_registry(stack: None) -> None:
    # what a deploy does first: create the declared topics and register their contracts
    from choreo import contracts, topology
    from choreo.runtime_events import RUNTIME_EVENTS
    from consumers.workflow import WORKFLOW

    topology.create(WORKFLOW)
    contracts.register(contracts.topic_models(WORKFLOW, RUNTIME_EVENTS))
    code, report = _check("consumers.workflow:WORKFLOW")
    assert (code, report["ok"]) == (0, True), report


def test_a_consumer_of_a_topic_no_one_produces_fails() -> None:
    code, report = _check("tests.services.ops_broken:ORPHAN")
    assert code == 1
    rules = {f["rule"] for f in report["findings"]}  # type: ignore[union-attr]
    assert "producer" in rules and "schema" in rules


def test_a_fan_in_pair_with_different_partition_counts_fails() -> None:
    code, report = _check("tests.services.ops_broken:SPLIT_FAN_IN")
    assert code == 1
    findings = [f for f in report["findings"] if f["rule"] == "co-partitioned"]  # type: ignore[union-attr]
    assert len(findings) == 1 and "=3" in findings[0]["message"] and "=6" in findings[0]["message"]
