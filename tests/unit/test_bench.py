"""The benchmark's pure logic: percentiles, spread, the ceiling chain's hop count (checked
against the services' own declarations), /proc parsing, metric deltas and profiles."""

from __future__ import annotations

import pytest

from bench.ceiling import FanIn, Record, next_offsets
from bench.common import (
    HAPPY_PATH, SOURCE_TOPIC, TERMINAL_TOPIC, Stage, batch_figures, hop_count, latency_summary,
    metric_by_label, parse_metrics, parse_stat_cpu, parse_status_kb, percentile, spread, summarise_repeats,
    thread_cpu, thread_group,
)
from bench.http_load import BadResponse, parse_head, request_bytes
from bench.ingestion import summarise as summarise_ingestion
from bench.jfr import collapse
from bench.pipeline import evaluate, most_held_per_delivery, retained_per_completed, script_items
from bench.profile import frame_name, summarise
from bench.transactions import parse_args as parse_transaction_args, phase_figures
from tests.factories import KafkaMessage


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # order of input does not matter
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_latency_summary() -> None:
    summary = latency_summary([10.0] * 98 + [100.0, 1000.0])
    assert summary["count"] == 100
    assert summary["p50_ms"] == 10.0
    assert summary["max_ms"] == 1000.0
    assert summary["p99_ms"] == pytest.approx(109.0)  # 100 + 0.01 * (1000 - 100)
    assert latency_summary([])["count"] == 0


def test_spread_is_median_with_range() -> None:
    s = spread([110.0, 90.0, 100.0])
    assert (s.median, s.low, s.high, s.n) == (100.0, 90.0, 110.0, 3)
    assert s.spread_pct == pytest.approx(20.0)
    assert spread([]).n == 0
    assert spread([0.0, 0.0]).spread_pct == 0.0
    runs = [{"a": 1.0, "b": {"c": 10.0}}, {"a": 3.0, "b": {"c": 30.0}}, {"a": 2.0, "b": {"c": 20.0}}]
    summary = summarise_repeats(runs, ["a", "b.c"])
    assert summary["a"]["median"] == 2.0
    assert summary["b.c"] == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3, "spread_pct": 100.0}


def test_happy_path_hops() -> None:
    hops = hop_count(HAPPY_PATH)
    # delivery.requested, package.ready, drone.scheduled, delivery.shipped: one each
    assert hops.per_topic == {"delivery.requested": 1, "delivery.shipped": 1,
                              "drone.scheduled": 1, "package.ready": 1}
    assert hops.produced == 4
    # requested x2 (package, drone), ready + scheduled (delivery), shipped x2 (notifier,
    # supervisor)
    assert hops.consumed == 6


def test_fan_out_and_fan_in_counting() -> None:
    stages = [Stage("a", {"s": "x"}), Stage("b", {"s": "y"}), Stage("c", {"s": "z"}),
              Stage("join", {"x": "out", "y": "out", "z": "out"}, fan_in=True),
              Stage("copy", {"x": "out2", "y": "out2"})]
    hops = hop_count(stages, source="s")
    assert hops.per_topic["out"] == 1  # a fan-in emits once
    assert hops.per_topic["out2"] == 2  # a plain stage emits per input
    assert hops.produced == 1 + 3 + 1 + 2
    assert hops.consumed == 3 + 3 + 2
    with pytest.raises(ValueError):
        hop_count([Stage("loop", {"s": "t"}), Stage("back", {"t": "s"})], source="s")


def test_happy_path_matches_the_services_declarations() -> None:
    from consumers.workflow import WORKFLOW

    services = {s.name: s for s in WORKFLOW.services}
    for stage in HAPPY_PATH:
        service = services[stage.name]
        for topic in stage.inputs:
            assert topic in service.handlers, f"{stage.name} does not consume {topic}"
        declared = {model.topic for model in service.outputs}
        for out in stage.outputs:
            assert out in declared, f"{stage.name} does not declare {out}"
    # every service consuming a happy-path topic is in the chain (the supervisor too: it
    # records each delivery.shipped for choreo.release)
    hops = hop_count(HAPPY_PATH)
    for name, service in services.items():
        on_path = [t for t in service.handlers if t in hops.per_topic]
        stage = next((s for s in HAPPY_PATH if s.name == name), None)
        assert sorted(on_path) == sorted(stage.inputs if stage else []), name
    assert SOURCE_TOPIC in hops.per_topic and TERMINAL_TOPIC in hops.per_topic


