"""The demo: the whole choreography for real, as a user would run it.

Starts the local stack and every service as its own process, registers the contracts,
submits deliveries through the HTTP endpoint, waits for each to end, and reports what
happened. The last line printed is one JSON object; the exit code is non-zero if any
delivery was lost or is stuck.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from confluent_kafka import Consumer, TopicPartition
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from choreo import contracts, topology
from choreo.config import settings
from choreo.kafka import base_config, admin as kafka_admin, headers_if_readable
from choreo.envelope import Envelope
from choreo.runtime_events import RUNTIME_EVENTS
from choreo.serde import Decoder, registry_client
from consumers.workflow import WORKFLOW
from infra import stack
from infra.process import ManagedProcess, StackError
from infra.services import ingestion_process, pipeline_specs, service_process
from schemas.models import DeliveryFailed

# every topic of the workflow but dead letters and the compacted log: a delivery's timeline
_TOPOLOGY = topology.derive(WORKFLOW)
WATCHED = sorted(t for t in _TOPOLOGY.partitions if not t.endswith(".dlq") and t not in _TOPOLOGY.configs)
# the event that confirms each undo -> the step it undoes (the services' declarations)
UNDONE_BY = {confirmed.topic: forward for forward, (_, confirmed) in WORKFLOW.compensations().items()}


@dataclass
class Seen:
    """What the demo observed of one delivery, from committed events only."""

    accepted_at: float = 0.0
    terminal: list[str] = field(default_factory=list)
    terminal_at: float = 0.0
    compensate: list[str] = field(default_factory=list)
    compensated: set[str] = field(default_factory=set)
    timeline: list[tuple[float, str, str, int]] = field(default_factory=list)


class Observer:
    """A read_committed consumer over the pipeline's topics, started at their current end."""

    def __init__(self) -> None:
        self.consumer = Consumer({
            **base_config(),
            "group.id": "demo-observer", "enable.auto.commit": False,
            "isolation.level": "read_committed", "fetch.wait.max.ms": 10,
        })
        meta = self.consumer.list_topics(timeout=10)
        # start at each partition's current end, so only this run's events are observed
        self.consumer.assign([
            TopicPartition(t, p, self.consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1])
            for t in WATCHED for p in meta.topics[t].partitions
        ])
        self.failed = Decoder(DeliveryFailed, "delivery.failed", registry_client())
        self.deliveries: dict[str, Seen] = defaultdict(Seen)
        self.lock = threading.Lock()
        self._stop = False
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Observer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.consumer.close()

    def _run(self) -> None:
        try:
            self._observe()
        except Exception as exc:  # the demo must say why it saw nothing, not hang
            self.error = f"{type(exc).__name__}: {exc}"
            raise

    def _observe(self) -> None:
        while not self._stop:
            for msg in self.consumer.consume(500, 0.2):
                key, topic = msg.key(), msg.topic()
                if msg.error() or key is None or topic is None:
                    continue
                env = Envelope.from_headers(headers_if_readable(msg))
                now = time.monotonic()
                delivery = key.decode(errors="replace")
                with self.lock:
                    seen = self.deliveries[delivery]
                    seen.timeline.append((now, topic, env.producer if env else "?",
                                          env.attempt if env else 0))
                    if topic in WORKFLOW.terminal_topics:
                        seen.terminal.append(topic)
                        seen.terminal_at = seen.terminal_at or now
                    if msg.topic() == "delivery.failed":
                        seen.compensate = list(self.failed(msg.value()).compensate)
                    if topic in UNDONE_BY:
                        seen.compensated.add(UNDONE_BY[topic])


def _start_services(env: dict[str, str], timeout_s: float = 60.0) -> list[ManagedProcess]:
    specs = pipeline_specs()
    procs = [service_process(spec, env) for spec in specs]
    for proc in procs:
        proc.start(timeout_s=30)
    wait_for_groups(sorted({spec.name for spec in specs}), timeout_s)
    return procs


def wait_for_groups(groups: list[str], timeout_s: float) -> None:
    """Wait until every service's consumer group is stable with its partitions assigned, so
    the first deliveries do not wait for group joins (and the latencies measure the pipeline)."""
    admin = kafka_admin()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        futures = admin.describe_consumer_groups(groups, request_timeout=5)
        try:
            states = {g: f.result(timeout=5) for g, f in futures.items()}
        except Exception:  # a group that does not exist yet fails its future
            time.sleep(0.3)
            continue
        if all(str(d.state).endswith("STABLE") and d.members and
               all(m.assignment.topic_partitions for m in d.members) for d in states.values()):
            return
        time.sleep(0.3)
    raise StackError(f"consumer groups {groups} did not become stable within {timeout_s:.0f}s; "
                     f"see the service logs in {settings().data_dir / 'services'}")


@dataclass(frozen=True)
class Outage:
    """Kill one service (kill -9) this long after submission starts; restart it after ``down_s``."""

    service: str
    after_s: float
    down_s: float


