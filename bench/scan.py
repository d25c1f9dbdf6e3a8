"""The supervisor's deadline scan against a naive key scan, on one private Redis.

100,000 in-flight steps (50,000 deliveries x 2 steps, the state table as the runtime writes
it), of which 100 are due (50 never started, 50 failed). One supervisor scan must touch
about the due ones; the baseline finds the same 100 by walking every key (SCAN + HGETALL).

Figures: Redis commands (from ``INFO commandstats`` deltas, so nothing is estimated), wall
time, keys touched. A private ``redis-server`` on a free port keeps the figures clean of
other traffic and leaves the shared stack untouched. Writes JSON and prints its path.

    .venv/bin/python bench/scan.py [--steps 100000] [--due 100] [--out bench/results/scan.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from choreo.lease import Lease  # noqa: E402
from choreo.redis_client import NodePipelines, raise_first  # noqa: E402
from choreo.state import StateTable, deadline_index, deadline_shards, flat_fields, index_member  # noqa: E402
from choreo.supervision import FORWARD, Policies, Scanner, StepPolicy, SupervisorSettings  # noqa: E402

STEPS = ("package", "drone")
DEADLINE_MS = 30_000
POLICIES = Policies({s: StepPolicy(s, FORWARD, 5, DEADLINE_MS, s) for s in STEPS},
                    compensable=STEPS, decider="delivery")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], redis.Redis]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc, client
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("private redis-server did not start")


def populate(client: redis.Redis, steps: int, due: int, now: int) -> list[str]:
    """The state table as publishers and the runner leave it; returns the due members."""
    deliveries = steps // len(STEPS)
    due_members: list[str] = []
    state = StateTable(client)
    pipes = NodePipelines(client)
    for n in range(deliveries):
        d = f"d{n:07d}"
        for step in STEPS:
            i = n * len(STEPS) + (STEPS.index(step))
            is_due = i % (steps // due) == 0 and len(due_members) < due
            f = f"{step}."
            fields: dict[Any, Any] = {f + "status": "pending", f + "attempt": 1, f + "tries": 0,
                                      f + "failures": 0, f + "updated": now - 1000}
            score = now + 1_000 + (i % DEADLINE_MS)  # in flight, due later
            if is_due:
                score = now - 500
                if len(due_members) % 2:  # a failed step (its input can be re-read)
                    fields.update({f + "status": "failed", f + "tries": 2, f + "failures": 1,
                                   f + "source": f"delivery.requested|delivery.requested|0|{i}"})
                due_members.append(index_member(d, step))
            fields[f + "complete_by"] = score
            state.put(d, fields, pipes)
            pipes.on(deadline_index(d)).zadd(deadline_index(d), {index_member(d, step): score})
        if n % 2000 == 1999:
            raise_first(pipes.execute())
            pipes = NodePipelines(client)
    raise_first(pipes.execute())
    return due_members


CLIENT_COMMANDS = {"zrangebyscore", "evalsha", "script|exists"}  # what the scanner sends


def command_calls(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    found = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    found.pop("info", None)  # our own measuring call
    return found


def supervisor_scan(client: redis.Redis, now: int, due: list[str]) -> dict[str, Any]:
    lease = Lease(client, "bench", "bench", 60_000)
    assert lease.acquire() and lease.fence is not None
    scanner = Scanner(client, SupervisorSettings(page_size=200, max_per_scan=2000, scan_budget_s=5))
    scanner.transitions.supervise(keys=["x", "y", lease.shard_key(0)], args=["-"] * 14)  # load the script
    before = command_calls(client)
    started = time.perf_counter()
    result = scanner.scan(lease.fence, lease.shard_key, POLICIES, now)
    seconds = time.perf_counter() - started
    calls = delta(before, command_calls(client))
    kinds: dict[str, int] = {}
    for action in result.actions:
        kinds[action.kind] = kinds.get(action.kind, 0) + 1
    found = {f"{a.delivery_id}|{a.step}" for a in result.actions}
    assert found == set(due), "the scan must find exactly the due steps"
    before = command_calls(client)
    started = time.perf_counter()
    idle = scanner.scan(lease.fence, lease.shard_key, POLICIES, now)  # everything handled: nothing due
    idle_seconds = time.perf_counter() - started
    idle_calls = delta(before, command_calls(client))
    sent = {k: v for k, v in calls.items() if k in CLIENT_COMMANDS}
    return {
        "due_found": len(found), "actions": kinds, "seconds": round(seconds, 5),
        "redis_commands": sum(sent.values()), "commands_by_name": sent,
        # per page: ZRANGEBYSCORE; per non-empty page also SCRIPT EXISTS and the pipeline
        "round_trips": result.stats.pages + 2 * sum(1 for n in result.stats.page_sizes if n),
        "in_script_operations": sum(calls.values()) - sum(sent.values()),
        "in_script_by_name": {k: v for k, v in calls.items() if k not in CLIENT_COMMANDS},
        "keys_touched": len(result.stats.keys) + 1,  # + the fence copy every script reads
        "pages": result.stats.pages, "page_sizes": result.stats.page_sizes,
        "idle_rescan": {"seconds": round(idle_seconds, 5), "redis_commands": sum(idle_calls.values()),
                        "commands_by_name": idle_calls, "due_found": idle.stats.due},
    }


def naive_scan(client: redis.Redis, now: int, due: list[str]) -> dict[str, Any]:
    """Walk every delivery hash (SCAN + pipelined HGETALL) and pick the steps past deadline."""
    before = command_calls(client)
    started = time.perf_counter()
    found: set[str] = set()
    keys_touched = 0
    cursor = 0
    while True:
        cursor, keys = client.scan(cursor=cursor, match="dl:*", count=1000)
        keys_touched += len(keys)
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for key, raw in zip(keys, pipe.execute()):
            fields = flat_fields({k.decode(): v.decode() for k, v in raw.items()})
            delivery_id = (key.decode() if isinstance(key, bytes) else str(key))[4:-1]
            for step in STEPS:
                status = fields.get(f"{step}.status")
                if status in ("pending", "processing", "failed") and (
                        status == "failed" or int(fields.get(f"{step}.complete_by", "0")) <= now):
                    found.add(index_member(delivery_id, step))
        if cursor == 0:
            break
    seconds = time.perf_counter() - started
    calls = delta(before, command_calls(client))
    assert found == set(due), "the naive walk must find the same due steps"
    return {"due_found": len(found), "seconds": round(seconds, 5),
            "redis_commands": sum(calls.values()), "commands_by_name": calls,
            "round_trips": calls.get("scan", 0) * 2,  # one SCAN + one HGETALL pipeline per batch
            "keys_touched": keys_touched}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scan.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scan-bench-") as workdir:
        proc, client = start_redis(Path(workdir))
        try:
            now = int(time.time() * 1000)
            print(f"populating {args.steps} in-flight steps ({args.due} due) ...", file=sys.stderr)
            t0 = time.perf_counter()
            due = populate(client, args.steps, args.due, now)
            populate_s = time.perf_counter() - t0
            # the naive walk first: the supervisor's scan changes what is due
            naive = naive_scan(client, now, due)
            supervisor = supervisor_scan(client, now, due)
            figures = {
                "benchmark": "supervisor deadline scan vs naive key walk",
                "in_flight_steps": args.steps, "due_steps": len(due),
                "deliveries": args.steps // len(STEPS), "index_size": sum(int(client.zcard(index)) for index in deadline_shards()),
                "redis_keys": int(client.dbsize()), "populate_seconds": round(populate_s, 2),
                "supervisor_scan": supervisor, "naive_scan_baseline": naive,
                "ratios": {
                    "commands": round(naive["redis_commands"] / supervisor["redis_commands"], 1),
                    "keys_touched": round(naive["keys_touched"] / supervisor["keys_touched"], 1),
                    "time": round(naive["seconds"] / supervisor["seconds"], 1),
                },
                "redis_version": client.info("server")["redis_version"],
                "python": platform.python_version(), "machine": platform.machine(),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        finally:
            client.close()
            proc.terminate()
            proc.wait(10)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    s, n = figures["supervisor_scan"], figures["naive_scan_baseline"]
    print(f"supervisor scan: {s['due_found']} due, {s['redis_commands']} commands, "
          f"{s['keys_touched']} keys, {s['seconds'] * 1000:.1f} ms", file=sys.stderr)
    print(f"naive walk:      {n['due_found']} due, {n['redis_commands']} commands, "
          f"{n['keys_touched']} keys, {n['seconds'] * 1000:.1f} ms", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
