"""Pipeline throughput, latency and memory, beside the ceiling of the same machine.

    .venv/bin/python -m bench.pipeline --deliveries 2000 --repeats 3 --rates 100 \\
        --out bench/results/pipeline.json

Starts a **private** stack (Kafka, Redis, schema registry on free ports, data under a
temporary ``CHOREO_DATA_DIR``) and the five services as their own processes (exactly-once:
every batch is one Kafka transaction), so nothing else on the machine shares its topics,
consumer groups, transactional ids or Redis, and Redis memory figures are its own. Then,
per repeat:

1. **pipeline, closed loop**: N deliveries through the Python producer API
   (``producers.client.DeliveryClient``: validation, admission, state table, Avro) at full
   speed, from a driver process; a ``read_committed`` observer in this process times each
   delivery from its broker confirmation to its committed ``delivery.shipped``;
2. **ceiling, transactional** and 3. **ceiling, plain**: the same happy path
   (``bench.common.HAPPY_PATH``: the same consume→produce hops, topics of the same partition
   count, records of the same sizes, the runtime's client settings, one process per
   stage) with confluent-kafka and no logic, through the same broker, with
   ``--ceiling-scale`` times the deliveries (a short ceiling run measures its own start);
4. **ceiling, throughput-tuned**: the same no-logic transactional chain tuned for
   throughput (``bench.ceiling``: batches as large as the consumer hands over), with
   ``--tuned-scale`` times the deliveries: the best this machine's Kafka does, the yardstick
   of the ``ratio_tuned`` target.

Before any of it, a warm-up: rounds of every one of these paths, on ``--warmup`` deliveries
each, until the broker's JIT compilers rest (``Bench.warm``), so the figures are of a broker
as warm as one in service.

Then open-loop runs at each ``--rates`` and at half of the closed-loop rate just measured
(requests on a fixed schedule), a Redis memory probe
(bytes per accepted and per completed delivery, and the keys one delivery leaves), and,
with ``--profile SERVICE,...``, py-spy profiles of those services under closed-loop load.

Figures go to the JSON file (its path is printed); the last line printed is the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx
import redis
from confluent_kafka import Consumer, TopicPartition

from bench.ceiling import Record, save_samples
from bench.common import (
    HAPPY_PATH, SOURCE_TOPIC, TERMINAL_TOPIC, Hops, ProcSample, Stage, batch_figures,
    compiler_seconds, free_port, hop_count, latency_summary, load_average, metric_by_label, metric_growth, parse_metrics, rate, sample_process,
    run_header, summarise_repeats, thread_cpu, write_figures,
)
from choreo.config import REPO_ROOT, settings
from choreo.redis_client import connect, is_cluster
from choreo.release import state_keys
from choreo.state import deadline_index, deadline_shards, text
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from infra.redis_cluster import BUS_OFFSET, MASTERS, REPLICAS_PER_MASTER, RedisCluster
from producers.admission import inflight_keys
from producers.settings import IngestionSettings

RESULTS = REPO_ROOT / "bench" / "results"
SERVICES = ["package", "drone-scheduler", "delivery", "notifier", "supervisor"]
# what --profile takes besides service names: the submitting driver (py-spy) and the broker
# (Java Flight Recorder; its profile run also profiles one transactional ceiling run)
OTHER_PROFILES = ("ingestion", "kafka")
# the services' batched script items (``choreo.metrics.SCRIPT_ITEMS``; the ingestion driver's
# own calls are not scraped)
SCRIPT_ITEMS = "choreo_redis_script_items_total"
OUTCOME_TOPICS = ["delivery.shipped", "delivery.failed"]
# records the services keep of every delivery, by design (business logs, not runtime state)
BUSINESS_LOGS = (fleet.history_key,)
# every record the services declare per delivery (the package's, the notifier's): all there
# once every reader of a shipment is done
RECORDS = [record.key for service in WORKFLOW.services for record in service.records]
# those kept past the release, for their own TTL: what a finished delivery leaves besides its
# tombstone (none of the workflow's)
KEPT_RECORDS = [record.key for service in WORKFLOW.services for record in service.records
                if not record.released_with_delivery]
# admission's in-flight set: a live ingestion instance trims terminal deliveries out of it
# lazily; the benchmark's driver exits first, so its entries are counted apart
ADMISSION_SET = inflight_keys(IngestionSettings().inflight_key)[0]
TARGETS = {"ratio_tuned": 0.35, "p50_ms_at_100": 100.0, "p99_ms_at_100": 250.0,
           "p99_ms_at_half_capacity": 500.0, "rss_mb_per_service": 150.0,
           "redis_bytes_per_inflight": 1024.0, "redis_bytes_retained_per_completed": 150.0,
           "redis_script_items_per_delivery": 10.0}
# The ceilings run this many times the pipeline's deliveries. A no-logic chain drains a burst
# of the pipeline's size in under a second, most of it the time to fill and drain its hops,
# and its rate then grew with the run's size (bench/README.md, "A ceiling too short measures
# its own start"); at these sizes each runs for seconds, as the pipeline does.
CEILING_SCALE = 16
TUNED_SCALE = 80
HALF = "half"  # the open-loop run at half of the measured capacity


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the private stack ----------------------------------------------------------------------


@dataclasses.dataclass
class Private:
    """A stack of our own: its data directory, ports and the env that points at it. With
    ``redis_cluster``, Redis is a Redis Cluster of three masters and three replicas on the
    six ports from ``redis``, found from its first node as a deployment's would be."""

    data_dir: Path
    kafka: int
    redis: int
    registry: int
    owned_dir: bool
    redis_cluster: bool = False

    @property
    def env(self) -> dict[str, str]:
        """The private parts' addresses; a part named in CHOREO_EXTERNAL keeps the address
        the environment gives it (``infra.stack`` starts none of it)."""
        from infra import stack

        outside = stack.external()
        private = {
            "kafka": ("KAFKA_BOOTSTRAP_SERVERS", f"127.0.0.1:{self.kafka}"),
            "redis": ("REDIS_URL", f"redis://127.0.0.1:{self.redis}/0"),
            "registry": ("SCHEMA_REGISTRY_URL", f"http://127.0.0.1:{self.registry}"),
        }
        env = {**{var: url for part, (var, url) in private.items() if part not in outside},
               "CHOREO_DATA_DIR": str(self.data_dir)}
        if self.redis_cluster:  # started here, not by the stack: to the stack it is external
            env[stack.EXTERNAL_ENV] = ",".join(sorted(outside | {"redis"}))
        return env

    @classmethod
    def at(cls, directory: str | None, redis_cluster: bool = False) -> Private:
        from infra import stack

        if redis_cluster and "redis" in stack.external():
            raise SystemExit(f"--redis-cluster starts its own cluster: take redis out of {stack.EXTERNAL_ENV}")
        data_dir = Path(directory or tempfile.mkdtemp(prefix="choreo-bench-")).resolve()
        data_dir.mkdir(parents=True, exist_ok=True)
        ports_file = data_dir / "bench-ports.json"
        ports = json.loads(ports_file.read_text()) if ports_file.exists() else {}
        if not ports or ports.get("redis_cluster", False) != redis_cluster:
            nodes = MASTERS * (1 + REPLICAS_PER_MASTER)
            ports = {"kafka": free_port(2), "registry": free_port(), "redis_cluster": redis_cluster,
                     "redis": free_port(nodes, BUS_OFFSET) if redis_cluster else free_port()}
            ports_file.write_text(json.dumps(ports))
        return cls(data_dir, ports["kafka"], ports["redis"], ports["registry"],
                   owned_dir=directory is None, redis_cluster=redis_cluster)

    def cluster(self) -> RedisCluster:
        return RedisCluster(self.data_dir, base_port=self.redis)

    def pids(self) -> dict[str, int]:
        """The stack's processes by name; each node of a Redis Cluster apart."""
        from infra import stack
        from infra.redis_server import redis_process
        from infra.registry_process import registry_process

        cfg = settings()
        redis_nodes = (self.cluster().processes() if self.redis_cluster
                       else [redis_process(cfg.redis_url, cfg.data_dir)])
        found = {"kafka": stack.kafka_cluster(cfg).node(0).pid(), "registry": registry_process(cfg).pid(),
                 **{node.name if self.redis_cluster else "redis": node.pid() for node in redis_nodes}}
        return {name: pid for name, pid in found.items() if pid is not None}

    def activate(self) -> None:
        """Point this process (and every child it starts) at the private stack."""
        os.environ.update(self.env)
        settings.cache_clear()

    def start(self, partitions: int) -> None:
        """Start the stack (this process activated), with the workflow's topics and contracts."""
        from choreo import contracts, topology
        from choreo.runtime_events import RUNTIME_EVENTS
        from consumers.workflow import WORKFLOW
        from infra import stack

        log(f"private stack in {self.data_dir} (Kafka :{self.kafka}, Redis :{self.redis}"
            f"{' and the five ports after it, a Redis Cluster' if self.redis_cluster else ''}, "
            f"registry :{self.registry})")
        if self.redis_cluster:
            self.cluster().start(timeout_s=60)
        stack.start()
        topology.create(WORKFLOW, partitions)
        contracts.register(contracts.topic_models(WORKFLOW, RUNTIME_EVENTS))

    def stop(self, keep: bool) -> None:
        """Stop the stack unless ``keep``; a temporary data directory goes with it."""
        from infra import stack

        if not keep:
            stack.stop()
            if self.redis_cluster:
                self.cluster().stop(timeout_s=15)
            if self.owned_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)


