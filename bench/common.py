"""Pure helpers of the benchmarks: statistics, the happy path's hop count, /proc readings,
Prometheus scraping and Redis memory, so the drivers stay short and the logic is testable."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- statistics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is not within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max/mean of a list of latencies in ms, rounded to 0.1 ms."""
    if not latencies_ms:
        return {"count": 0, "p50_ms": 0.0, "p95_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0,
                "mean_ms": 0.0}
    return {
        "count": len(latencies_ms),
        "p50_ms": round(percentile(latencies_ms, 50), 1),
        "p95_ms": round(percentile(latencies_ms, 95), 1),
        "p99_ms": round(percentile(latencies_ms, 99), 1),
        "max_ms": round(max(latencies_ms), 1),
        "mean_ms": round(statistics.fmean(latencies_ms), 1),
    }


@dataclass(frozen=True)
class Spread:
    """The median of repeated measurements with their range, for noisy machines."""

    median: float
    low: float
    high: float
    n: int

    @property
    def spread_pct(self) -> float:
        """(high - low) / median in percent; 0 when the median is 0."""
        return 0.0 if self.median == 0 else 100.0 * (self.high - self.low) / abs(self.median)

    def as_dict(self, digits: int = 1) -> dict[str, float]:
        return {"median": round(self.median, digits), "min": round(self.low, digits),
                "max": round(self.high, digits), "n": self.n,
                "spread_pct": round(self.spread_pct, 1)}


def spread(values: Iterable[float]) -> Spread:
    found = [float(v) for v in values]
    if not found:
        return Spread(0.0, 0.0, 0.0, 0)
    return Spread(statistics.median(found), min(found), max(found), len(found))


def summarise_repeats(runs: Sequence[Mapping[str, Any]], keys: Sequence[str],
                      digits: int = 1) -> dict[str, dict[str, float]]:
    """For each numeric ``key`` (dotted for nested dicts), the median and range over runs."""
    return {key: spread(_dig(run, key) for run in runs).as_dict(digits) for key in keys}


def _dig(data: Mapping[str, Any], dotted: str) -> float:
    value: Any = data
    for part in dotted.split("."):
        value = value[part]
    return float(value)


# -- the happy path as stages ---------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One consume→produce process of the ceiling chain, mirroring one pipeline service.

    ``routes`` maps each input topic to the topic it produces on (None: consume only).
    A ``fan_in`` stage produces once per delivery, when the last of its inputs arrived.
    """

    name: str
    routes: Mapping[str, str | None]
    fan_in: bool = False

    @property
    def inputs(self) -> list[str]:
        return list(self.routes)

    @property
    def outputs(self) -> list[str]:
        return sorted({t for t in self.routes.values() if t is not None})


SOURCE_TOPIC = "delivery.requested"
TERMINAL_TOPIC = "delivery.shipped"

# The happy path of one delivery through the real services (no failure injected): which
# service consumes what and produces what. tests/unit/test_bench.py checks it against the
# services' own declarations, so it cannot drift from the workflow silently.
HAPPY_PATH: tuple[Stage, ...] = (
    Stage("package", {"delivery.requested": "package.ready"}),
    Stage("drone-scheduler", {"delivery.requested": "drone.scheduled"}),
    Stage("delivery", {"package.ready": "delivery.shipped", "drone.scheduled": "delivery.shipped"},
          fan_in=True),
    Stage("notifier", {"delivery.shipped": None}),
    Stage("supervisor", {"delivery.shipped": None}),  # records it for choreo.release
)


@dataclass(frozen=True)
class Hops:
    """Messages per delivery on each topic, and the totals a chain of stages moves."""

    per_topic: dict[str, int]
    produced: int  # records written per delivery (the source's included)
    consumed: int  # records read by stages per delivery (produce→consume hops)
    topics: int = field(default=0)


def hop_count(stages: Sequence[Stage], source: str = SOURCE_TOPIC) -> Hops:
    """Propagate one source record through ``stages``: how many records each topic gets,
    how many are produced in all and how many consumed (each consuming stage reads its own
    copy). A fan-in stage emits once per delivery, whatever the number of inputs."""
    counts: dict[str, int] = {source: 1}
    for _ in range(len(stages) + 1):  # enough passes for any acyclic order of stages
        new: dict[str, int] = {source: 1}
        for stage in stages:
            if stage.fan_in:
                by_output: dict[str, list[int]] = {}
                for topic, out in stage.routes.items():
                    if out is not None:
                        by_output.setdefault(out, []).append(counts.get(topic, 0))
                for out, ins in by_output.items():
                    new[out] = new.get(out, 0) + min(ins)
            else:
                for topic, out in stage.routes.items():
                    if out is not None:
                        new[out] = new.get(out, 0) + counts.get(topic, 0)
        if new == counts:
            break
        counts = new
    else:
        raise ValueError("the stages form a cycle: the hop count does not settle")
    consumed = sum(counts.get(topic, 0) for stage in stages for topic in stage.inputs)
    return Hops(dict(sorted(counts.items())), sum(counts.values()), consumed, len(counts))


# -- processes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcSample:
    cpu_s: float  # user + system seconds since the process started
    rss_kb: int
    hwm_kb: int  # peak resident set size (VmHWM)


def parse_stat_cpu(stat_line: str, clk_tck: int = CLK_TCK) -> float:
    """utime + stime in seconds from a /proc/<pid>/stat line (the name may hold spaces)."""
    fields = stat_line.rsplit(")", 1)[1].split()
    # after the name: state is field 3, utime 14 and stime 15 (1-based) of the full line
    return (int(fields[11]) + int(fields[12])) / clk_tck


def parse_status_kb(status_text: str, name: str) -> int:
    for line in status_text.splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def sample_process(pid: int) -> ProcSample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return ProcSample(parse_stat_cpu(stat), parse_status_kb(status, "VmRSS"),
                      parse_status_kb(status, "VmHWM"))


# a JVM names its threads after their pool and index ("data-plane-kafka-request-handler-3",
# "GC Thread#1"; Linux keeps the first 15 characters): one group per pool
_THREAD_INDEX = re.compile(r"[-_ #]?\d+$")


def thread_group(comm: str) -> str:
    return _THREAD_INDEX.sub("", comm.strip()) or comm.strip()


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread group of a process, from /proc/<pid>/task: exact, where a
    sampling profiler sees only threads running Java code (not GC, JIT or native I/O)."""
    groups: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return groups
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        name = thread_group(comm)
        groups[name] = groups.get(name, 0.0) + parse_stat_cpu(stat)
    return groups


