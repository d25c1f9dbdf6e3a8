"""The benchmarks in their short form: the commands the benchmark notes quote run on a fresh
clone and write figures that say what they should. Their full forms (``python -m
bench.pipeline`` and the others, see bench/README.md) are commands, not timed tests: nothing
here asserts a speed, only that every figure was measured and is consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.pipeline import CEILING_SCALE, TUNED_SCALE
from choreo.config import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def run_benchmark(module: str, *args: str, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run a benchmark as the notes quote it; it must exit 0, print its figures' path, then
    its summary as the last line. Returns (summary, figures)."""
    return _figures(subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)],
                                   cwd=REPO_ROOT, capture_output=True, text=True, timeout=600), out)


def _figures(run: subprocess.CompletedProcess[str], out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-2] == str(out)
    return json.loads(run.stdout.splitlines()[-1]), json.loads(out.read_text())


def test_the_benchmark_measures_every_figure_on_its_own_stack(tmp_path: Path) -> None:
    # through the Makefile's target, the command bench/README.md gives, in a short form
    out = tmp_path / "pipeline.json"
    summary, result = _figures(subprocess.run(
        ["make", "-s", "bench", f"BENCH_ARGS=--deliveries 200 --repeats 1 --warmup 200 --rates 100 "
         f"--open-seconds 1 --warm-max-seconds 0 --timeout 90 --out {out}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600), out)
    # one warm-up round (its time is spent), judged by what the broker's compilers took
    warm_up = result["warm_up"]
    assert len(warm_up["rounds"]) == 1 and warm_up["rounds"][0]["compiler_cpu_pct"] >= 0
    assert summary["broker_warm"] is warm_up["warm"] is (warm_up["rounds"][0]["compiler_cpu_pct"] <= 5.0)
    closed = result["runs"][0]["pipeline"]
    assert closed["accepted"] == closed["terminal"] == 200
    assert closed["lost_or_stuck"] == 0 and closed["more_than_one_outcome"] == 0
    # the ceilings run at their scales (a short ceiling measures its own start)
    assert result["config"]["ceiling_scale"] == CEILING_SCALE and result["config"]["tuned_scale"] == TUNED_SCALE
    for name in ("ceiling_transactional", "ceiling_plain"):
        ceiling = result["runs"][0][name]
        assert ceiling["terminal"] == 200 * CEILING_SCALE and ceiling["events_per_s"] > 0
    tuned = result["runs"][0]["ceiling_tuned"]
    assert tuned["mode"] == "transactional, throughput-tuned" and tuned["terminal"] == 200 * TUNED_SCALE
    assert summary["ratio_tuned"] == round(closed["events_per_s"] / tuned["events_per_s"], 3) > 0
    # the broker's CPU, split by thread group: request handling apart from its JIT compiler
    broker_threads = closed["processes"]["kafka"]["cpu_s_by_thread"]
    assert any(group.startswith("data-plane") for group in broker_threads)
    assert closed["cpu"]["jit_cpu_us_per_delivery"] >= 0
    assert 0 < summary["ratio"] == result["summary"]["ratio"]
    assert result["open_loop"]["100"][0]["lost_or_stuck"] == 0
    assert result["half_capacity_per_s"] == round(closed["deliveries_per_s"] / 2, 1)
    assert result["open_loop"]["half"][0]["lost_or_stuck"] == 0
    assert summary["p99_ms_at_half_capacity"] == result["open_loop"]["half"][0]["latency"]["p99_ms"]
    memory = result["memory"]
    assert memory["all_terminal"] and memory["all_recorded"] and memory["all_notified"] and memory["all_released"]
    counted = memory["counted_bytes_per_delivery"]
    # a delivery holds most once the notifier has read its shipment (its dedupe entry and
    # answer too) and before its release, and the release leaves a tombstone
    assert counted["accepted"]["own"] < counted["before_release"]["own"] < counted["at_most"]["own"]
    assert 0 < counted["released"]["own"] < counted["at_most"]["own"] / 4
    # no service's record outlives the release: the package's and the notifier's go with it
    assert memory["records_left_after_release"] == 0
    assert memory["kept_record_bytes_per_completed_delivery"] == memory["kept_record_bytes_per_delivery_at_most"] == 0
    # "flat" is judged on what the keys still hold, not on used_memory alone
    kept = summary["redis_bytes_retained_per_completed"]
    assert summary["targets_met"]["redis_bytes_retained_per_completed"] is (kept <= 150)
    # the services' batched script items per delivery: a delivery takes several per hop
    items = closed["redis_script_items_per_delivery"]
    assert summary["redis_script_items_per_delivery"] == items >= result["hops"]["consumed"]
    assert summary["targets_met"]["redis_script_items_per_delivery"] is (items <= 10)
    # and where they go: each input's begin (with the first operation of a handler that does
    # nothing before it: a join's record, the notification, the record awaiting release, the
    # fleet's reservation), the finishes; the drone comes back in the supervisor's record of
    # the shipment; per script they add up
    by_script = closed["redis_script_items_by_script"]
    riding = {"begin+join_record", "begin+record_set_once", "begin+await_release", "begin+pool_reserve"}
    assert {"begin", "finish_opening"} | riding <= set(by_script)
    assert not {"effect:join_record", "effect:record_set_once", "effect:await_release", "begin+pool_release",
                "effect:pool_release"} & set(by_script)
    assert by_script.get("effect:pool_reserve", 0) < 0.05  # asked apart only by a retried try
    assert sum(by_script[name] for name in {"begin"} | riding) >= result["hops"]["consumed"] - 1
    assert sum(by_script.values()) == pytest.approx(items, abs=0.1 + 0.01 * len(by_script))
    assert set(summary["targets_met"]) == {
        "ratio_tuned", "p50_ms_at_100_offered", "p99_ms_at_100_offered", "p99_ms_at_half_capacity",
        "max_service_peak_rss_mb", "redis_bytes_per_inflight_delivery", "redis_bytes_retained_per_completed",
        "redis_script_items_per_delivery"}


def test_the_benchmark_runs_the_pipeline_on_a_redis_cluster_of_its_own(tmp_path: Path) -> None:
    summary, result = run_benchmark(
        "bench.pipeline", "--redis-cluster", "--deliveries", "100", "--repeats", "1", "--warmup", "100",
        "--rates", "50", "--open-seconds", "1", "--warm-max-rounds", "0", "--timeout", "90",
        out=tmp_path / "cluster.json")
    assert result["config"]["redis"] == "a Redis Cluster of 3 masters and 3 replicas"
    assert result["warm_up"]["rounds"] == [] and summary["broker_warm"] is False  # no warm-up round asked
    closed = result["runs"][0]["pipeline"]
    assert closed["accepted"] == closed["terminal"] == 100
    assert closed["lost_or_stuck"] == 0 and closed["more_than_one_outcome"] == 0
    # every node's CPU is measured apart; the masters ran the scripts
    nodes = [name for name in closed["processes"] if name.startswith("redis-")]
    assert len(nodes) == 6 and "redis" not in closed["processes"]
    assert sum(closed["cpu"]["net_cpu_us_per_delivery"][node] for node in nodes) > 0
    # a batch splits by slot on a cluster: several script calls per delivery (one node: a few per batch)
    commands = closed["redis_commands_per_delivery"]
    assert commands["evalsha"]["calls"] >= 1
    assert summary["redis_script_items_per_delivery"] >= result["hops"]["consumed"]
    memory = result["memory"]
    assert memory["all_terminal"] and memory["all_recorded"] and memory["all_notified"] and memory["all_released"]
    counted = memory["counted_bytes_per_delivery"]
    assert counted["before_release"]["own"] < counted["at_most"]["own"]
    assert 0 < counted["released"]["own"] < counted["at_most"]["own"] / 4


def test_the_ingestion_benchmark_measures_both_servers_and_loses_nothing(tmp_path: Path) -> None:
    summary, result = run_benchmark(
        "bench.ingestion", "--requests", "300", "--concurrency", "4,32", "--repeats", "1",
        "--warmup", "100", out=tmp_path / "ingestion.json")
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


def test_the_transaction_benchmark_times_both_hops_and_writes_every_record(tmp_path: Path) -> None:
    summary, result = run_benchmark(
        "bench.transactions", "--gaps", "0,30", "--transactions", "8", "--repeats", "2",
        "--records", "5", out=tmp_path / "transactions.json")
    assert summary == result["summary"] and summary["records_not_written"] == 0
    assert set(summary["by_gap_ms"]) == {"0", "30"}
    for figures in result["gaps"].values():
        assert len(figures["runs"]) == 2 and figures["refusals_per_transaction"] >= 0
        for run_ in figures["runs"]:
            for kind in ("transactional", "plain"):
                assert run_[kind]["records_written"] == run_[kind]["records_expected"] == (8 + 3) * 5
                assert run_[kind]["records_failed"] == 0
                phases = run_[kind]["phases"]
                assert 0 < phases["commit"]["p50_ms"] <= phases["commit"]["p90_ms"]
                assert phases["hop"]["p50_ms"] >= phases["offsets"]["p50_ms"] > 0
    for gap in summary["by_gap_ms"].values():
        assert gap["ratio"] == round(gap["plain_hop_ms"] / gap["transactional_hop_ms"], 3) > 0


def test_the_rebuild_benchmark_restores_every_delivery_on_both_sides(tmp_path: Path) -> None:
    summary, result = run_benchmark(
        "bench.rebuild", "--deliveries", "200", "--rounds", "1", "--commit", "HEAD", "--pass-records", "50",
        out=tmp_path / "rebuild.json")
    assert summary == result["summary"]
    assert summary["filled"] == summary["deliveries"] == summary["outcomes"] == 200
    for side in ("current", "baseline"):
        (report,) = result["reports"][side]
        assert report["records_read"] == summary["records"] > 200 and report["outcomes"] == 200
        (keys,) = result["keyspace"][side]
        assert keys["by_kind"]["dl"]["keys"] == keys["by_kind"]["seen"]["keys"] == 200
    # both sides are this tree's code here, one in shares of 50 records a pass: two rebuilds
    # of the same records restore the same keyspace (times masked) however they are split,
    # or the comparison could not tell a change's effect
    (current,), (baseline,) = result["reports"]["current"], result["reports"]["baseline"]
    assert current["passes"] > baseline["passes"] and current["most_deliveries_held"] < baseline["most_deliveries_held"]
    assert summary["kinds_that_differ"] == [] and summary["same_keyspace"] is True
    assert summary["records"] == result["plain_read"]["records"] >= result["plain_read"]["messages"] > 200
    assert summary["current_over_baseline"] > 0 and 0 < summary["current_over_plain_read"]