def add_private_stack_options(parser: argparse.ArgumentParser, figures_file: str) -> None:
    """What every benchmark on a private stack lets one choose: the stack's directory (to
    reuse one while developing), whether it stays up, and where the figures go."""
    parser.add_argument("--stack-dir", default=None,
                        help="reuse a private stack directory (default: a fresh temporary one)")
    parser.add_argument("--keep-stack", action="store_true", help="leave the private stack running")
    parser.add_argument("--out", default=str(RESULTS / figures_file))


def redis_info(client: redis.Redis, section: str) -> list[dict[str, Any]]:
    """``INFO section`` of each node that holds data: the one node, or every master of a cluster
    (redis-py's cluster client asks one node unless told otherwise)."""
    if is_cluster(client):
        return list(client.info(section, target_nodes=redis.RedisCluster.PRIMARIES).values())
    return [client.info(section)]


def used_memory(client: redis.Redis) -> int:
    return sum(int(info["used_memory"]) for info in redis_info(client, "memory"))


def records_of(ids: Sequence[str], records: Sequence[Callable[[str], str]] = KEPT_RECORDS) -> list[str]:
    """The keys of ``records`` (``KEPT_RECORDS``: the kept ones) of these deliveries."""
    return [key(d) for d in ids for key in records]


def _sum_over_keys(client: redis.Redis, command: Literal["exists", "memory_usage"], keys: Sequence[str]) -> int:
    """One command per key in one pipeline, its answers summed: how many exist, or their bytes."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        if command == "exists":
            pipe.exists(key)
        else:
            pipe.memory_usage(key, samples=0)
    return sum(int(answer or 0) for answer in pipe.execute())


def command_stats(client: redis.Redis) -> dict[str, dict[str, float]]:
    """``INFO commandstats``' calls and µs per command, summed over the nodes."""
    total: dict[str, dict[str, float]] = {}
    for info in redis_info(client, "commandstats"):
        for name, stats in info.items():
            into = total.setdefault(name, {"calls": 0, "usec": 0})
            into["calls"] += stats["calls"]
            into["usec"] += stats["usec"]
    return total


# -- processes we watch ---------------------------------------------------------------------


class Watch:
    """CPU seconds and peak RSS of named processes between two moments."""

    # processes whose CPU is also split by thread group (the broker: request handlers,
    # network threads, transaction markers, GC, JIT...)
    BY_THREAD = ("kafka",)

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.start: dict[str, ProcSample] = {}
        self.start_threads: dict[str, dict[str, float]] = {}
        self.t0 = 0.0

    def begin(self) -> None:
        self.t0 = time.monotonic()
        self.start = {n: s for n, p in self.pids.items() if (s := sample_process(p)) is not None}
        self.start_threads = {n: thread_cpu(p) for n, p in self.pids.items() if n in self.BY_THREAD}

    def end(self) -> dict[str, dict[str, Any]]:
        elapsed = time.monotonic() - self.t0
        out: dict[str, dict[str, Any]] = {}
        for name, pid in self.pids.items():
            now = sample_process(pid)
            first = self.start.get(name)
            if now is None or first is None:
                continue
            cpu = now.cpu_s - first.cpu_s
            out[name] = {"cpu_s": round(cpu, 2), "cpu_pct": round(100 * cpu / elapsed, 1),
                         "rss_mb": round(now.rss_kb / 1024, 1),
                         "peak_rss_mb": round(now.hwm_kb / 1024, 1)}
            if name in self.start_threads:
                first_threads = self.start_threads[name]
                used = {group: round(cpu_s - first_threads.get(group, 0.0), 2)
                        for group, cpu_s in thread_cpu(pid).items()}
                out[name]["cpu_s_by_thread"] = dict(sorted(
                    ((g, c) for g, c in used.items() if c > 0), key=lambda gc: -gc[1]))
        return out


def scrape(ports: dict[str, int]) -> dict[str, float]:
    samples: dict[str, float] = {}
    for port in ports.values():
        try:
            found = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0).text)
            for key, value in found.items():  # instances of one service add up
                samples[key] = samples.get(key, 0.0) + value
        except httpx.HTTPError:
            pass
    return samples


# -- the observer ---------------------------------------------------------------------------


class Observer:
    """A read_committed consumer of outcome topics from their current end: when each key's
    first outcome was committed (seen), on which topic, and how often (doubles)."""

    def __init__(self, topics: Sequence[str]) -> None:
        from choreo.kafka import base_config

        self.consumer = Consumer({**base_config(), "group.id": f"bench-observer-{uuid.uuid4().hex[:8]}",
                                  "enable.auto.commit": False, "isolation.level": "read_committed",
                                  "fetch.wait.max.ms": 5})
        meta = self.consumer.list_topics(timeout=10)
        self.consumer.assign([
            TopicPartition(t, p, self.consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1])
            for t in topics for p in meta.topics[t].partitions
        ])
        self.seen: dict[str, tuple[float, str]] = {}
        self.count: Counter[str] = Counter()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # poll returns at the first record (consume(n, t) would wait for n or t: up to
            # 50 ms of delay added to every timing); then drain what is there without waiting
            first = self.consumer.poll(0.05)
            if first is None:
                continue
            now = time.monotonic()
            for msg in [first, *self.consumer.consume(1000, 0)]:
                key = msg.key()
                if msg.error() is not None or key is None:
                    continue
                delivery = key.decode(errors="replace")
                with self.lock:
                    self.count[delivery] += 1
                    self.seen.setdefault(delivery, (now, msg.topic() or ""))

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if all(k in self.seen for k in keys):
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.consumer.close()