def test_ceiling_fan_in_emits_once_per_key() -> None:
    join = FanIn(2)
    assert join.arrive(b"k1") is False
    assert join.arrive(b"k2") is False
    assert join.arrive(b"k1") is True
    assert join.seen == {b"k2": 1}


def test_record_round_trip_and_size() -> None:
    record = Record(b"\x00abc", [("event_id", b"12345"), ("hops", "2"), ("x", None)])
    back = Record.from_json(record.to_json())
    assert back.value == record.value
    assert back.size == 4 + len("event_id") + 5 + len("hops") + 1 + 1
    assert dict(back.headers)["hops"] == b"2"


def test_proc_parsing() -> None:
    stat = "1234 (python3 -m x) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 4 0 100 200 300"
    assert parse_stat_cpu(stat, clk_tck=100) == pytest.approx(3.0)
    status = "Name:\tpython3\nVmHWM:\t  153600 kB\nVmRSS:\t  102400 kB\n"
    assert parse_status_kb(status, "VmHWM") == 153600
    assert parse_status_kb(status, "VmRSS") == 102400
    assert parse_status_kb(status, "VmSwap") == 0


METRICS_BEFORE = """
# TYPE choreo_batch_size histogram
choreo_batch_size_count{service="package"} 10.0
choreo_batch_size_sum{service="package"} 1000.0
choreo_transaction_aborts_total{service="package"} 1.0
choreo_batch_phase_seconds_sum{phase="commit",service="package"} 1.0
choreo_batch_phase_seconds_count{phase="commit",service="package"} 10.0
choreo_batch_phase_cpu_seconds_total{phase="finish",service="package"} 0.25
"""
METRICS_AFTER = """
# TYPE choreo_batch_size histogram
choreo_batch_size_count{service="package"} 30.0
choreo_batch_size_sum{service="package"} 5000.0
choreo_batch_size_count{service="delivery"} 7.0
choreo_transaction_aborts_total{service="package"} 1.0
choreo_batch_phase_seconds_sum{phase="commit",service="package"} 1.5
choreo_batch_phase_seconds_count{phase="commit",service="package"} 30.0
choreo_batch_phase_seconds_sum{phase="commit",service="delivery"} 9.0
choreo_batch_phase_seconds_count{phase="commit",service="delivery"} 7.0
choreo_batch_phase_cpu_seconds_total{phase="finish",service="package"} 0.45
choreo_batch_phase_cpu_seconds_total{phase="decode",service="package"} 0.1
choreo_batch_phase_cpu_seconds_total{phase="decode",service="delivery"} 3.0
"""


def test_batch_figures_from_two_scrapes() -> None:
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    figures = batch_figures(before, after, "package", seconds=10.0, deliveries=1000)
    assert figures == {"transactions": 20.0, "events_in_batches": 4000.0, "mean_batch": 200.0,
                       "transactions_per_s": 2.0, "aborts": 0.0,
                       "mean_ms_by_phase": {"commit": 25.0},  # 0.5 s over 20 commits
                       # 0.2 s and 0.1 s of CPU over 1,000 deliveries; the delivery service's not
                       "cpu_us_per_delivery_by_phase": {"decode": 100.0, "finish": 200.0}}
    assert batch_figures(before, after, "package", seconds=10.0, deliveries=0)[
        "cpu_us_per_delivery_by_phase"] == {}


def test_script_items_per_delivery_by_script() -> None:
    """A script's samples under other labels add up; a script new in the second scrape
    counts from zero; another metric with the same label is not taken for it."""
    items = "choreo_redis_script_items_total"
    before = {f'{items}{{script="begin"}}': 100.0, f'{items}{{script="effect:pool_reserve"}}': 30.0}
    after = {f'{items}{{script="begin"}}': 250.0, f'{items}{{script="effect:pool_reserve"}}': 80.0,
             f'{items}{{script="finish_opening"}}': 50.0, f'{items}{{noscript="x",script="begin"}}': 50.0,
             'choreo_batch_size_count{script="begin"}': 9.0}
    assert metric_by_label(after, items, "script") == {
        "begin": 300.0, "effect:pool_reserve": 80.0, "finish_opening": 50.0}
    assert script_items(before, after, 50) == {"begin": 4.0, "effect:pool_reserve": 1.0,
                                               "finish_opening": 1.0}
    assert list(script_items(before, after, 50))[0] == "begin"
    assert script_items(before, after, 0) == {}


