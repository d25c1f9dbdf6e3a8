"""An external registry (Apicurio Registry 3.3.3, started here on loopback, through its
Confluent API): the stack starts none of its own, the demo runs on it, and the deploy gate
refuses an incompatible contract there. The pipeline's own tests run on it in the second
lane of ``make test`` (infra/apicurio_lane.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from infra import apicurio
from tests.helpers import REPO, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry(stack: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Apicurio's Confluent-compatible URL, for this module only."""
    port = free_port()
    process = apicurio.start(port, tmp_path_factory.mktemp("apicurio"))
    try:
        yield apicurio.url(port)
    finally:
        process.stop()


def _choreo(*args: str, registry: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout_s,
                          env={**os.environ, "SCHEMA_REGISTRY_URL": registry,
                               "CHOREO_EXTERNAL": "registry", **env})


def test_stack_start_uses_the_external_registry_and_starts_none(registry: str) -> None:
    started = _choreo("stack", "start", registry=registry)
    assert started.returncode == 0, started.stderr
    assert "port" not in started.stderr and "registry" not in started.stderr.split("started:")[1]
    status = _choreo("stack", "status", "--json", registry=registry)
    parts = {p["name"]: p for p in json.loads(status.stdout)}
    assert "registry" not in parts  # the built-in one is not this stack's part any more
    assert parts["registry (external)"] == {"name": "registry (external)", "running": True,
                                            "pid": None, "log": registry}
    assert status.returncode == 0


def test_an_external_server_that_does_not_answer_is_one_sentence(registry: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"
    run = _choreo("stack", "start", registry=dead, CHOREO_START_TIMEOUT="2")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"external registry at {dead}" in run.stderr.replace("\n", "")
    wrong = _choreo("stack", "start", registry=registry, CHOREO_EXTERNAL="registry,zookeeper")
    assert wrong.returncode == 1 and "zookeeper" in wrong.stderr


def test_the_demo_ends_every_delivery_once_on_the_external_registry(registry: str) -> None:
    demo = _choreo("demo", "-n", "20", "--timeout", "120", registry=registry, timeout_s=400,
                   INGESTION_URL=f"http://127.0.0.1:{free_port()}")
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert summary["accepted"] == summary["shipped"] + summary["failed"] == 20
    assert summary["lost"] == summary["doubled"] == 0
    subjects = httpx.get(f"{registry}/subjects", timeout=10).json()
    assert {"delivery.requested-value", "delivery.shipped-value", "delivery.failed-value"} <= set(subjects)


def test_the_deploy_gate_refuses_an_incompatible_contract_on_apicurio(registry: str, unique: str) -> None:
    topic = f"t.gate.{unique}"

    def gate(*args: str) -> subprocess.CompletedProcess[str]:
        return _choreo("schemas", *args, registry=registry, GATE_TOPIC=topic)

    v1, v2 = ("--workflow", "tests.services.gate:WORKFLOW_V1"), ("--workflow", "tests.services.gate:WORKFLOW_V2")
    registered = gate("register", *v1)
    assert registered.returncode == 0 and f"{topic}-value" in registered.stderr, registered.stderr
    assert gate("check", *v1).returncode == 0
    refused_check = gate("check", *v2)
    assert refused_check.returncode == 1 and "incompatible" in refused_check.stderr
    refused = gate("register", *v2)
    assert refused.returncode == 1 and "409" in refused.stderr

