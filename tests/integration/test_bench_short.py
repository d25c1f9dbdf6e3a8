"""The pipeline benchmark in its short form: the command the benchmark notes quote runs on a
fresh clone and writes figures that say what they should. Its full form (``python -m
bench.pipeline``, see bench/README.md) is a command, not a timed test: nothing here asserts
a speed, only that every figure was measured and is consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from choreo.config import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_benchmark_measures_every_figure_on_its_own_stack(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.pipeline", "--deliveries", "200", "--repeats", "1", "--warmup", "200",
         "--rates", "100", "--open-seconds", "1", "--timeout", "90", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2] == str(out)
    summary = json.loads(run.stdout.splitlines()[-1])  # the last line is the summary JSON
    result = json.loads(out.read_text())
    closed = result["runs"][0]["pipeline"]
    assert closed["accepted"] == closed["terminal"] == 200
    assert closed["lost_or_stuck"] == 0 and closed["more_than_one_outcome"] == 0
    assert result["runs"][0]["ceiling_transactional"]["events_per_s"] > 0
    # the broker's CPU, split by thread group: request handling apart from its JIT compiler
    broker_threads = closed["processes"]["kafka"]["cpu_s_by_thread"]
    assert any(group.startswith("data-plane") for group in broker_threads)
    assert closed["cpu"]["jit_cpu_us_per_delivery"] >= 0
    assert 0 < summary["ratio"] == result["summary"]["ratio"]
    assert result["open_loop"]["100"][0]["lost_or_stuck"] == 0
    memory = result["memory"]
    assert memory["all_terminal"] and memory["all_recorded"] and memory["all_released"]
    counted = memory["counted_bytes_per_delivery"]
    # a delivery holds most just before its release, and the release leaves a tombstone
    assert counted["accepted"]["own"] < counted["before_release"]["own"]
    assert 0 < counted["released"]["own"] < counted["before_release"]["own"] / 4
    assert set(summary["targets_met"]) == {
        "deliveries_per_s", "ratio", "p99_ms_at_1000_offered", "max_service_peak_rss_mb",
        "redis_bytes_per_inflight_delivery", "redis_flat_after_completion"}


def test_the_ingestion_benchmark_measures_both_servers_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ingestion.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.ingestion", "--requests", "300", "--concurrency", "4,32",
         "--repeats", "1", "--warmup", "100", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2] == str(out)
    summary = json.loads(run.stdout.splitlines()[-1])  # the last line is the summary JSON
    result = json.loads(out.read_text())
    assert summary == result["summary"]
    assert summary["not_202"] == 0 and summary["accepted_not_recorded"] == 0
    assert summary["recorded_not_accepted"] == 0
    assert set(summary["by_concurrency"]) == {"4", "32"}
    for run_ in result["runs"]:
        real, bare = run_["ingestion"], run_["bare"]
        assert real["statuses"] == {"202": 300} and real["records_added"] == 300
        assert bare["statuses"] == {"202": 300} and bare["errors"] == 0
        assert real["server_cpu_us_per_request"] > 0 and bare["server_cpu_us_per_request"] > 0
        assert run_["ratio"] == round(real["requests_per_s"] / bare["requests_per_s"], 3) > 0
