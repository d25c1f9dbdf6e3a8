"""The README's first command: the demo runs the whole choreography and ends with its JSON line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.integration


def test_demo_ends_every_delivery_once_and_prints_its_summary(stack: None) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "infra.cli", "demo", "-n", "60", "--timeout", "120"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
        env={**os.environ, "INGESTION_URL": f"http://127.0.0.1:{port}"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["requested"] == summary["accepted"] == 60
    assert summary["shipped"] + summary["failed"] == 60
    assert summary["lost"] == 0 and summary["doubled"] == 0
    assert summary["compensated"] == summary["failed"]
    assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    assert "timeline of delivery" in result.stderr
