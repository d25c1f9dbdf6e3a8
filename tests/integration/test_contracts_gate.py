"""The deploy gate: `choreo schemas register/check` against the real registry."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def _cli(*args: str, topic: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO, text=True,
                          capture_output=True, env={**os.environ, "GATE_TOPIC": topic}, timeout=60)


def test_incompatible_change_fails_the_gate_with_a_reason(stack: None, unique: str) -> None:
    topic = f"t.gate.{unique}"
    registered = _cli("schemas", "register", "--workflow", "tests.services.gate:WORKFLOW_V1", topic=topic)
    assert registered.returncode == 0, registered.stderr
    assert f"{topic}-value" in registered.stderr
    same = _cli("schemas", "check", "--workflow", "tests.services.gate:WORKFLOW_V1", topic=topic)
    assert same.returncode == 0, same.stderr
    gate = _cli("schemas", "check", "--workflow", "tests.services.gate:WORKFLOW_V2", topic=topic)
    assert gate.returncode == 1
    assert "incompatible" in gate.stderr and "priority" in gate.stderr
    refused = _cli("schemas", "register", "--workflow", "tests.services.gate:WORKFLOW_V2", topic=topic)
    assert refused.returncode == 1 and "409" in refused.stderr