def test_next_offsets_commit_after_the_last_of_each_partition() -> None:
    found = next_offsets([KafkaMessage(5, topic="a"), KafkaMessage(7, topic="a"),  # type: ignore[list-item]
                          KafkaMessage(2, topic="a", partition=1)])
    assert sorted((tp.topic, tp.partition, tp.offset) for tp in found) == [("a", 0, 8), ("a", 1, 3)]


def test_profile_summary_own_and_total() -> None:
    raw = "\n".join([
        "main (a/cli.py:1);loop (choreo/runner.py:10);encode (choreo/serde.py:5) 30",
        "main (a/cli.py:1);loop (choreo/runner.py:10);call (redis/client.py:9) 50",
        "main (a/cli.py:1);loop (choreo/runner.py:12) 20",
    ])
    summary = summarise(raw, top=3)
    assert summary["samples"] == 100
    assert summary["own"][0] == {"function": "call (redis/client.py)", "samples": 50, "pct": 50.0}
    assert summary["total"][0]["pct"] == 100.0
    assert frame_name("f (/x/site-packages/redis/client.py:9)") == "f (redis/client.py)"


def test_thread_groups_fold_a_pool_into_one_name() -> None:
    assert thread_group("data-plane-kafk") == "data-plane-kafk"
    assert thread_group("C2 CompilerThre") == "C2 CompilerThre"
    assert thread_group("GC Thread#3") == "GC Thread"
    assert thread_group("kafka-request-handler-12") == "kafka-request-handler"
    assert thread_group("42") == "42"


def test_thread_cpu_reads_this_process() -> None:
    import os

    groups = thread_cpu(os.getpid())
    assert groups and sum(groups.values()) > 0
    assert thread_cpu(2 ** 30) == {}  # no such process: nothing, not an error


def test_jfr_samples_become_collapsed_stacks_rooted_at_their_pool() -> None:
    def frame(cls: str, method: str) -> dict[str, object]:
        return {"method": {"type": {"name": cls}, "name": method}}

    def sample(thread: str, *frames: dict[str, object]) -> dict[str, object]:
        return {"type": "jdk.ExecutionSample",
                "values": {"sampledThread": {"javaName": thread}, "stackTrace": {"frames": list(frames)}}}

    leaf, root = frame("kafka.log.UnifiedLog", "read"), frame("kafka.server.KafkaApis", "handle")
    printed = {"recording": {"events": [
        sample("data-plane-kafka-request-handler-0", leaf, root),
        sample("data-plane-kafka-request-handler-1", leaf, root),
        sample("TxnMarkerSenderThread", frame("x.Y", "z")),
    ]}}
    summary = summarise(collapse(printed))
    assert summary["samples"] == 3
    assert summary["roots"][0] == {"function": "thread data-plane-kafka-request-handler (java)",
                                   "samples": 2, "pct": 66.7}
    assert summary["own"][0]["function"] == "kafka.log.UnifiedLog.read (java)"


# -- the HTTP ingestion benchmark ------------------------------------------------------------


def test_the_load_client_reads_a_response_head() -> None:
    head = (b"HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\n"
            b"Content-Length: 71\r\nlocation: /deliveries/x\r\n\r\n")
    assert parse_head(head) == (202, 71, False)
    closing = b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 9\r\n\r\n"
    assert parse_head(closing) == (413, 9, True)
    assert parse_head(b"HTTP/1.1 204 No Content\r\n\r\n") == (204, 0, False)


@pytest.mark.parametrize("head", [
    b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP at all
    b"HTTP/1.1 abc Odd\r\n\r\n",  # no status code
    b"HTTP/1.1 200 OK\r\ncontent-length: -5\r\n\r\n",  # a length that is no length
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",  # a body it does not read
])
def test_the_load_client_refuses_what_it_cannot_read(head: bytes) -> None:
    with pytest.raises(BadResponse):
        parse_head(head)


def test_the_load_clients_request_is_one_well_formed_post() -> None:
    raw = request_bytes("127.0.0.1:8000", b'{"a": 1}')
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /deliveries HTTP/1.1\r\n")
    assert b"Content-Length: 8" in head and body == b'{"a": 1}'


