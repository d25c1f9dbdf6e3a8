"""How fast ``choreo ops trace`` finds one delivery in a topic of a million events.

Produces N small keyed records (default 1,000,000; 200,000 deliveries x 5 events) with a
fast producer, with one target delivery's events about 70% of the way in, then finds the
target three ways in the same run, each over the same data:

* naive: every partition from the beginning (what a tool without the key's partition does);
* partition: only ``hash(key) % partitions`` from the beginning;
* partition + time: that partition from the request time (``offsets_for_times``), which is
  what ``trace`` does.

Writes the figures to bench/results/trace.json (or --out) and prints the path.

    .venv/bin/python bench/trace.py [--records 1000000] [--partitions 6]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer  # noqa: E402

from choreo.config import settings  # noqa: E402
from choreo.kafka import admin, ensure_topics  # noqa: E402
from choreo.ops.records import read, reader, resolve  # noqa: E402
from choreo.ops.trace import REQUEST_SLACK_MS, scan_delivery  # noqa: E402

EVENTS_PER_DELIVERY = 5


def produce(topic: str, records: int, target: str, pause_s: float) -> tuple[int, float]:
    """Returns (the target's request time in ms, seconds spent producing).

    The first 70% are produced, then a pause longer than the trace's clock slack, then the
    target's request and the rest: as in production, where a topic holds hours of history
    and the delivery being traced is recent."""
    producer = Producer({
        "bootstrap.servers": settings().kafka_bootstrap_servers, "linger.ms": 50,
        "batch.size": 1_000_000, "compression.type": "lz4", "acks": 1,
        "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 1_048_576,
    })
    deliveries = [str(uuid.uuid4()).encode() for _ in range(records // EVENTS_PER_DELIVERY)]
    value = os.urandom(60)
    target_at = int(records * 0.7)
    target_key = target.encode()
    request_ms = 0
    started = time.perf_counter()
    for i in range(records):
        if target_at <= i < target_at + EVENTS_PER_DELIVERY * 1000 and (i - target_at) % 1000 == 0:
            if i == target_at:
                producer.flush(120)
                time.sleep(pause_s)
                request_ms = int(time.time() * 1000)
            key = target_key
        else:
            key = deliveries[i % len(deliveries)]
        while True:
            try:
                producer.produce(topic, value, key, headers=[("correlation_id", key)])
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left:
        raise SystemExit(f"{left} records not delivered")
    return request_ms, time.perf_counter() - started - pause_s


def naive(topic: str, target: str) -> dict[str, Any]:
    consumer = reader()
    key = target.encode()
    try:
        started = time.perf_counter()
        spans = resolve(consumer, topic)
        found = list(read(consumer, spans, accept=lambda m: m.key() == key))
        return {"seconds": time.perf_counter() - started, "records_read": sum(s.size for s in spans),
                "partitions": len(spans), "found": len(found)}
    finally:
        consumer.close()


def indexed(topic: str, partitions: int, target: str, since_ms: int | None) -> dict[str, Any]:
    consumer = reader()
    try:
        found, stats = scan_delivery(consumer, target, {topic: partitions}, since_ms)
        return {"seconds": stats.seconds, "records_read": stats.records_read, "partitions": stats.partitions,
                "found": len(found)}
    finally:
        consumer.close()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    return {**runs[0], "seconds": statistics.median(seconds), "seconds_min": min(seconds),
            "runs": len(runs), "records_per_second": runs[0]["records_read"] / statistics.median(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=REQUEST_SLACK_MS / 1000 + 1,
                        help="seconds between the history and the target's request")
    parser.add_argument("--keep", action="store_true", help="keep the bench topic afterwards")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "trace.json")
    args = parser.parse_args()
    topic = f"bench.trace.{uuid.uuid4().hex[:8]}"
    target = f"bench-target-{uuid.uuid4()}"
    ensure_topics({topic: args.partitions})
    print(f"producing {args.records:,} records to {topic} ...", file=sys.stderr)
    request_ms, produce_s = produce(topic, args.records, target, args.pause)
    since = request_ms - REQUEST_SLACK_MS
    results = {
        "naive_full_scan": summarize([naive(topic, target) for _ in range(max(1, args.runs - 1))]),
        "partition_only": summarize([indexed(topic, args.partitions, target, None) for _ in range(args.runs)]),
        "partition_and_time": summarize([indexed(topic, args.partitions, target, since) for _ in range(args.runs)]),
    }
    for name, r in results.items():
        if r["found"] != EVENTS_PER_DELIVERY:
            raise SystemExit(f"{name} found {r['found']} events, expected {EVENTS_PER_DELIVERY}")
    report = {
        "topic": topic, "records": args.records, "partitions": args.partitions,
        "events_of_target": EVENTS_PER_DELIVERY, "target_position": "70% into the topic",
        "pause_before_request_s": args.pause,
        "produce_seconds": produce_s, "produce_records_per_second": args.records / produce_s,
        "results": results,
        "speedup_vs_naive": {k: results["naive_full_scan"]["seconds"] / v["seconds"]
                             for k, v in results.items() if k != "naive_full_scan"},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if not args.keep:  # a million records are ~100 MB on the broker: drop the topic
        client = admin()  # keep a reference: the futures need the handle alive
        for future in client.delete_topics([topic]).values():
            future.result(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(f"{name:20s} {r['seconds'] * 1000:8.1f} ms  {r['records_read']:>9,} records read "
              f"in {r['partitions']} partitions", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