def run(requests: int, concurrency: int = 16, timeout_s: float = 120.0, seed: int = 7,
        env: dict[str, str] | None = None, console: Console | None = None,
        outage: Outage | None = None) -> dict[str, Any]:
    console = console or Console(stderr=True)
    rng = random.Random(seed)
    run_id = uuid.uuid4().hex[:12]  # retries of one request share a key; runs do not
    console.print("[bold]starting the local stack[/] (Kafka, Redis, schema registry)")
    stack.start()
    topology.create(WORKFLOW)
    contracts.register(contracts.topic_models(WORKFLOW, RUNTIME_EVENTS))
    url = os.environ.get("INGESTION_URL", "http://127.0.0.1:8000")
    services = _start_services(env or {})
    ingestion = ingestion_process(url, env)
    ingestion.start(timeout_s=60)
    observer = Observer().start()
    accepted: dict[str, float] = {}
    refused = 0
    try:
        with httpx.Client(base_url=url, timeout=30) as http, Progress(console=console) as progress:
            task = progress.add_task("submitting deliveries", total=requests)

            def submit(n: int) -> str | None:
                body = {
                    "owner_id": f"owner-{n % 17}",
                    "pickup": {"lat": 52.5 + rng.random() / 10, "lon": 13.4, "address": f"{n} Pickup St"},
                    "dropoff": {"lat": 52.4, "lon": 13.3 + rng.random() / 10, "address": f"{n} Drop Rd"},
                    "package_size": rng.choice(["SMALL", "MEDIUM", "LARGE"]),
                    "weight_kg": round(rng.uniform(0.2, 20.0), 2),
                }
                for _ in range(20):
                    response = http.post("/deliveries", json=body, headers={"Idempotency-Key": f"demo-{run_id}-{n}"})
                    if response.status_code == 202:
                        delivery_id = str(response.json()["delivery_id"])
                        with observer.lock:
                            accepted[delivery_id] = time.monotonic()
                        progress.advance(task)
                        return delivery_id
                    if response.status_code != 429:
                        break
                    time.sleep(float(response.headers.get("Retry-After", "1")))
                progress.advance(task)
                return None

            if outage is not None:
                threading.Thread(target=_inject, args=(outage, services, console), daemon=True).start()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(submit, range(requests)))
            refused = sum(1 for r in results if r is None)
            wait = progress.add_task("waiting for every delivery to end", total=len(accepted))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if observer.error:
                    raise RuntimeError(f"the demo's observer failed: {observer.error}")
                with observer.lock:
                    done = sum(1 for d in accepted if observer.deliveries[d].terminal)
                progress.update(wait, completed=done)
                if done == len(accepted):
                    break
                time.sleep(0.2)
            time.sleep(1.0)  # let compensation events of the last failures arrive
    finally:
        observer.stop()
        ingestion.stop()
        for proc in services:
            proc.stop()
    return _summarise(requests, refused, accepted, observer, console)


def _inject(outage: Outage, services: list[ManagedProcess], console: Console) -> None:
    victim = next(p for p in services if p.name.startswith(f"{outage.service}-"))
    time.sleep(outage.after_s)
    victim.kill()
    console.print(f"[yellow]outage:[/] {victim.name} killed (kill -9) for {outage.down_s:.0f}s")
    time.sleep(outage.down_s)
    victim.start(timeout_s=30)
    console.print(f"[yellow]outage:[/] {victim.name} restarted")


def _summarise(requests: int, refused: int, accepted: dict[str, float], observer: Observer,
               console: Console) -> dict[str, Any]:
    seen = {d: observer.deliveries[d] for d in accepted}
    shipped = [d for d, s in seen.items() if s.terminal[:1] == ["delivery.shipped"]]
    failed = [d for d, s in seen.items() if s.terminal[:1] == ["delivery.failed"]]
    doubled = [d for d, s in seen.items() if len(s.terminal) > 1]
    lost = [d for d, s in seen.items() if not s.terminal]
    compensated = [d for d in failed
                   if set(seen[d].compensate) <= seen[d].compensated]
    requeued = [d for d, s in seen.items() if any(t.startswith("retry.") for _, t, _, _ in s.timeline)]
    latencies = sorted((s.terminal_at - accepted[d]) * 1000 for d, s in seen.items() if s.terminal)

    def pct(p: float) -> float:
        if not latencies:
            return 0.0
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 1)

    table = Table("outcome", "deliveries", title="drone-delivery demo")
    for label, count in [("requested", requests), ("accepted", len(accepted)), ("refused (429)", refused),
                         ("shipped", len(shipped)), ("failed", len(failed)),
                         ("failed and compensated", len(compensated)),
                         ("requeued by the supervisor", len(requeued)),
                         ("more than one outcome", len(doubled)), ("lost / stuck", len(lost))]:
        table.add_row(label, str(count))
    console.print(table)
    if latencies:
        console.print(f"end-to-end latency (accepted → outcome committed): p50 {pct(0.5)} ms, "
                      f"p95 {pct(0.95)} ms, p99 {pct(0.99)} ms, max {round(latencies[-1], 1)} ms "
                      f"(mean {round(statistics.fmean(latencies), 1)} ms)")
    example = (requeued or failed or shipped or list(seen))[:1]
    if example:
        story = seen[example[0]]
        timeline = Table("+ms", "topic", "by", "attempt", title=f"timeline of delivery {example[0]}")
        start = accepted[example[0]]
        for at, topic, producer, attempt in sorted(story.timeline):
            timeline.add_row(f"{(at - start) * 1000:.1f}", topic, producer, str(attempt))
        console.print(timeline)
    return {
        "requested": requests, "accepted": len(accepted), "refused": refused,
        "shipped": len(shipped), "failed": len(failed), "compensated": len(compensated),
        "requeued": len(requeued),
        "doubled": len(doubled), "lost": len(lost),
        "p50_ms": pct(0.5), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
        "max_ms": round(latencies[-1], 1) if latencies else 0.0,
    }


def main_line(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=False)