def _ingestion_run(c: int, real_per_s: float, bare_per_s: float, accepted: int,
                   recorded: int, answered: int) -> dict[str, object]:
    def side(per_s: float, cpu: int) -> dict[str, object]:
        return {"requests_per_s": per_s, "answered": answered, "errors": 0,
                "statuses": {"202": accepted}, "latency": {"p99_ms": 10.0},
                "server_cpu_us_per_request": cpu, "server_peak_rss_mb": 90.0,
                "accepted_not_recorded": max(0, accepted - recorded),
                "recorded_not_accepted": max(0, recorded - accepted)}
    return {"concurrency": c, "ingestion": side(real_per_s, 1000), "bare": side(bare_per_s, 300),
            "ratio": round(real_per_s / bare_per_s, 3)}


def test_ingestion_summary_takes_medians_per_concurrency_and_counts_losses() -> None:
    runs = [_ingestion_run(8, 400, 2000, 100, 100, 100), _ingestion_run(8, 500, 2500, 100, 100, 100),
            _ingestion_run(8, 450, 1500, 100, 100, 100), _ingestion_run(32, 800, 2000, 98, 97, 100)]
    summary = summarise_ingestion(runs)
    at8 = summary["by_concurrency"]["8"]
    assert at8["ingestion_requests_per_s"]["median"] == 450
    assert at8["ratio"] == {"median": 0.2, "min": 0.2, "max": 0.3, "n": 3, "spread_pct": 50.0}
    assert summary["by_concurrency"]["32"]["ratio"]["median"] == 0.4
    assert summary["not_202"] == 2  # two requests of the last run were answered otherwise
    assert summary["accepted_not_recorded"] == 1  # a 202 with no record would be a loss
    assert summary["recorded_not_accepted"] == 0


def test_transaction_phases_take_median_and_p90_per_phase() -> None:
    rows = [{"offsets": float(i), "commit": 2.0 * i} for i in range(1, 11)]
    figures = phase_figures(rows)
    assert figures["offsets"] == {"p50_ms": 5.5, "p90_ms": 9.1}
    assert figures["commit"] == {"p50_ms": 11.0, "p90_ms": 18.2}


@pytest.mark.parametrize("argv", [["--gaps", "-5"], ["--gaps", "ten"], ["--transactions", "0"],
                                  ["--records", "-1"], ["--partitions", "0"]])
def test_the_transaction_benchmark_refuses_nonsense_arguments(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_transaction_args(argv)
    assert exit_.value.code == 2


def test_what_a_finished_delivery_keeps_is_the_larger_of_the_two_measures() -> None:
    # used_memory fell during the probe (client buffers freed), while the keys still hold a
    # tombstone, a record kept past the release, and the business logs grew: those count
    memory = {"bytes_per_completed_delivery": -1003, "business_log_bytes_per_completed_delivery": 245,
              "kept_record_bytes_per_completed_delivery": 88,
              "counted_bytes_per_delivery": {"released": {"own": 136, "shared": -49, "total": 87}}}
    assert retained_per_completed(memory) == 87 + 88 + 245
    kept = evaluate({"redis_bytes_retained_per_completed": retained_per_completed(memory)})
    assert kept["redis_bytes_retained_per_completed"]["met"] is False  # 420 B > the 150 B target
    small = {"bytes_per_completed_delivery": -12, "business_log_bytes_per_completed_delivery": 0,
             "kept_record_bytes_per_completed_delivery": 0,
             "counted_bytes_per_delivery": {"released": {"own": 136, "shared": 0, "total": 136}}}
    assert evaluate({"redis_bytes_retained_per_completed": retained_per_completed(small)}
                    )["redis_bytes_retained_per_completed"]["met"] is True
    assert evaluate({})["redis_bytes_retained_per_completed"]["met"] is None


def test_the_most_a_delivery_holds_counts_the_record_written_before_its_release() -> None:
    # with every reader done and the release held, the delivery's keys and the record it
    # keeps past the release (counted apart) are all there
    memory = {"bytes_per_inflight_delivery_upper_bound": 1500, "kept_record_bytes_per_delivery_at_most": 136,
              "counted_bytes_per_delivery": {"before_release": {"own": 1742, "shared": 243, "total": 1985},
                                             "at_most": {"own": 1851, "shared": 257, "total": 2108}}}
    assert most_held_per_delivery(memory) == 2108 + 136
    noisy = {**memory, "bytes_per_inflight_delivery_upper_bound": 2600}  # used_memory, larger
    assert most_held_per_delivery(noisy) == 2600
