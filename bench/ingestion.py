"""HTTP ingestion throughput beside the same server with nothing to do, in one run.

    .venv/bin/python -m bench.ingestion --requests 5000 --concurrency 8,32,128 --repeats 3 \\
        --out bench/results/ingestion.json

Starts a private stack (as ``bench.pipeline``: its own Kafka, Redis and schema registry on
free ports) with the workflow's topics and contracts, and two servers:

- **ingestion**: ``choreo serve``, the real endpoint: validation, admission, the state
  table, the Avro event, and a 202 only once the broker confirmed the write;
- **bare**: ``bench.bare_ingestion``, the same uvicorn and FastAPI set-up and the same
  validation, answering 202 at once: the baseline.

No pipeline service runs: this is the ingestion tier alone (``bench.pipeline`` measures the
rest). Admission's limits are set out of the way (``INGESTION_MAX_IN_FLIGHT`` 10⁹; the
backlog check off, since with no consumer the backlog only grows) and its in-flight set is
emptied before each run, so each run starts alike; the admission script still runs for
every request.

Per repeat and concurrency, the real endpoint and the baseline (in turns: which goes first
alternates between repeats) are driven by ``bench.http_load`` (closed loop, keep-alive connections) from a process of its own.
Reported: requests/s, latency p50/p99, the server's CPU µs per request (``/proc``) and peak
RSS, the client's CPU, and ``ratio`` = real ÷ baseline requests/s. Nothing accepted may be
lost: the records added to ``delivery.requested`` are counted against the 202s, a 202 with
no record and a record with no 202 apart.

Figures go to the JSON file (its path is printed); the last line printed is the summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import redis

from bench.common import free_port, load_average, run_and_write, run_header, sample_process, spread
from bench.pipeline import Private, add_private_stack_options, log
from choreo.config import REPO_ROOT, settings
from choreo.redis_client import connect

TOPIC = "delivery.requested"
INFLIGHT_KEY = "ingestion:inflight"


def records_in(topic: str) -> int:
    """Records in ``topic`` (high watermarks summed over its partitions)."""
    from confluent_kafka import Consumer, TopicPartition

    from choreo.ops.records import partitions_of

    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers,
                         "group.id": "bench-ingestion-count", "enable.auto.commit": False})
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in partitions_of(consumer, topic))
    finally:
        consumer.close()


def drive(url: str, server_pid: int, requests: int, concurrency: int) -> dict[str, Any]:
    """One closed-loop run of ``bench.http_load`` against ``url``, with the server's CPU."""
    before = sample_process(server_pid)
    run = subprocess.run([sys.executable, "-m", "bench.http_load", "--url", url,
                          "--requests", str(requests), "--concurrency", str(concurrency)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    after = sample_process(server_pid)
    if run.returncode != 0 or before is None or after is None:
        raise RuntimeError(f"load run against {url} (server pid {server_pid}) failed, exit "
                           f"{run.returncode}: {run.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    answered = max(1, figures["answered"])
    figures["server_cpu_us_per_request"] = round((after.cpu_s - before.cpu_s) / answered * 1e6)
    figures["server_peak_rss_mb"] = round(after.hwm_kb / 1024, 1)
    return figures


def one_run(servers: dict[str, tuple[str, int]], requests: int, concurrency: int,
            store: redis.Redis, tag: str, bare_first: bool = False) -> dict[str, Any]:
    """The real endpoint and the baseline at one concurrency, in the order given (alternated
    by the caller: whichever runs second finds the broker still busy with the first)."""
    def ingestion() -> dict[str, Any]:
        store.delete(INFLIGHT_KEY)
        records_before = records_in(TOPIC)
        real = drive(*servers["ingestion"], requests, concurrency)
        real["records_added"] = records_in(TOPIC) - records_before
        accepted = real["statuses"].get("202", 0)
        # apart, so that an extra record (a publish whose caller timed out) never hides a loss
        real["accepted_not_recorded"] = max(0, accepted - real["records_added"])
        real["recorded_not_accepted"] = max(0, real["records_added"] - accepted)
        return real

    if bare_first:
        bare = drive(*servers["bare"], requests, concurrency)
        real = ingestion()
    else:
        real = ingestion()
        bare = drive(*servers["bare"], requests, concurrency)
    ratio = round(real["requests_per_s"] / bare["requests_per_s"], 3) if bare["requests_per_s"] else 0.0
    log(f"{tag}: ingestion {real['requests_per_s']}/s (p99 {real['latency']['p99_ms']} ms, "
        f"{real['server_cpu_us_per_request']} µs CPU/request), bare {bare['requests_per_s']}/s "
        f"({bare['server_cpu_us_per_request']} µs), ratio {ratio}")
    return {"concurrency": concurrency, "bare_first": bare_first, "ingestion": real, "bare": bare,
            "ratio": ratio}


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per concurrency: medians with their range over the repeats."""
    by_concurrency: dict[str, Any] = {}
    for c in sorted({r["concurrency"] for r in runs}):
        at = [r for r in runs if r["concurrency"] == c]
        by_concurrency[str(c)] = {
            "ingestion_requests_per_s": spread(r["ingestion"]["requests_per_s"] for r in at).as_dict(),
            "bare_requests_per_s": spread(r["bare"]["requests_per_s"] for r in at).as_dict(),
            "ratio": spread(r["ratio"] for r in at).as_dict(3),
            "ingestion_p99_ms": spread(r["ingestion"]["latency"]["p99_ms"] for r in at).as_dict(),
            "ingestion_server_cpu_us_per_request":
                spread(r["ingestion"]["server_cpu_us_per_request"] for r in at).as_dict(0),
            "bare_server_cpu_us_per_request":
                spread(r["bare"]["server_cpu_us_per_request"] for r in at).as_dict(0),
        }
    return {
        "by_concurrency": by_concurrency,
        "not_202": sum(r["ingestion"]["answered"] - r["ingestion"]["statuses"].get("202", 0)
                       + r["ingestion"]["errors"] for r in runs),
        "accepted_not_recorded": sum(r["ingestion"]["accepted_not_recorded"] for r in runs),
        "recorded_not_accepted": sum(r["ingestion"]["recorded_not_accepted"] for r in runs),
        "ingestion_peak_rss_mb": max((r["ingestion"]["server_peak_rss_mb"] for r in runs), default=0.0),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from infra.services import http_server_process, ingestion_process

    private = Private.at(args.stack_dir)
    private.activate()
    result: dict[str, Any] = {
        **run_header("bench.ingestion"),
        "config": {"requests": args.requests, "concurrency": args.concurrency,
                   "repeats": args.repeats, "warmup": args.warmup, "partitions": args.partitions},
    }
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in ("ingestion", "bare")}
    processes = {
        "ingestion": ingestion_process(urls["ingestion"], {
            **private.env, "INGESTION_MAX_IN_FLIGHT": str(10**9), "INGESTION_MAX_BACKLOG": "0",
            "INGESTION_MAX_PENDING": str(10**6)}),
        "bare": http_server_process("bare-ingestion", ["bench.bare_ingestion"], urls["bare"]),
    }
    try:
        private.start(args.partitions)
        for process in processes.values():
            process.start(timeout_s=60)
        servers = {name: (urls[name], process.pid() or 0) for name, process in processes.items()}
        store = connect(settings().redis_url)
        log(f"warm-up: {args.warmup} requests to each server")
        one_run(servers, args.warmup, max(args.concurrency), store, "warm-up")
        result["runs"] = [one_run(servers, args.requests, c, store, f"repeat {r}, concurrency {c}",
                                  bare_first=r % 2 == 1)
                          for r in range(args.repeats) for c in args.concurrency]
    finally:
        for process in processes.values():
            process.stop(timeout_s=30)
        private.stop(keep=args.keep_stack)
    result["machine"]["load_average_after"] = load_average()
    result["summary"] = summarise(result["runs"])
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ingestion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", "-n", type=int, default=5000, help="requests per run")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[8, 32, 128], help="connections, comma-separated")
    parser.add_argument("--repeats", "-r", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2000, help="requests to each server first")
    parser.add_argument("--partitions", type=int, default=6)
    add_private_stack_options(parser, "ingestion.json")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.repeats < 1 or not args.concurrency or min(args.concurrency) < 1:
        parser.error("--requests, --repeats and every --concurrency must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_write(run, parse_args(argv))


if __name__ == "__main__":
    main()