# -- one measured run -----------------------------------------------------------------------


def py_spy() -> str:
    return shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def run_drivers(argvs: list[list[str]], work: Path, tag: str,
                profile_to: Path | None = None) -> dict[str, Any]:
    """Run driver processes at once; their results merged (first start, last end). With
    ``profile_to`` the first driver runs under py-spy (the ingestion side's profile)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    running = []
    for k, argv in enumerate(argvs):
        out = work / f"drive-{tag}-{k}.json"
        logf = open(work / f"drive-{tag}-{k}.log", "wb")
        spy = ([py_spy(), "record", "--rate", "100", "--format", "raw", "--output", str(profile_to),
                "--"] if profile_to is not None and k == 0 else [])
        proc = subprocess.Popen([*spy, sys.executable, "-m", "bench.drive", *argv, "--out", str(out)],
                                cwd=REPO_ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
        running.append((proc, out, logf))
    results = []
    for proc, out, logf in running:
        code = proc.wait()
        logf.close()
        if code != 0:
            raise RuntimeError(f"driver {tag} failed ({code}); see {logf.name}")
        results.append(json.loads(out.read_text()))
    merged: dict[str, Any] = {
        "start": min(r["start"] for r in results),
        "submitted": max(r["submitted"] for r in results),
        "end": max(r["end"] for r in results),
        "accepted": [a for r in results for a in r["accepted"]],
        "refused": dict(sum((Counter(r["refused"]) for r in results), Counter())),
        "errors": dict(sum((Counter(r["errors"]) for r in results), Counter())),
        "drivers": len(results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "peak_rss_mb": round(max(r["peak_rss_kb"] for r in results) / 1024, 1),
    }
    return merged


def pipeline_driver_argvs(n: int, rate_per_s: float, drivers: int, seed: int) -> list[list[str]]:
    """``drivers`` processes share ``n`` deliveries and the offered rate evenly."""
    shares = [n // drivers + (1 if k < n % drivers else 0) for k in range(drivers)]
    return [["pipeline", "--n", str(share), "--rate", str(rate_per_s / drivers),
             "--seed", str(seed + k)] for k, share in enumerate(shares) if share > 0]


def outcome_figures(driven: dict[str, Any], observer: Observer, hops: Hops,
                    waited: bool) -> dict[str, Any]:
    accepted: list[list[Any]] = driven["accepted"]
    with observer.lock:
        seen = dict(observer.seen)
        counts = Counter(observer.count)
    ends = [(seen[i][0], seen[i][1]) for i, _, _ in accepted if i in seen]
    shipped = sum(1 for _, topic in ends if topic == TERMINAL_TOPIC)
    last = max((t for t, _ in ends), default=driven["end"])
    elapsed = last - driven["start"]
    from_accept = [(seen[i][0] - acc) * 1000 for i, _, acc in accepted if i in seen]
    from_due = [(seen[i][0] - due) * 1000 for i, due, _ in accepted if i in seen]
    done = len(ends)
    return {
        "accepted": len(accepted),
        "refused": driven.get("refused", {}),
        "publish_errors": driven.get("errors", {}),
        "terminal": done,
        "shipped": shipped,
        "failed": done - shipped,
        "lost_or_stuck": len(accepted) - done,
        "more_than_one_outcome": sum(1 for i, _, _ in accepted if counts[i] > 1),
        "all_terminal_in_time": waited,
        "elapsed_s": round(elapsed, 3),
        "submit_s": round(driven["submitted"] - driven["start"], 3),
        "submit_per_s": rate(len(accepted), driven["submitted"] - driven["start"]),
        "deliveries_per_s": rate(done, elapsed),
        "events_per_s": rate(done * hops.produced, elapsed),
        "consumes_per_s": rate(done * hops.consumed, elapsed),
        "latency": latency_summary(from_accept),
        "latency_from_schedule": latency_summary(from_due),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, private: Private) -> None:
        self.args = args
        self.private = private
        self.work = private.data_dir / "bench-work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.services: dict[str, Any] = {}  # name -> ManagedProcess
        self.metrics_ports: dict[str, int] = {}
        self.hops = hop_count(HAPPY_PATH)
        self.samples: dict[str, Record] = {}
        self.idle_pct: dict[str, float] = {}
        out = Path(args.out)
        self.profile_dir = out.with_name(f"{out.stem}-profiles")  # raw py-spy stacks, kept

    # -- setup -----------------------------------------------------------------------------

    def start(self) -> None:
        from infra.demo import wait_for_groups
        from infra.services import pipeline_specs, service_process

        self.private.start(self.args.partitions)
        env = {**self.private.env, "CHOREO_LOG_LEVEL": self.args.log_level}
        for spec in pipeline_specs(self.args.instances):
            port = free_port()
            proc = service_process(spec, env)
            proc = dataclasses.replace(proc, argv=[*proc.argv, "--metrics-port", str(port)])
            proc.start(timeout_s=30)
            key = spec.name if self.args.instances == 1 else f"{spec.name}-{spec.instance}"
            self.services[key] = proc
            self.metrics_ports[key] = port
        unknown = [name for name in self.args.profile if name not in self.services and name not in OTHER_PROFILES]
        if unknown:
            raise SystemExit(f"--profile {','.join(unknown)}: no such service instance "
                             f"({', '.join(self.services)})")
        wait_for_groups(SERVICES, 90)
        log("services up: " + ", ".join(f"{n} (pid {p.pid()})" for n, p in self.services.items()))

    def warm(self) -> dict[str, Any]:
        """Rounds of every path the measured runs take (the closed loop, the three ceilings,
        the open loop at each rate and at half the round's closed-loop rate) until the
        broker's JIT compilers rest: at most ``--warm-jit-pct`` of a core over a round, or
        ``--warm-max-seconds`` have passed or ``--warm-max-rounds`` have run (then ``warm``
        is false and the figures are of a broker still compiling). A broker in service has
        compiled these paths long ago; one that still compiles takes a core's share from the
        pipeline it shares 2 cores with, and the open-loop runs' tail measures the compiler."""
        kafka = self.private.pids()["kafka"]
        started = time.monotonic()
        rounds: list[dict[str, Any]] = []
        while self.args.warm_max_rounds is None or len(rounds) < self.args.warm_max_rounds:
            k, t0, compiled = len(rounds), time.monotonic(), compiler_seconds(thread_cpu(kafka))
            closed = self.pipeline_run(self.args.warmup, 0, f"warmup-{k}")
            self.ceiling_run(self.args.warmup, True, f"warmup-{k}-txn")
            self.ceiling_run(self.args.warmup, False, f"warmup-{k}-plain")
            self.ceiling_run(self.args.warmup, True, f"warmup-{k}-tuned", tuned=True)
            for offered in [*self.args.rates, closed["deliveries_per_s"] / 2]:
                self.pipeline_run(max(1, int(offered * self.args.open_seconds)), offered,
                                  f"warmup-{k}-open-{int(offered)}")
            seconds = time.monotonic() - t0
            pct = round(100 * (compiler_seconds(thread_cpu(kafka)) - compiled) / seconds, 1)
            rounds.append({"seconds": round(seconds, 1), "compiler_cpu_pct": pct,
                           "closed_deliveries_per_s": closed["deliveries_per_s"]})
            log(f"warm-up round {k}: the broker's compilers took {pct}% of a core")
            warm = pct <= self.args.warm_jit_pct
            if warm or time.monotonic() - started >= self.args.warm_max_seconds:
                return {"warm": warm, "seconds": round(time.monotonic() - started, 1), "rounds": rounds}
        return {"warm": False, "seconds": round(time.monotonic() - started, 1), "rounds": rounds}

    def idle(self, seconds: float = 3.0) -> dict[str, Any]:
        """What the stack costs with no load at all (polling consumers, lag and deadline
        scans, lease renewals): CPU % per process, to read the per-delivery figures against."""
        watch = Watch(self.pids())
        watch.begin()
        time.sleep(seconds)
        procs = watch.end()
        self.idle_pct = {n: p["cpu_pct"] for n, p in procs.items()}
        return {"seconds": seconds, "cpu_pct": {n: p["cpu_pct"] for n, p in procs.items()},
                "total_cpu_pct": round(sum(p["cpu_pct"] for p in procs.values()), 1)}

    def stop(self) -> None:
        from infra.process import stop_all

        stop_all(list(self.services.values()), timeout_s=15)

    def service_of(self, key: str) -> str:
        return key if self.args.instances == 1 else key.rsplit("-", 1)[0]

    def pids(self) -> dict[str, int]:
        found = {n: pid for n, p in self.services.items() if (pid := p.pid()) is not None}
        return {**found, **self.private.pids()}

    # -- the pipeline ------------------------------------------------------------------------

    def pipeline_run(self, n: int, rate_per_s: float, tag: str,
                     profile: Sequence[str] = ()) -> dict[str, Any]:
        client = connect(settings().redis_url)
        watch = Watch(self.pids())
        observer = Observer(OUTCOME_TOPICS)
        before = scrape(self.metrics_ports)
        mem_before = used_memory(client)
        commands_before = command_stats(client)
        if profile:
            self.profile_dir.mkdir(parents=True, exist_ok=True)
        spies = self._start_profilers([p for p in profile if p not in OTHER_PROFILES], tag)
        broker = self._start_broker_profile(tag) if "kafka" in profile else None
        ingestion_profile = self.profile_dir / "ingestion.txt" if "ingestion" in profile else None
        watch.begin()
        t0 = time.monotonic()
        driven = run_drivers(pipeline_driver_argvs(n, rate_per_s, self.args.drivers,
                                                   sum(map(ord, tag))), self.work, tag,
                             ingestion_profile)
        ids = [i for i, _, _ in driven["accepted"]]
        waited = observer.wait_for(ids, self.args.timeout)
        time.sleep(0.5)  # the notifier and the supervisor consume delivery.shipped too
        seconds = time.monotonic() - t0
        procs = watch.end()
        procs["ingestion-driver"] = {"cpu_s": round(driven["cpu_s"], 2),
                                     "cpu_pct": round(100 * driven["cpu_s"] / seconds, 1),
                                     "rss_mb": driven["peak_rss_mb"], "peak_rss_mb": driven["peak_rss_mb"]}
        profiles = self._stop_profilers(spies)
        if broker is not None:
            profiles["kafka"] = self._stop_broker_profile(broker)
        if ingestion_profile is not None and ingestion_profile.exists():
            from bench.profile import summarise as summarise_profile

            profiles["ingestion"] = {"raw": str(ingestion_profile),
                                     **summarise_profile(ingestion_profile.read_text(),
                                                         top=self.args.profile_top)}
        after = scrape(self.metrics_ports)
        mem_after = used_memory(client)
        commands = redis_commands(commands_before, command_stats(client), len(ids))
        observer.close()
        figures = outcome_figures(driven, observer, self.hops, waited)
        figures.update({
            "mode": "closed" if rate_per_s <= 0 else "open", "offered_per_s": rate_per_s,
            "processes": procs,
            "cpu": cpu_budget(procs, figures["terminal"], seconds, self.idle_pct),
            "batches": {s: batch_figures(before, after, s, seconds, figures["terminal"]) for s in SERVICES},
            "redis_used_memory_before": mem_before, "redis_used_memory_after": mem_after,
            "redis_bytes_retained_per_delivery": round((mem_after - mem_before) / max(1, len(ids))),
            "redis_commands_per_delivery": commands,
            "redis_script_items_per_delivery": round(
                metric_growth(before, after, SCRIPT_ITEMS) / max(1, figures["terminal"]), 1),
            "redis_script_items_by_script": script_items(before, after, figures["terminal"]),
            "load_average": load_average(),
        })
        if profiles:
            figures["profile"] = profiles
        log(f"{tag}: {figures['terminal']}/{n} terminal, {figures['deliveries_per_s']}/s, "
            f"p50 {figures['latency']['p50_ms']} p99 {figures['latency']['p99_ms']} ms")
        return figures

    def _start_profilers(self, names: Sequence[str], tag: str) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        spy = py_spy()
        started = []
        for name in names:
            if name not in self.services:
                raise SystemExit(f"--profile {name}: no such service instance ({', '.join(self.services)})")
            pid = self.services[name].pid()
            out = self.profile_dir / f"{name}.txt"
            proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "100", "--format",
                                     "raw", "--output", str(out),
                                     *(["--idle"] if self.args.profile_idle else [])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started.append((name, proc, out))
        if started:
            time.sleep(1.0)  # py-spy attaches
        return started

    def _start_broker_profile(self, tag: str) -> tuple[int, Path]:
        from bench import jfr

        pid = self.private.pids()["kafka"]
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        out = (self.profile_dir / f"kafka-{tag}.jfr").resolve()  # the broker resolves it, not us
        jfr.start(pid, out)
        return pid, out

    def _stop_broker_profile(self, broker: tuple[int, Path]) -> dict[str, Any]:
        from bench import jfr
        from bench.profile import summarise

        pid, out = broker
        collapsed = jfr.stop(pid, out)
        text = out.with_suffix(".txt")
        text.write_text(collapsed)
        return {"raw": str(text), **summarise(collapsed, top=self.args.profile_top)}

    def _stop_profilers(self, spies: list[tuple[str, subprocess.Popen[bytes], Path]]) -> dict[str, Any]:
        from bench.profile import summarise

        found: dict[str, Any] = {}
        for name, proc, out in spies:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if out.exists():
                found[name] = {"raw": str(out), **summarise(out.read_text(), top=self.args.profile_top)}
        return found

    # -- the ceiling -------------------------------------------------------------------------

    def capture_samples(self) -> dict[str, Record]:
        """One committed record (value and headers) per happy-path topic, from the warm-up."""
        from choreo.envelope import pairs
        from choreo.kafka import base_config, headers_of

        consumer = Consumer({**base_config(), "group.id": "bench-samples", "enable.auto.commit": False,
                             "isolation.level": "read_committed"})
        samples: dict[str, Record] = {}
        try:
            for topic in self.hops.per_topic:
                meta = consumer.list_topics(topic, timeout=10).topics[topic]
                for partition in meta.partitions:
                    low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
                    if high > low:
                        consumer.assign([TopicPartition(topic, partition, max(low, high - 200))])
                        # one record, as soon as it comes: some of the last offsets are
                        # transaction markers, never delivered, so a wait for a count of them
                        # would wait out its whole timeout
                        msgs = [m for m in consumer.consume(1, 5) if m.error() is None]
                        if msgs:
                            headers: list[tuple[str, str | bytes | None]] = list(pairs(headers_of(msgs[0])))
                            samples[topic] = Record(msgs[0].value() or b"", headers)
                            break
        finally:
            consumer.close()
        missing = set(self.hops.per_topic) - set(samples)
        if missing:
            raise RuntimeError(f"no sample records on {sorted(missing)} after the warm-up")
        return samples

    def ceiling_run(self, n: int, transactional: bool, tag: str, rate_per_s: float = 0.0,
                    profile_broker: bool = False, tuned: bool = False) -> dict[str, Any]:
        from choreo.kafka import ensure_topics
        from infra.demo import wait_for_groups

        prefix = f"ceil.{tag}."
        topics = {prefix + t: self.args.partitions for t in self.hops.per_topic}
        ensure_topics(topics)
        samples_path = self.work / "samples.json"
        save_samples(samples_path, self.samples)
        originals = {prefix + t: t for t in self.hops.per_topic}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        groups = []
        try:
            for stage in HAPPY_PATH:
                spec = self._stage_spec(stage, prefix, tag, transactional, samples_path, originals, tuned)
                groups.append(spec["group"])
                spec_path = self.work / f"stage-{tag}-{stage.name}.json"
                spec_path.write_text(json.dumps(spec))
                with open(self.work / f"stage-{tag}-{stage.name}.log", "wb") as logf:
                    procs[f"ceiling-{stage.name}"] = subprocess.Popen(
                        [sys.executable, "-m", "bench.ceiling", "stage", str(spec_path)],
                        cwd=REPO_ROOT, stdout=logf, stderr=subprocess.STDOUT,
                        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            wait_for_groups(groups, 60)
            watch = Watch({**{n_: p.pid for n_, p in procs.items()}, **self.private.pids()})
            observer = Observer([prefix + TERMINAL_TOPIC])
            broker = self._start_broker_profile(tag) if profile_broker else None
            watch.begin()
            driven = run_drivers([["ceiling", "--n", str(n), "--topic", prefix + SOURCE_TOPIC,
                                   "--samples", str(samples_path), "--rate", str(rate_per_s)]],
                                 self.work, tag)
            waited = observer.wait_for([i for i, _, _ in driven["accepted"]], self.args.timeout)
            used = watch.end()
            seconds = time.monotonic() - watch.t0
            profiles = {"kafka": self._stop_broker_profile(broker)} if broker is not None else {}
            used["ceiling-source"] = {"cpu_s": round(driven["cpu_s"], 2), "cpu_pct": 0.0,
                                      "rss_mb": driven["peak_rss_mb"], "peak_rss_mb": driven["peak_rss_mb"]}
            observer.close()
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        self._delete_topics(list(topics))
        figures = outcome_figures(driven, observer, self.hops, waited)
        mode = "transactional, throughput-tuned" if tuned else "transactional" if transactional else "plain"
        figures.update({"mode": mode, "processes": used,
                        "cpu": cpu_budget(used, figures["terminal"], seconds, self.idle_pct),
                        "load_average": load_average()})
        if profiles:
            figures["profile"] = profiles
        log(f"{tag}: {figures['terminal']}/{n} terminal, {figures['deliveries_per_s']}/s, "
            f"p50 {figures['latency']['p50_ms']} p99 {figures['latency']['p99_ms']} ms")
        return figures

    def _stage_spec(self, stage: Stage, prefix: str, tag: str, transactional: bool,
                    samples_path: Path, originals: dict[str, str], tuned: bool) -> dict[str, Any]:
        return {
            "name": f"ceiling-{stage.name}",
            "group": f"ceil-{tag}-{stage.name}",
            "routes": {prefix + t: (prefix + o if o else None) for t, o in stage.routes.items()},
            "fan_in": stage.fan_in,
            "transactional": transactional,
            "tuned": tuned,
            "samples": str(samples_path),
            "originals": originals,
        }

    def _delete_topics(self, topics: list[str]) -> None:
        from choreo.kafka import admin

        for future in admin().delete_topics(topics, request_timeout=30).values():
            try:
                future.result(30)
            except Exception:  # best effort: the private stack goes away anyway
                pass

    # -- Redis memory ------------------------------------------------------------------------

    def memory_probe(self, n: int) -> dict[str, Any]:
        """Redis bytes per delivery at four moments: accepted but not yet worked (the step
        consumers paused with SIGSTOP for a moment); shipped, with every reaction done but the
        notifier's, whose group then holds the release back (``choreo.release``); notified too,
        with the supervisor, which releases, paused: the most a delivery holds
        (``most_held_per_delivery``); and once released. The business log that grows with
        every delivery (the fleet's history) is counted apart from the runtime's state; the
        services' records released with the delivery count with it, those kept past the
        release (``KEPT_RECORDS``) apart."""
        client = connect(settings().redis_url)
        step_consumers = self._pids("package", "drone-scheduler")
        notifier, releaser = self._pids("notifier"), self._pids("supervisor")
        base = used_memory(client)
        logs_base = self._business_log_bytes(client)
        admission_base = _sum_over_keys(client, "memory_usage", [ADMISSION_SET])
        shared_base = self._shared_bytes(client)
        observer = Observer(OUTCOME_TOPICS)
        release_held = ExitStack()
        try:
            with paused(notifier):
                with paused(step_consumers):
                    driven = run_drivers(pipeline_driver_argvs(n, 0, 1, 99), self.work, "memory")
                    accepted_mem = used_memory(client)
                    counted_accepted = self._counted(client, [i for i, _, _ in driven["accepted"]], shared_base)
                ids = [i for i, _, _ in driven["accepted"]]
                waited = observer.wait_for(ids, self.args.timeout)
                observer.close()
                # only a shipment is recorded for release, and only it is notified
                shipped = {d for d in ids if observer.seen.get(d, (0.0, ""))[1] == TERMINAL_TOPIC}
                recorded = _wait(lambda: shipped <= self._awaiting_release(client), self.args.timeout)
                held_mem = used_memory(client)
                counted_held = self._counted(client, ids, shared_base)
                if recorded:  # the notifier's turn with the release held by its doer
                    release_held.enter_context(paused(releaser))
            notified = recorded and _wait(lambda: _sum_over_keys(client, "exists", records_of(sorted(shipped), RECORDS))
                                          == len(shipped) * len(RECORDS), self.args.timeout)
            most_mem = used_memory(client)
            counted_most = self._counted(client, ids, shared_base)
            kept_most = _sum_over_keys(client, "memory_usage", records_of(ids))
            held_keys = self._keys_of(client, ids[0]) if ids else {}
        finally:
            release_held.close()
        released = _wait(lambda: not shipped & self._awaiting_release(client), self.args.timeout)
        time.sleep(1.0)
        done_mem = used_memory(client)
        counted_done = self._counted(client, ids, shared_base)
        logs = self._business_log_bytes(client) - logs_base
        admission = _sum_over_keys(client, "memory_usage", [ADMISSION_SET]) - admission_base
        count = max(1, len(ids))
        kept = _sum_over_keys(client, "memory_usage", records_of(ids))
        records_left = _sum_over_keys(client, "exists", records_of(sorted(shipped), RECORDS))
        return {
            "deliveries": len(ids), "all_terminal": waited, "all_recorded": recorded,
            "all_notified": notified, "all_released": released,
            "used_memory_base": base, "used_memory_accepted": accepted_mem,
            "used_memory_before_release": held_mem, "used_memory_at_most": most_mem,
            "used_memory_released": done_mem,
            "bytes_per_accepted_delivery": round((accepted_mem - base) / count),
            "bytes_per_delivery_before_release": round((held_mem - base) / count),
            "bytes_per_inflight_delivery_upper_bound": round((max(accepted_mem, held_mem, most_mem) - base) / count),
            "bytes_per_completed_delivery": round((done_mem - base) / count),
            "business_log_bytes_per_completed_delivery": round(logs / count),
            "admission_set_bytes_per_completed_delivery": round(admission / count),
            "kept_record_bytes_per_completed_delivery": round(kept / count),
            "counted_bytes_per_delivery": {"accepted": counted_accepted, "before_release": counted_held,
                                           "at_most": counted_most, "released": counted_done},
            "kept_record_bytes_per_delivery_at_most": round(kept_most / count),
            # the declared records of the released deliveries still there: those kept past
            # the release (``KEPT_RECORDS``), each of every shipped delivery, and no other
            "records_left_after_release": records_left,
            "keys_of_one_delivery_at_most": held_keys,
            "keys_of_one_delivery_released": self._keys_of(client, ids[0]) if ids else {},
            "keys_total_after": int(client.dbsize()),
        }

    def _pids(self, *services: str) -> list[int]:
        return [pid for key, proc in self.services.items() if self.service_of(key) in services
                and (pid := proc.pid()) is not None]

    @staticmethod
    def _shared_keys(client: redis.Redis) -> list[str]:
        """The sets every delivery has a member in: admission, deadlines, terminals awaiting release."""
        return [ADMISSION_SET, *deadline_shards(), *(k.decode() for k in client.scan_iter(match="release:*"))]

    def _shared_bytes(self, client: redis.Redis) -> int:
        return _sum_over_keys(client, "memory_usage", self._shared_keys(client))

    def _counted(self, client: redis.Redis, ids: Sequence[str], shared_base: int) -> dict[str, int]:
        """Bytes per delivery counted key by key (MEMORY USAGE): its own keys, and its share
        of the shared sets' growth. ``used_memory`` moves by megabytes with client buffers (a
        service's pipelined batch, a consumer's fetch), hundreds of bytes per delivery at this
        count: the key count is the steady figure, ``used_memory`` the one with everything."""
        own = _sum_over_keys(client, "memory_usage",
                             [key for d in ids for key in state_keys(d, WORKFLOW.released_keys)])
        shared = self._shared_bytes(client) - shared_base
        count = max(1, len(ids))
        return {"own": round(own / count), "shared": round(shared / count),
                "total": round((own + shared) / count)}

    @staticmethod
    def _awaiting_release(client: redis.Redis) -> set[str]:
        """The deliveries whose terminal the supervisor recorded and the release has not taken."""
        return {text(member) for key in client.scan_iter(match="release:*", count=1000)
                for member in client.zrange(key, 0, -1)}

    def _business_log_bytes(self, client: redis.Redis) -> int:
        return _sum_over_keys(client, "memory_usage", BUSINESS_LOGS)

    def _keys_of(self, client: redis.Redis, delivery_id: str) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key in client.scan_iter(match=f"*{delivery_id}*", count=5000):
            name = key.decode()
            found[name.replace(delivery_id, "<id>")] = {
                "type": client.type(key).decode(),  # type: ignore[union-attr]
                "bytes": client.memory_usage(key), "ttl_s": client.ttl(key)}
        for shared in (ADMISSION_SET, deadline_index(delivery_id), *BUSINESS_LOGS, fleet.booking_key):
            if client.exists(shared):
                found[f"(shared) {shared}"] = {"type": client.type(shared).decode(),  # type: ignore[union-attr]
                                               "bytes": client.memory_usage(shared),
                                               "ttl_s": client.ttl(shared)}
        return found


# -- the whole run ----------------------------------------------------------------------------


@contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) while the block runs, and let go after it whatever
    happens; one that died meanwhile is skipped."""
    _signal(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal(pids, signal.SIGCONT)


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(predicate: Callable[[], bool], timeout_s: float, period_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(period_s)
    return True


def script_items(before: Mapping[str, float], after: Mapping[str, float], deliveries: int) -> dict[str, float]:
    """The services' script items per delivery by script (``choreo_redis_script_items_total``'s
    ``script`` label; an effect's is ``effect:<name>``, a begin an effect rides in
    ``begin+<name>``), most first: where the items go."""
    if deliveries <= 0:
        return {}
    first = metric_by_label(before, SCRIPT_ITEMS, "script")
    found = {script: round((count - first.get(script, 0.0)) / deliveries, 2)
             for script, count in metric_by_label(after, SCRIPT_ITEMS, "script").items()}
    return dict(sorted(((k, v) for k, v in found.items() if v > 0), key=lambda item: -item[1]))


def redis_commands(before: dict[str, Any], after: dict[str, Any], deliveries: int) -> dict[str, Any]:
    """Redis's own count of calls and CPU µs per command (``INFO commandstats``) between two
    moments, per delivery: which commands (a script runs as ``evalsha``) Redis's CPU goes to."""
    if deliveries <= 0:
        return {}
    found = {}
    for name, stats in after.items():
        first = before.get(name, {"calls": 0, "usec": 0})
        calls, usec = stats["calls"] - first["calls"], stats["usec"] - first["usec"]
        if calls > 0:
            found[name.removeprefix("cmdstat_")] = {"calls": round(calls / deliveries, 2),
                                                    "usec": round(usec / deliveries, 1)}
    return dict(sorted(found.items(), key=lambda item: -item[1]["usec"]))


