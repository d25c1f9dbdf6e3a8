"""The chaos run (infra/chaos.py) in the test suite: the short form by default, the full
100,000-delivery form with ``CHOREO_FULL=1``. Seeded: ``CHOREO_CHAOS_SEED`` replays a run.

It runs as its own process on a private three-node stack (ports 19092-19097, 16379 (the
cluster form: 16400-16405 and their bus ports 26400-26405), 18081; the shared stack is
untouched) and must report zero violations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

FULL = os.environ.get("CHOREO_FULL") == "1"
SEED = int(os.environ.get("CHOREO_CHAOS_SEED", "20261129"))

pytestmark = [pytest.mark.chaos, pytest.mark.integration,
              pytest.mark.timeout(6 * 3600 if FULL else 1200)]


@pytest.mark.parametrize("redis", ["single", "cluster"])
def test_chaos_run_has_no_violations(redis: str) -> None:
    """On one Redis node the run loses Redis and rebuilds it from Kafka; on a Redis Cluster
    it kills one master under traffic (its replica takes over, batches wait for a replica)."""
    argv = [sys.executable, "-m", "infra.chaos", "--seed", str(SEED), "--verbose"]
    if not FULL:
        argv.append("--short")
    if redis == "cluster":
        argv.append("--redis-cluster")
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          timeout=6 * 3600 - 60 if FULL else 1140)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result (exit {done.returncode}); stderr tail:\n{done.stderr[-3000:]}"
    result = json.loads(lines[-1])
    print(lines[-1])
    assert "error" not in result, f"the run failed: {result['error']}\n{done.stderr[-3000:]}"
    assert result["faults"]["service_kills"] > 0 and result["faults"]["broker_kills"] >= 1
    assert result["faults"]["pauses"] >= 1
    assert result["redis"] == redis
    if redis == "cluster":
        assert result["faults"]["redis_master_kills"] == 1 and result["faults"]["redis_losses"] == 0
    else:
        assert result["faults"]["redis_losses"] == 1
    assert result["accepted"] == result["deliveries"], "every request must be accepted"
    assert result["violations"] == {k: 0 for k in result["violations"]}, (
        f"seed {SEED}: {result['violations']} e.g. {result['violation_examples']}")
    assert result["ok"] and done.returncode == 0
