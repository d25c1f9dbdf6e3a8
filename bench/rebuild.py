"""How fast ``choreo ops rebuild-state`` restores a lost Redis, beside a plain read of the
same records and beside a given commit's rebuild, on the same records in one run.

    .venv/bin/python -m bench.rebuild --deliveries 20000 --commit HEAD~1 --rounds 2

After a Redis loss the pipeline waits for the rebuild (RELIABILITY.md), so its rate is the
outage's length. The benchmark fills a private stack with ``--deliveries`` deliveries through
the whole pipeline, stops the services, and then, per round: FLUSHALL and the rebuild with
this tree's code, FLUSHALL and the rebuild with ``--commit``'s code (in ABBA order, each in a
process of its own, the commit's from a temporary git worktree). The yardstick is one
plain read of the same topics' records with no decoding: what the machine's Kafka gives one
reader. Every rebuild's restored keyspace is digested (each key's type, contents and expiry,
epoch milliseconds masked), so a faster rebuild that restores anything else shows as a
different digest. The schema registry's leader lease shares the Redis and is taken again
within seconds of a FLUSHALL, whenever its timer fires: it is no rebuild's, so it is left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from confluent_kafka import Consumer, TopicPartition

from bench.common import load_average, rate, run_header, write_figures
from bench.pipeline import Bench, Private, add_private_stack_options, log
from bench.pipeline import parse_args as pipeline_args
from bench.versus import resolve, worktree
from choreo.config import REPO_ROOT, settings
from choreo.ops.rebuild import Rebuilder
from choreo.ops.records import existing_topics, reader, resolve as spans_of
from choreo.redis_client import connect
from consumers.workflow import WORKFLOW
from registry.leader import is_lease_key

_EPOCH_MS = re.compile(rb"\d{12,}")
REBUILD_TIMEOUT_S = 900
# run in the side's own tree and process: its rebuild, as its CLI would run it, as JSON with
# the process's peak RSS (the rebuild holds every delivery's facts until it writes)
REBUILD = """
import dataclasses, json, resource, sys
from choreo.ops.rebuild import rebuild
from consumers.workflow import WORKFLOW
options = {"pass_records": int(sys.argv[2])} if len(sys.argv) > 2 else {}
report = rebuild(WORKFLOW, since_ms=int(sys.argv[1]), force=True, **options)
peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({**dataclasses.asdict(report), "peak_rss_mb": round(peak_mb, 1)}))
"""


def rebuild_in(tree: Path, since_ms: int, pass_records: int | None = None) -> dict[str, Any]:
    """One rebuild by the code of ``tree``, against the activated private stack."""
    args = [str(since_ms)] + ([str(pass_records)] if pass_records else [])
    done = subprocess.run([sys.executable, "-c", REBUILD, *args], cwd=tree,
                          capture_output=True, text=True, check=False, timeout=REBUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"the rebuild in {tree} exited {done.returncode}: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def keyspace(client: redis.Redis) -> dict[str, Any]:
    """What a rebuild restored: every key's type, content and whether it expires, as one
    digest to compare sides by (epoch milliseconds masked: each rebuild writes its own "now"
    into step records, deadlines and its ready mark), and keys and hash fields by kind (the
    key's name up to its first ``:`` or ``{``) to read."""
    keys: Counter[str] = Counter()
    fields: Counter[str] = Counter()
    digest = hashlib.sha256()
    digests: dict[str, Any] = {}  # by kind: which kinds differ when the whole does
    names = sorted(k for k in client.scan_iter(count=5000) if not is_lease_key(k))
    for start in range(0, len(names), 1000):
        chunk = names[start:start + 1000]
        pipe = client.pipeline(transaction=False)
        for key in chunk:
            pipe.type(key)
            pipe.ttl(key)
        meta = pipe.execute()
        types = [t.decode() for t in meta[0::2]]
        pipe = client.pipeline(transaction=False)
        for key, kind in zip(chunk, types):
            {"hash": pipe.hgetall, "zset": lambda k: pipe.zrange(k, 0, -1, withscores=True),
             "set": pipe.smembers, "stream": pipe.xlen}.get(kind, pipe.get)(key)
        for key, kind, ttl, content in zip(chunk, types, meta[1::2], pipe.execute()):
            name = key.decode()
            family = name.split("{", 1)[0].split(":", 1)[0]
            keys[family] += 1
            if kind == "hash":
                fields[family] += len(content)
                content = sorted(content.items())
            elif kind == "zset":
                content = [(member, "T" if score >= 1e12 else score) for member, score in content]
            elif kind == "set":
                content = sorted(content)
            entry = _EPOCH_MS.sub(b"T", repr((name, kind, ttl > 0, content)).encode())
            digest.update(entry)
            digests.setdefault(family, hashlib.sha256()).update(entry)
    return {"digest": digest.hexdigest(),
            "by_kind": {kind: {"keys": keys[kind], "hash_fields": fields[kind], "digest": digests[kind].hexdigest()}
                        for kind in sorted(keys)}}


def _kinds_that_differ(spaces: list[dict[str, Any]]) -> list[str]:
    """The kinds of key (``keyspace``'s ``by_kind``) whose digest is not the same in every
    rebuild: where to look when ``same_keyspace`` is false."""
    kinds = {kind for space in spaces for kind in space["by_kind"]}
    return sorted(kind for kind in kinds
                  if len({space["by_kind"].get(kind, {}).get("digest") for space in spaces}) > 1)


def plain_read(topics: Sequence[str], since_ms: int) -> dict[str, Any]:
    """Every record of ``topics`` since ``since_ms``, read as the rebuild reads them
    (``read_committed``, big fetches) and touched for nothing but its value: the ceiling.
    ``records`` counts offsets, as the rebuild's report does (a transaction's commit marker
    takes one and is never delivered); ``messages`` the records delivered."""
    consumer: Consumer = reader()
    try:
        spans = [s for t in topics for s in spans_of(consumer, t, since_ms=since_ms)]
        ends = {(s.topic, s.partition): s.end for s in spans}
        started = time.perf_counter()
        consumer.assign([TopicPartition(s.topic, s.partition, s.start) for s in spans])
        count, size = 0, 0
        while ends:
            for message in consumer.consume(5000, 0.2):
                if message.error() is not None:
                    continue
                count += 1
                size += len(message.value() or b"")
            for tp in consumer.position([TopicPartition(t, p) for t, p in ends]):
                if tp.offset >= ends[(tp.topic, tp.partition)]:
                    del ends[(tp.topic, tp.partition)]
        seconds = time.perf_counter() - started
        offsets = sum(s.size for s in spans)
        return {"records": offsets, "messages": count, "bytes": size, "seconds": round(seconds, 2),
                "records_per_s": rate(offsets, seconds)}
    finally:
        consumer.close()


def side_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [rate(r["records_read"], r["seconds"]) for r in reports]
    return {"seconds": [round(r["seconds"], 2) for r in reports], "records_per_s": rates,
            "records_per_s_median": statistics.median(rates),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in reports)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    commit = resolve(args.commit)
    private = Private.at(args.stack_dir)
    private.activate()
    bench = Bench(pipeline_args(["--out", args.out, "--timeout", "600"]), private)
    result: dict[str, Any] = {**run_header("bench.rebuild"), "baseline_commit": commit,
                              "config": {"deliveries": args.deliveries, "rounds": args.rounds}}
    reports: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    spaces: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
    with worktree(commit) as base_tree:
        try:
            bench.start()
            since_ms = int(time.time() * 1000) - 1000
            result["fill"] = {k: v for k, v in bench.pipeline_run(args.deliveries, 0, "fill").items()
                              if k in ("terminal", "deliveries_per_s", "outcomes")}
            bench.stop()
            client = connect(settings().redis_url)
            probe = reader()
            try:
                topics = Rebuilder(WORKFLOW, client).topics(existing_topics(probe))
            finally:
                probe.close()
            result["plain_read"] = plain_read(topics, since_ms)
            log(f"plain read: {result['plain_read']}")
            for round_ in range(args.rounds):
                for side in (["current", "baseline"] if round_ % 2 == 0 else ["baseline", "current"]):
                    client.flushall()
                    report = (rebuild_in(REPO_ROOT, since_ms, args.pass_records) if side == "current"
                              else rebuild_in(base_tree, since_ms))
                    reports[side].append(report)
                    spaces[side].append(keyspace(client))
                    log(f"round {round_ + 1}: {side} read {report['records_read']} records in "
                        f"{report['seconds']:.1f} s")
            client.close()
        finally:
            bench.stop()
            private.stop(keep=args.keep_stack)
    result["reports"] = reports
    result["keyspace"] = spaces
    result["machine"]["load_average_after"] = load_average()
    current, baseline = side_figures(reports["current"]), side_figures(reports["baseline"])
    ceiling = result["plain_read"]["records_per_s"]
    result["summary"] = {
        "filled": result["fill"]["terminal"],
        "records": reports["current"][0]["records_read"],
        "deliveries": reports["current"][0]["deliveries"],
        "outcomes": reports["current"][0]["outcomes"],
        "plain_read_records_per_s": ceiling,
        "current": current, "baseline": baseline,
        "current_over_baseline": round(current["records_per_s_median"] / baseline["records_per_s_median"], 2),
        "current_over_plain_read": round(current["records_per_s_median"] / ceiling, 3),
        # every rebuild of either side restored the same keys with the same contents
        "same_keyspace": len({space["digest"] for side in spaces.values() for space in side}) == 1,
        "kinds_that_differ": _kinds_that_differ([space for side in spaces.values() for space in side]),
    }
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rebuild", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deliveries", "-n", type=int, default=20000, help="deliveries to fill the topics with")
    parser.add_argument("--commit", default="HEAD", help="the baseline's rebuild: any git revision")
    parser.add_argument("--rounds", type=int, default=2, help="rebuilds of each side (alternating order)")
    parser.add_argument("--pass-records", type=int, default=None,
                        help="this tree's rebuild holds at most this many records a pass (its default if unset)")
    add_private_stack_options(parser, "rebuild.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    write_figures(Path(args.out), result, result["summary"])


if __name__ == "__main__":
    main()