def cpu_budget(processes: dict[str, dict[str, Any]], deliveries: int, seconds: float,
               idle_pct: dict[str, float] | None = None) -> dict[str, Any]:
    """CPU per delivery by process, and the rate that 100% of every core would allow at that
    cost: a figure that the machine's other load disturbs far less than wall-clock rates.
    ``net`` figures first take away what each process burns when idle (polling consumers,
    lag and deadline scans) over the run's length, which a longer run pays more of."""
    if deliveries <= 0:
        return {}
    idle_pct = idle_pct or {}
    per = {name: round(1e6 * p["cpu_s"] / deliveries) for name, p in processes.items()}
    net = {name: round(1e6 * max(0.0, p["cpu_s"] - idle_pct.get(name, 0.0) / 100 * seconds)
                       / deliveries) for name, p in processes.items()}
    total_us, net_us = sum(per.values()), sum(net.values())
    # the JVM's compiler threads: warm-up work a long-running broker has done long ago
    jit_us = sum(round(1e6 * compiler_seconds(p.get("cpu_s_by_thread", {})) / deliveries)
                 for p in processes.values())
    cores = os.cpu_count() or 1
    return {"cpu_us_per_delivery": per, "total_cpu_us_per_delivery": total_us,
            "cpu_bound_deliveries_per_s": round(cores * 1e6 / total_us, 1) if total_us else 0.0,
            "net_cpu_us_per_delivery": net, "net_total_cpu_us_per_delivery": net_us,
            "net_cpu_bound_deliveries_per_s": round(cores * 1e6 / net_us, 1) if net_us else 0.0,
            "jit_cpu_us_per_delivery": jit_us}


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return summarise_repeats(runs, ["deliveries_per_s", "events_per_s", "latency.p50_ms",
                                    "latency.p95_ms", "latency.p99_ms", "latency.max_ms",
                                    "cpu.total_cpu_us_per_delivery", "cpu.cpu_bound_deliveries_per_s",
                                    "cpu.net_total_cpu_us_per_delivery",
                                    "cpu.net_cpu_bound_deliveries_per_s", "cpu.jit_cpu_us_per_delivery"])


