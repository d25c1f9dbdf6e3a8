"""Running the whole pipeline as real processes in tests, and reading its outcomes."""

from __future__ import annotations

import os
import signal
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from choreo.publisher import Publisher
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryRequested
from tests.helpers import Record, ServiceProcess, read_topic, wait_for

SERVICES = ["consumers.package:service", "consumers.drone_scheduler:service",
            "consumers.delivery:service", "consumers.notifier:service",
            "choreo.supervisor:service"]


@dataclass
class Pipeline:
    env: dict[str, str] = field(default_factory=dict)
    instances: int = 1
    procs: list[ServiceProcess] = field(default_factory=list)

    def start(self, refs: Iterable[str] = SERVICES) -> Pipeline:
        for ref in refs:
            for n in range(self.instances):
                self.procs.append(ServiceProcess(ref, instance=str(n), env=self.env).start())
        return self

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)


NOTIFIER = "consumers.notifier:service"


@dataclass
class LateNotifier:
    """A pipeline started without its notifier: called, it starts the notifier, as an
    instance of its own."""

    running: Pipeline

    def __call__(self) -> None:
        self.running.procs.append(ServiceProcess(NOTIFIER, instance="late").start())

    @contextmanager
    def paused(self, ref: str) -> Iterator[None]:
        """``ref``'s processes stopped (SIGSTOP) for the block: their work waits."""
        pids = [p.proc.pid for p in self.running.procs if p.ref == ref and p.proc is not None]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)


@contextmanager
def notifier_later(refs: Iterable[str]) -> Iterator[LateNotifier]:
    """``refs`` running (the notifier left out) and a way to start the notifier later;
    everything is killed on exit."""
    running = Pipeline().start(refs)
    try:
        yield LateNotifier(running)
    finally:
        running.kill()


def submit(requests: list[DeliveryRequested]) -> list[str]:
    publisher = Publisher("test-ingestion", WORKFLOW)
    publisher.publish_all([(r, str(uuid.uuid4())) for r in requests])
    return [r.delivery_id for r in requests]


def of(records: list[Record], ids: set[str]) -> list[Record]:
    return [r for r in records if r.key is not None and r.key.decode() in ids]


def terminal_counts(ids: set[str]) -> Counter[str]:
    """How many terminal events (shipped + failed) each delivery has."""
    counts: Counter[str] = Counter()
    for topic in ("delivery.shipped", "delivery.failed"):
        for record in of(read_topic(topic), ids):
            counts[record.key.decode() if record.key else ""] += 1
    return counts


def wait_terminal(ids: set[str], timeout_s: float = 120.0) -> Counter[str]:
    return wait_for(lambda: len(c := terminal_counts(ids)) == len(ids) and c, timeout_s=timeout_s,
                    interval_s=1.0, what=f"{len(ids)} deliveries to end")
