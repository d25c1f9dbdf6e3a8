"""Test helpers: services as real processes, and reading topics as a read_committed client."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, ConsumerGroupState, KafkaException, TopicPartition

from choreo.config import settings
from choreo.kafka import admin, headers_if_readable
from choreo.envelope import Envelope, header_value
from choreo.state import deadline_shards, delivery_key
from infra.process import port_in_use

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ServiceProcess:
    """``choreo run REF`` in its own process (own log file), so kill -9 is real."""

    ref: str
    instance: str = "0"
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = REPO / ".stack" / "test-logs"
    workflow: str = "consumers.workflow:WORKFLOW"
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"{self.ref.replace(':', '_')}-{self.instance}.log"

    def start(self) -> ServiceProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infra.cli", "run", self.ref, "--instance", self.instance,
             "--workflow", self.workflow, *self.args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
        )
        return self

    def stop(self, timeout_s: float = 20) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp_ms: int = 0  # the producer's create time

    @property
    def envelope(self) -> Envelope | None:
        return Envelope.from_headers(self.headers)

    def header(self, name: str) -> str | None:
        return header_value(self.headers, name)


def read_topic(topic: str, timeout_s: float = 10.0) -> list[Record]:
    """Everything committed in ``topic`` right now (read_committed, from the beginning to the end)."""
    consumer = Consumer({
        "bootstrap.servers": settings().kafka_bootstrap_servers,
        "group.id": "reader-unused", "enable.auto.commit": False,
        "isolation.level": "read_committed", "auto.offset.reset": "earliest",
    })
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s).topics[topic]
        ends = {}
        for p in meta.partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if high > low:
                ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        records: list[Record] = []
        done: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < len(ends) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                # with read_committed the last offsets may be transaction markers: check position
                for tp in consumer.position([TopicPartition(topic, p) for p in ends]):
                    if tp.offset >= ends[tp.partition]:
                        done.add(tp.partition)
                continue
            records.append(Record(topic, msg.partition(), msg.offset(), msg.key(), msg.value(),
                                  list(headers_if_readable(msg) or []), msg.timestamp()[1]))
            if msg.offset() + 1 >= ends[msg.partition()]:
                done.add(msg.partition())
        return records
    finally:
        consumer.close()


def wait_for(predicate: Callable[[], Any], timeout_s: float = 60.0, interval_s: float = 0.5,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# Test servers listen below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
# 32768-60999 on Debian): a port from that range can become the local end of any outgoing
# connection the moment a test's server on it dies, and its restart on the same port then
# finds it taken (seen in a clean-clone run). No fixed port of the stacks lies in here.
SERVER_PORTS = range(30000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing holds, outside the ephemeral range, not handed out before in this run."""
    for port in random.sample(SERVER_PORTS, len(SERVER_PORTS)):
        if port not in _handed_out and not port_in_use("127.0.0.1", port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port left in {SERVER_PORTS}")


def start_group_at_end(group: str, topic: str, wait_s: float = 30.0) -> None:
    """Commit ``group`` at the end of ``topic``: a new group joins a shared topic where a
    deployed one would, not at its history. A member of the group killed just before (an
    earlier test's) refuses the commit until its session times out: it is tried again."""
    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers, "group.id": group,
                         "enable.auto.commit": False})
    deadline = time.monotonic() + wait_s
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = [TopicPartition(topic, p, consumer.get_watermark_offsets(
            TopicPartition(topic, p), timeout=10)[1]) for p in partitions]
        while True:
            try:
                consumer.commit(offsets=ends, asynchronous=False)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
    finally:
        consumer.close()


def consuming(group: str, members: int | None = None, clients: Iterable[str] = ()) -> bool:
    """Whether ``group`` is stable and every member has partitions (and, given ``members``,
    has that many; given ``clients``, members with these client ids among them): an event
    published before waits in Kafka while its steps' deadlines run, and on a loaded machine
    they could expire before the services are up. A member killed with ``kill -9`` stays
    until its session times out (10 s): a restarted instance is waited for by its client id
    (``<service>-<instance>``), or its predecessor would stand for it."""
    client = admin()  # kept alive until the answer is in
    try:
        found = client.describe_consumer_groups([group], request_timeout=5)[group].result(timeout=5)
    except Exception:  # noqa: BLE001 - not known yet
        return False
    return bool(found.state == ConsumerGroupState.STABLE and found.members
                and (members is None or len(found.members) == members)
                and set(clients) <= {m.client_id for m in found.members}
                and all(m.assignment.topic_partitions for m in found.members))


def wait_consuming(groups: Iterable[str], members: int | None = None, timeout_s: float = 60.0,
                   clients: Iterable[str] = ()) -> None:
    """Wait until every one of ``groups`` is ``consuming`` (with ``clients`` among each's members)."""
    clients = list(clients)
    for group in groups:
        wait_for(lambda: consuming(group, members, clients), timeout_s=timeout_s, what=f"{group} consuming")


def notifications(client: Any, ids: Iterable[str]) -> list[bytes | None]:
    """What the notifier recorded for each delivery (``None`` where it has not, or where the
    release took its record with the delivery's state)."""
    from consumers.notifier import notified

    pipe = client.pipeline(transaction=False)
    for delivery_id in ids:
        pipe.hget(notified.key(delivery_id), "drone")
    return list(pipe.execute())


def notified_or_released(client: Any, ids: Iterable[str]) -> list[bool]:
    """Whether each delivery's notification is in, as its record or as its release: the
    release waits for the notifier's group to commit past the shipment (one it dead-lettered
    keeps the delivery) and takes the record with the delivery's state."""
    ids = list(ids)
    pipe = client.pipeline(transaction=False)
    for delivery_id in ids:
        pipe.hexists(delivery_key(delivery_id), "done")
    released = pipe.execute()
    return [bool(drone) or bool(done) for drone, done in zip(notifications(client, ids), released)]


def index_members(client: Any) -> list[bytes]:
    """Every member of every shard's deadline index."""
    return [member for index in deadline_shards() for member in client.zrange(index, 0, -1)]


def indexed(client: Any) -> int:
    """How many steps the deadline indexes hold, over every shard."""
    return sum(int(client.zcard(index)) for index in deadline_shards())


# the Redis Cluster lane (Makefile ``test``) names its cluster here: the tests that keep a Redis
# of their own (a database of the shared node, a private server) use the cluster instead
CLUSTER_URL = os.environ.get("CHOREO_TEST_REDIS_CLUSTER", "")


def own_redis_url(default: str) -> str:
    """``default`` (a test's own database or server), or the cluster in the cluster lane."""
    return CLUSTER_URL or default