def evaluate(summary: dict[str, Any]) -> dict[str, Any]:
    """Each target of the state model with the measured figure, met or not, and by how much
    (a figure the run did not measure, for instance no open-loop run at 100/s, is None)."""
    def check(value: float | None, target: float, higher_is_better: bool) -> dict[str, Any]:
        if value is None:
            return {"target": target, "measured": None, "met": None}
        met = value >= target if higher_is_better else value <= target
        factor = (target / value if higher_is_better else value / target) if value else float("inf")
        return {"target": target, "measured": value, "met": met,
                "off_by_factor": None if met else round(factor, 2)}

    retained = check(summary.get("redis_bytes_retained_per_completed"),
                     TARGETS["redis_bytes_retained_per_completed"], False)
    retained.update({
        "of_which_runtime_tombstone": summary.get("redis_runtime_bytes_retained_per_completed"),
        "of_which_business_logs": summary.get("redis_business_log_bytes_per_completed"),
        "of_which_admission_set": summary.get("redis_admission_set_bytes_per_completed"),
        "of_which_kept_records": summary.get("redis_kept_record_bytes_per_completed")})
    return {
        "ratio_tuned": check(summary.get("ratio_tuned"), TARGETS["ratio_tuned"], True),
        "p50_ms_at_100_offered": check(summary.get("p50_ms_at_100"), TARGETS["p50_ms_at_100"], False),
        "p99_ms_at_100_offered": check(summary.get("p99_ms_at_100"), TARGETS["p99_ms_at_100"], False),
        "p99_ms_at_half_capacity": check(summary.get("p99_ms_at_half_capacity"),
                                         TARGETS["p99_ms_at_half_capacity"], False),
        "max_service_peak_rss_mb": check(summary.get("max_service_peak_rss_mb"),
                                         TARGETS["rss_mb_per_service"], False),
        "redis_bytes_per_inflight_delivery": check(summary.get("redis_bytes_per_inflight"),
                                                   TARGETS["redis_bytes_per_inflight"], False),
        "redis_bytes_retained_per_completed": retained,
        "redis_script_items_per_delivery": check(summary.get("redis_script_items_per_delivery"),
                                                 TARGETS["redis_script_items_per_delivery"], False),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    private = Private.at(args.stack_dir, args.redis_cluster)
    private.activate()
    bench = Bench(args, private)
    result: dict[str, Any] = {
        **run_header("bench.pipeline"),
        "config": {"deliveries": args.deliveries, "repeats": args.repeats, "warmup": args.warmup,
                   "rates": args.rates, "warm_jit_pct": args.warm_jit_pct,
                   "warm_max_seconds": args.warm_max_seconds, "warm_max_rounds": args.warm_max_rounds,
                   "open_seconds": args.open_seconds, "partitions": args.partitions,
                   "ceiling_scale": args.ceiling_scale, "tuned_scale": args.tuned_scale,
                   "instances_per_service": args.instances, "drivers": args.drivers, "log_level": args.log_level,
                   "stack": "private (own Kafka, Redis, registry on free ports)",
                   "redis": "a Redis Cluster of 3 masters and 3 replicas" if args.redis_cluster else "one node",
                   "redis_wait_replicas": settings().redis_wait_replicas},
        "hops": dataclasses.asdict(bench.hops),
    }
    try:
        bench.start()
        log(f"warm-up: rounds of {args.warmup} deliveries on every measured path until the broker "
            f"stops compiling")
        result["warmup"] = bench.pipeline_run(args.warmup, 0, "warmup")
        bench.samples = bench.capture_samples()
        result["warm_up"] = bench.warm()
        time.sleep(2.0)  # a fresh broker settles (topic creation, group and txn coordinators)
        result["idle"] = bench.idle()
        log(f"idle stack: {result['idle']['total_cpu_pct']}% CPU ({result['idle']['cpu_pct']})")
        result["message_bytes"] = {t: {"value": len(r.value), "with_headers": r.size}
                                   for t, r in bench.samples.items()}
        runs: list[dict[str, Any]] = []
        for r in range(args.repeats):
            pipeline = bench.pipeline_run(args.deliveries, 0, f"closed-{r}")
            txn = bench.ceiling_run(args.deliveries * args.ceiling_scale, True, f"txn-{r}")
            plain = bench.ceiling_run(args.deliveries * args.ceiling_scale, False, f"plain-{r}")
            tuned = bench.ceiling_run(args.deliveries * args.tuned_scale, True, f"tuned-{r}", tuned=True)
            runs.append({
                "repeat": r, "pipeline": pipeline, "ceiling_transactional": txn, "ceiling_plain": plain,
                "ceiling_tuned": tuned,
                "ratio": _ratio(pipeline, txn), "ratio_vs_plain": _ratio(pipeline, plain),
                "ratio_tuned": _ratio(pipeline, tuned),
            })
        result["runs"] = runs
        # half of the capacity just measured: the latency a sized deployment runs at
        half = statistics.median(run_["pipeline"]["deliveries_per_s"] for run_ in runs) / 2
        result["half_capacity_per_s"] = round(half, 1)
        open_loop: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in range(args.repeats):
            for name, offered in [*((str(int(rate_)), rate_) for rate_ in args.rates), (HALF, half)]:
                n = max(1, int(offered * args.open_seconds))
                open_loop[name].append(bench.pipeline_run(n, offered, f"open-{name}-{r}"))
        result["open_loop"] = dict(open_loop)
        if args.profile:
            log(f"profiling {', '.join(args.profile)} under closed-loop load")
            result["profile_run"] = bench.pipeline_run(args.deliveries, 0, "profile", args.profile)
            if "kafka" in args.profile:
                result["profile_ceiling_run"] = bench.ceiling_run(args.deliveries, True, "profile-txn",
                                                                  profile_broker=True)
        result["memory"] = bench.memory_probe(min(1000, args.deliveries))
        all_procs = [run_["pipeline"]["processes"] for run_ in runs]
        result["peak_rss_mb"] = {name: max(p.get(name, {}).get("peak_rss_mb", 0.0) for p in all_procs)
                                 for name in [*bench.services, *private.pids()]}
    finally:
        bench.stop()
        private.stop(keep=args.keep_stack)
    result["machine"]["load_average_after"] = load_average()
    result["summary"] = summarise(result, bench)
    result["targets"] = evaluate(result["summary"])
    result["summary"]["targets_met"] = {k: v["met"] for k, v in result["targets"].items()}
    return result


def _ratio(pipeline: dict[str, Any], ceiling: dict[str, Any]) -> float:
    """The pipeline's events/s as a share of a ceiling's."""
    return round(pipeline["events_per_s"] / ceiling["events_per_s"], 3) if ceiling["events_per_s"] else 0.0


def retained_per_completed(memory: dict[str, Any]) -> int:
    """What a finished delivery leaves in Redis: the larger of ``used_memory``'s growth and
    the key-by-key count (its own keys, its share of the shared sets, the records kept past
    its release, and the business logs). ``used_memory`` alone moves by megabytes with client
    buffers: one run measured -1,003 B per delivery and would have called that flat, with the
    136 B tombstone in place."""
    counted = int(memory["counted_bytes_per_delivery"]["released"]["total"])
    return max(int(memory["bytes_per_completed_delivery"]),
               counted + int(memory["kept_record_bytes_per_completed_delivery"])
               + int(memory["business_log_bytes_per_completed_delivery"]))


def most_held_per_delivery(memory: dict[str, Any]) -> int:
    """The most a delivery holds: its keys once every reader has done its part and the
    release has not run, with the records it keeps past the release (written by then);
    or ``used_memory``'s growth, if larger."""
    counted = int(memory["counted_bytes_per_delivery"]["at_most"]["total"])
    return max(int(memory["bytes_per_inflight_delivery_upper_bound"]),
               counted + int(memory["kept_record_bytes_per_delivery_at_most"]))


def summarise(result: dict[str, Any], bench: Bench) -> dict[str, Any]:
    runs = result["runs"]
    pipe = median_summary([r["pipeline"] for r in runs])
    txn = median_summary([r["ceiling_transactional"] for r in runs])
    plain = median_summary([r["ceiling_plain"] for r in runs])
    tuned = median_summary([r["ceiling_tuned"] for r in runs])
    ratio = summarise_repeats(runs, ["ratio", "ratio_vs_plain", "ratio_tuned"], digits=3)
    open_p99 = {rate_: summarise_repeats(rs, ["latency.p50_ms", "latency.p99_ms", "deliveries_per_s",
                                               "latency_from_schedule.p99_ms"])
                for rate_, rs in result["open_loop"].items()}
    at_100 = open_p99.get("100", {})
    services_rss = [v for k, v in result["peak_rss_mb"].items() if k in bench.services]
    return {
        "deliveries_per_s": pipe["deliveries_per_s"]["median"],
        "events_per_s": pipe["events_per_s"]["median"],
        "ceiling_transactional_events_per_s": txn["events_per_s"]["median"],
        "ceiling_plain_events_per_s": plain["events_per_s"]["median"],
        "ceiling_tuned_events_per_s": tuned["events_per_s"]["median"],
        "ratio": ratio["ratio"]["median"],
        "ratio_vs_plain": ratio["ratio_vs_plain"]["median"],
        "ratio_tuned": ratio["ratio_tuned"]["median"],
        "pipeline": pipe, "ceiling_transactional": txn, "ceiling_plain": plain, "ceiling_tuned": tuned,
        "ratios": ratio,
        "open_loop": open_p99,
        "p50_ms_at_100": at_100.get("latency.p50_ms", {}).get("median"),
        "p99_ms_at_100": at_100.get("latency.p99_ms", {}).get("median"),
        "half_capacity_per_s": result["half_capacity_per_s"],
        "p99_ms_at_half_capacity": open_p99[HALF]["latency.p99_ms"]["median"],
        "max_service_peak_rss_mb": max(services_rss) if services_rss else None,
        "peak_rss_mb": result["peak_rss_mb"],
        # the larger of the two measures (used_memory moves with client buffers; see _counted)
        "redis_bytes_per_inflight": most_held_per_delivery(result["memory"]),
        "redis_counted_bytes_per_delivery": result["memory"]["counted_bytes_per_delivery"],
        "redis_bytes_per_accepted": result["memory"]["bytes_per_accepted_delivery"],
        "redis_bytes_before_release": result["memory"]["bytes_per_delivery_before_release"],
        "redis_bytes_retained_per_completed": retained_per_completed(result["memory"]),
        "redis_runtime_bytes_retained_per_completed": result["memory"]["counted_bytes_per_delivery"]["released"]["own"],
        "redis_business_log_bytes_per_completed": result["memory"]["business_log_bytes_per_completed_delivery"],
        "redis_admission_set_bytes_per_completed": result["memory"]["admission_set_bytes_per_completed_delivery"],
        "redis_kept_record_bytes_per_completed": result["memory"]["kept_record_bytes_per_completed_delivery"],
        "redis_script_items_per_delivery": summarise_repeats(
            [r["pipeline"] for r in runs], ["redis_script_items_per_delivery"])["redis_script_items_per_delivery"]["median"],
        "hops_per_delivery": {"produced": bench.hops.produced, "consumed": bench.hops.consumed},
        "broker_warm": result["warm_up"]["warm"],
        "warm_up_seconds": result["warm_up"]["seconds"],
        "load_average": {"before": result["machine"]["load_average_before"],
                         "after": result["machine"]["load_average_after"]},
    }


def _rounds(text: str) -> int:
    """A count of warm-up rounds: 0 or more."""
    rounds = int(text)
    if rounds < 0:
        raise argparse.ArgumentTypeError(f"{text} rounds: a count is 0 or more")
    return rounds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deliveries", "-n", type=int, default=2000, help="deliveries per closed-loop run")
    parser.add_argument("--repeats", "-r", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2000,
                        help="deliveries of the warm-up (pipeline, then ceiling) before measuring")
    parser.add_argument("--warm-jit-pct", type=float, default=5.0,
                        help="the warm-up ends once a round keeps the broker's JIT compilers at or "
                             "below this share of a core")
    parser.add_argument("--warm-max-seconds", type=float, default=300.0,
                        help="the warm-up ends after this long even if the broker still compiles "
                             "(the JSON then says warm: false)")
    parser.add_argument("--warm-max-rounds", type=_rounds, default=None,
                        help="the warm-up ends after this many rounds (0: none, the short form that "
                             "checks the figures, not their values)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",") if x],
                        default=[100.0], help="open-loop offered rates, deliveries/s (besides half the "
                                              "measured capacity, which always runs)")
    parser.add_argument("--open-seconds", type=float, default=2.0, help="length of each open-loop run")
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--ceiling-scale", type=int, default=CEILING_SCALE,
                        help="the like-for-like ceilings run this many times --deliveries")
    parser.add_argument("--tuned-scale", type=int, default=TUNED_SCALE,
                        help="the throughput-tuned ceiling runs this many times --deliveries")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="Redis as a Redis Cluster of three masters with a replica each")
    parser.add_argument("--instances", type=int, default=1, help="processes per service")
    parser.add_argument("--drivers", type=int, default=1,
                        help="submitting processes (the Python producer API), sharing N and the rate")
    parser.add_argument("--log-level", default="INFO", help="services' CHOREO_LOG_LEVEL")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for outcomes")
    parser.add_argument("--profile", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="services to profile with py-spy in an extra closed-loop run "
                             "('ingestion' profiles the submitting driver; 'kafka' the broker, "
                             "with Java Flight Recorder, and then one transactional ceiling run)")
    parser.add_argument("--profile-top", type=int, default=15)
    parser.add_argument("--profile-idle", action="store_true",
                        help="sample idle (blocked) threads too: a wall-clock profile")
    add_private_stack_options(parser, "pipeline.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    summary = {k: v for k, v in result["summary"].items()
               if k not in ("pipeline", "ceiling_transactional", "ceiling_plain", "ceiling_tuned", "ratios",
                            "peak_rss_mb")}
    write_figures(Path(args.out), result, summary)


if __name__ == "__main__":
    main()