def compiler_seconds(by_thread: Mapping[str, float]) -> float:
    """CPU seconds of a JVM's JIT compiler threads (C1, C2) in a ``thread_cpu`` split."""
    return sum(c for group, c in by_thread.items() if "Compiler" in group)


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


# -- Prometheus -----------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {'name{label="v",...}': value} for every sample (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return found


def metric_sum(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(w in rest for w in wanted):
            total += value
    return total


def metric_growth(before: Mapping[str, float], after: Mapping[str, float], name: str, **labels: str) -> float:
    """How much ``metric_sum`` grew from one scrape to the next."""
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def metric_by_label(samples: Mapping[str, float], name: str, label: str) -> dict[str, float]:
    """The sum of ``name``'s samples per value of ``label``."""
    totals: dict[str, float] = {}
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        found = re.search(rf'(?:^|,){re.escape(label)}="([^"]*)"', rest) if base == name else None
        if found:
            totals[found.group(1)] = totals.get(found.group(1), 0.0) + value
    return totals


def batch_figures(before: Mapping[str, float], after: Mapping[str, float], service: str,
                  seconds: float, deliveries: int) -> dict[str, float | dict[str, float]]:
    """Transactions (batches), their mean size and rate, aborts, and each phase of a batch
    between two scrapes: its mean time, and its CPU per delivery."""
    count = metric_growth(before, after, "choreo_batch_size_count", service=service)
    total = metric_growth(before, after, "choreo_batch_size_sum", service=service)
    return {
        "transactions": count,
        "events_in_batches": total,
        "mean_batch": round(total / count, 1) if count else 0.0,
        "transactions_per_s": round(count / seconds, 1) if seconds > 0 else 0.0,
        "aborts": metric_growth(before, after, "choreo_transaction_aborts_total", service=service),
        "mean_ms_by_phase": phase_means(before, after, service),
        "cpu_us_per_delivery_by_phase": phase_cpu(before, after, service, deliveries),
    }


BATCH_PHASES = ("consume", "decode", "begin", "handlers", "finish", "offsets", "commit")


def phase_means(before: Mapping[str, float], after: Mapping[str, float],
                service: str) -> dict[str, float]:
    """Mean milliseconds per batch in each phase of the runner (``choreo_batch_phase_seconds``)
    between two scrapes: where a hop's latency goes."""
    means: dict[str, float] = {}
    for phase in BATCH_PHASES:
        seconds, count = (metric_growth(before, after, f"choreo_batch_phase_seconds_{part}",
                                        service=service, phase=phase) for part in ("sum", "count"))
        if count:
            means[phase] = round(seconds / count * 1000, 1)
    return means


def phase_cpu(before: Mapping[str, float], after: Mapping[str, float], service: str,
              deliveries: int) -> dict[str, float]:
    """CPU microseconds of the runner's batch loop per delivery in each phase
    (``choreo_batch_phase_cpu_seconds``) between two scrapes: what a phase costs the loop
    itself, where ``phase_means`` also counts its waits."""
    cpu: dict[str, float] = {}
    for phase in BATCH_PHASES:
        seconds = metric_growth(before, after, "choreo_batch_phase_cpu_seconds_total",
                                service=service, phase=phase)
        if seconds and deliveries > 0:
            cpu[phase] = round(seconds / deliveries * 1e6, 1)
    return cpu


# -- misc -----------------------------------------------------------------------------------


def free_port(count: int = 1, offset: int = 0) -> int:
    """A free loopback port and the ``count - 1`` after it (Kafka's controller; a Redis
    Cluster's nodes), each with its port ``+ offset`` free too when ``offset`` is set (a
    cluster node's bus)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        wanted = [port + n for n in range(count)]
        if wanted[-1] + offset <= 65535 and _all_free([*wanted[1:], *(p + offset for p in wanted if offset)]):
            return port
    raise RuntimeError(f"no {count} free ports in a row found")


def _all_free(ports: Sequence[int]) -> bool:
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def rate(count: float, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


def run_header(module: str) -> dict[str, Any]:
    """What every figures file starts with: the command that made it, when, and on what
    machine under what load (these machines are shared: the load says how to read it)."""
    return {
        "command": " ".join([".venv/bin/python", "-m", module, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "load_average_before": load_average()},
    }


def write_figures(out: Path, result: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
    """A benchmark's end: every figure to ``out`` (its path printed), then the summary as
    the last line printed, one JSON object."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(out)
    print(json.dumps(summary, separators=(",", ":")))


def run_and_write(run: Callable[[Any], Mapping[str, Any]], args: Any) -> None:
    """Run a benchmark whose figures hold their own ``summary`` and write both (``args.out``)."""
    result = run(args)
    write_figures(Path(args.out), result, result["summary"])
