"""The chaos runner: nothing lost, nothing doubled, whatever fails.

It starts a **private** stack under ``.stack/chaos`` (a three-node Kafka cluster with
replication factor 3 and ``min.insync.replicas=2``, its own Redis and its own schema
registry), runs every service of the workflow as its own process with **two instances of
each consumer**, and drives N deliveries through it while it:

* kill -9s a random service instance every few seconds and restarts it;
* hard-kills one broker (kill -9) and restarts it (three times in the full form, once in
  the short form), waiting for every ISR to be whole again before the next one (with
  ``--leader-rebalance 20`` the controller hands the restarted broker its partitions back
  within 20 s instead of 5 minutes, so leaders and coordinators also move under traffic);
* SIGSTOPs an instance past its consumer session timeout (10 s), then SIGCONTs it: the
  zombie's transaction must be fenced, its partitions moved;
* loses Redis once: stop the services, kill -9 Redis, delete its append-only files, start
  it empty, run ``rebuild-state`` (``choreo.ops.rebuild``, its documented procedure),
  start the services again;
* duplicates, delays and so reorders a sample of step events on purpose (copies carry the
  header ``chaos.copy`` so the checks can tell them from the pipeline's own output).

When the faults stop, it waits (bounded) for every delivery to end, then reads **every**
topic with ``read_committed`` and the fleet history and checks: exactly one terminal event
per accepted delivery (shipped, or failed with its compensation complete); no duplicate
event id in any topic; no drone ever held by two deliveries (across the Redis loss, a hold
whose ``drone.scheduled`` is committed carries over; one that never reached Kafka is
forgotten with Redis, as nobody outside ever learned of it); no accepted request missing
from ``delivery.requested``; no good event dead-lettered; everything ended within the
bound; no service instance died by itself (every kill of the plan is followed by a restart,
nothing restarts a crash); no drone still booked for a delivery that ended. The result is
one JSON line; the exit code is 1 on any violation. Deliveries that never ended are
described in it (``stuck_evidence``: records, state table, deadlines), since a CI log keeps
nothing else.

Every random choice comes from ``random.Random(seed)``: a failing run is replayed with the
same seed (same deliveries, same fault schedule; the timing of the machine is not
replayable, the schedule is).

    choreo chaos --short --seed 7          # CI form: 2,000 deliveries, a few minutes
    choreo chaos --seed 7                  # full form: 100,000 deliveries
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any, cast

import redis
import typer
from confluent_kafka.admin import AdminClient
from confluent_kafka import (
    OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition,
)

from choreo.config import REPO_ROOT, Settings, settings
from choreo.envelope import pairs
from choreo.kafka import headers_if_readable, wait_transactions_settled
from choreo.pool import Pool
from choreo.redis_client import connect
from choreo.serde import forget_registry_clients
from choreo.state import text
from choreo.workflow import Workflow
from infra.kafka import KafkaCluster
from infra.process import ManagedProcess, StackError, describe_exit, port_in_use, stop_all
from registry.leader import is_lease_key

HOST = "127.0.0.1"
COPY_HEADER = "chaos.copy"
SESSION_TIMEOUT_S = 10.0  # the runner's consumer session.timeout.ms
TERMINAL = ("delivery.shipped", "delivery.failed")
DUPLICATED = ("delivery.requested", "package.ready", "drone.scheduled", "package.failed",
              "drone.failed")
INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state", "_schemas")
FULL_DELIVERIES = 100_000
SHORT_DELIVERIES = 2_000
STUCK_EVIDENCE = 5  # deliveries that never ended, described in the result
DRONES_BACK_S = 30.0  # how long the drones of ended deliveries may take to come back
# the cluster's leader.imbalance.check.interval.seconds (Kafka's default); --leader-rebalance 20
# makes every run move leaders and coordinators (RELIABILITY.md)
LEADER_REBALANCE_S = 300
# the services' failure injection: permanent failures exercise compensation, transient ones
# the retries; compensation itself only fails transiently (a permanent undo failure is an
# operator alert by design, not a pipeline outcome this run could check)
AGENT_ENV = {
    "AGENT_WAREHOUSE_PERMANENT_RATE": "0.02",
    "AGENT_WAREHOUSE_TRANSIENT_RATE": "0.05",
    "AGENT_DISPATCH_PERMANENT_RATE": "0.02",
    "AGENT_DISPATCH_TRANSIENT_RATE": "0.05",
    "AGENT_FLIGHT_PERMANENT_RATE": "0.01",
    "AGENT_WAREHOUSE_CANCEL_TRANSIENT_RATE": "0.1",
    "AGENT_DISPATCH_RELEASE_TRANSIENT_RATE": "0.1",
}

# The edge's idempotent producer can write a request twice: librdkafka bumps the producer
# epoch after a timed-out request or an error during a leader move, and retries what may
# already be written (librdkafka #4953, open; its maintainers point to transactions). A copy
# keeps its event id, so every consumer drops it; one handled twice would show as a duplicate
# output downstream, which stays a violation. Counted, not a violation.
EDGE_TOPIC = "delivery.requested"


def log(message: str) -> None:
    print(f"[chaos {datetime.now(UTC).strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the plan -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the traffic started
    kind: str  # kill | broker | pause | redis (lost, rebuilt) | redis_master (killed, failed over)
    target: int


@dataclass(frozen=True)
class Plan:
    """Everything a run does, derived from its arguments and seed (so it can be replayed)."""

    deliveries: int
    seed: int
    short: bool
    rate_per_s: float
    kill_every_s: float
    broker_kills: int
    pause_s: float
    redis_loss: bool
    redis_cluster: bool
    duplicate_rate: float
    max_copy_delay_s: float
    settle_timeout_s: float
    faults: tuple[Fault, ...]

    @property
    def traffic_s(self) -> float:
        return self.deliveries / self.rate_per_s


def make_plan(deliveries: int, seed: int, short: bool, *, services: int,
              rate_per_s: float | None = None, redis_loss: bool = True, redis_cluster: bool = False,
              settle_timeout_s: float | None = None) -> Plan:
    rng = random.Random(f"faults-{seed}")
    rate = rate_per_s or (40.0 if short else 60.0)
    traffic_s = deliveries / rate
    kill_every = 2.5 if short else 5.0
    broker_kills = 1 if short else 3
    faults: list[Fault] = []
    t = 3.0
    while True:
        t += kill_every * rng.uniform(0.6, 1.4)
        if t >= traffic_s:
            break
        faults.append(Fault(round(t, 2), "kill", rng.randrange(services)))
    for i in range(broker_kills):
        at = traffic_s * (i + 1) / (broker_kills + 1) + rng.uniform(-0.05, 0.05) * traffic_s
        faults.append(Fault(round(max(2.0, at), 2), "broker", rng.randrange(3)))
    faults.append(Fault(round(traffic_s * rng.uniform(0.12, 0.3), 2), "pause", rng.randrange(services)))
    if redis_loss:  # on a cluster, one master is killed under traffic instead
        faults.append(Fault(round(traffic_s * rng.uniform(0.55, 0.7), 2),
                            "redis_master" if redis_cluster else "redis", 0))
    return Plan(
        deliveries=deliveries, seed=seed, short=short, rate_per_s=rate, kill_every_s=kill_every,
        broker_kills=broker_kills, pause_s=SESSION_TIMEOUT_S + 4.0, redis_loss=redis_loss,
        redis_cluster=redis_cluster,
        duplicate_rate=0.03 if short else 0.01, max_copy_delay_s=8.0,
        settle_timeout_s=settle_timeout_s or (150.0 if short else 600.0),
        faults=tuple(sorted(faults, key=lambda f: f.at_s)),
    )


# -- the private stack ----------------------------------------------------------------------

@dataclass(frozen=True)
class Ports:
    kafka_base: int = 19092
    redis: int = 16379
    registry: int = 18081

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{HOST}:{self.kafka_base + 2 * n}" for n in range(3))

    def all(self, redis_cluster: bool = False) -> list[int]:
        from infra.redis_cluster import BUS_OFFSET, MASTERS, REPLICAS_PER_MASTER

        nodes = range(self.redis, self.redis + MASTERS * (1 + REPLICAS_PER_MASTER)) if redis_cluster else []
        return [*range(self.kafka_base, self.kafka_base + 6), self.redis, self.registry,
                *nodes, *(port + BUS_OFFSET for port in nodes)]


def private_env(ports: Ports, data_dir: Path, redis_cluster: bool = False) -> dict[str, str]:
    """The private stack's addresses. On a Redis Cluster (its first node on the Redis port)
    every batch waits for a replica of each master it wrote to: a master killed under
    traffic then loses nothing a committed Kafka transaction rests on."""
    from infra.redis_cluster import MASTERS, REPLICAS_PER_MASTER

    nodes = MASTERS * (1 + REPLICAS_PER_MASTER) if redis_cluster else 1  # every node a seed
    return {
        "KAFKA_BOOTSTRAP_SERVERS": ports.bootstrap,
        "REDIS_URL": "redis://" + ",".join(f"{HOST}:{ports.redis + n}" for n in range(nodes)) + "/0",
        "SCHEMA_REGISTRY_URL": f"http://{HOST}:{ports.registry}",
        "CHOREO_DATA_DIR": str(data_dir),
        **({"CHOREO_REDIS_WAIT_REPLICAS": "1", "CHOREO_REDIS_WAIT_MS": "1000"} if redis_cluster else {}),
    }


PUBLISH_RETRY_S = 30.0
CLUSTER_REDIS_PORT = 16400  # the Redis Cluster form's first node
CLUSTER_LOCK = Path("/tmp/choreo-kafka-cluster3.lock")  # the three-node test's lock, too


@contextmanager
def cluster_lock(ports: Ports) -> Iterator[None]:
    """The default three-node ports are fixed: runs that use them take turns (the same lock
    as tests/integration/test_stack_three_nodes.py)."""
    if ports.kafka_base != Ports().kafka_base:
        yield
        return
    with open(CLUSTER_LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for {CLUSTER_LOCK} (another three-node cluster runs on these ports)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def using(env: dict[str, str]) -> Iterator[Settings]:
    """Point this process (``choreo.config.settings()`` and every client built from it) at
    the private stack while the block runs; restore the previous environment afterwards.
    Registry clients are dropped both ways: a second run in one process starts a fresh
    registry on the same port, and a cached id of the first would be unknown to it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    settings.cache_clear()
    forget_registry_clients()
    try:
        yield settings()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        settings.cache_clear()
        forget_registry_clients()


class Stack:
    """The private cluster, Redis, registry and service processes of one chaos run."""

    def __init__(self, cfg: Settings, ports: Ports, service_env: dict[str, str],
                 leader_rebalance_s: int = LEADER_REBALANCE_S, redis_cluster: bool = False) -> None:
        from infra.redis_cluster import RedisCluster
        from infra.redis_server import redis_process
        from infra.registry_process import registry_process
        from infra.services import pipeline_specs, service_process
        from infra.stack import kafka_cluster

        self.cfg = cfg
        # how soon a restarted broker gets its partitions back: each hand-back moves leaders
        # and coordinators under load (one once crashed both supervisors)
        self.cluster: KafkaCluster = replace(kafka_cluster(cfg, nodes=3), base_port=ports.kafka_base,
                                             leader_rebalance_s=leader_rebalance_s)
        self.redis = redis_process(f"redis://{HOST}:{ports.redis}/0", cfg.data_dir)
        self.redis_cluster = RedisCluster(cfg.data_dir, base_port=ports.redis) if redis_cluster else None
        self.registry = registry_process(cfg, port=ports.registry, name="registry")
        self.services: list[ManagedProcess] = [
            service_process(spec, service_env, cfg) for spec in pipeline_specs(instances=2)
        ]
        self.groups = sorted({p.name.rsplit("-", 1)[0] for p in self.services})

    def infra(self) -> list[ManagedProcess]:
        redis_nodes = self.redis_cluster.processes() if self.redis_cluster else [self.redis]
        return [*self.cluster.processes(), *redis_nodes, self.registry]

    def start_redis(self) -> None:
        if self.redis_cluster:
            self.redis_cluster.start(timeout_s=60)
        else:
            self.redis.start(timeout_s=30)

    def stop_everything(self) -> None:
        for proc in self.services:  # a paused process cannot act on SIGTERM
            proc.terminate(signal.SIGCONT)
        stop_all(self.services, timeout_s=15)
        self.registry.stop(timeout_s=15)
        self.redis.stop(timeout_s=15)
        if self.redis_cluster:
            self.redis_cluster.stop(timeout_s=15)
        for n in range(self.cluster.nodes):
            self.cluster.node(n).terminate(signal.SIGCONT)
        self.cluster.stop()

    def start_services(self, timeout_s: float = 90.0) -> None:
        for proc in self.services:
            proc.start(timeout_s=30)
        wait_for_groups(self.groups, timeout_s)


def wait_for_groups(groups: list[str], timeout_s: float) -> None:
    """Until every group is stable with every member assigned (joins cost no delivery time)."""
    from choreo.kafka import admin

    client = admin()
    deadline = time.monotonic() + timeout_s
    last = "nothing asked yet"
    while time.monotonic() < deadline:
        try:
            futures = client.describe_consumer_groups(groups, request_timeout=5)
            states = {g: f.result(timeout=5) for g, f in futures.items()}
        except Exception as exc:  # a group that does not exist yet fails its future
            last = f"{type(exc).__name__}: {str(exc)[:200]}"
            # a client that keeps hearing NOT_COORDINATOR kept asking the coordinator it had
            # cached for 90 s in one run: a new client looks the coordinator up
            client = admin()
            time.sleep(0.5)
            continue
        if all(str(d.state).endswith("STABLE") and d.members
               and all(m.assignment.topic_partitions for m in d.members) for d in states.values()):
            return
        last = "; ".join(f"{g}: {str(d.state).rsplit('.', 1)[-1]}, {len(d.members)} members, "
                         f"{sum(1 for m in d.members if m.assignment.topic_partitions)} assigned"
                         for g, d in states.items())
        time.sleep(0.5)
    raise StackError(f"consumer groups {groups} not stable within {timeout_s:.0f}s (last: {last})")


def wait_groups_empty(groups: list[str], timeout_s: float) -> None:
    from choreo.ops.rebuild import active_groups

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            active = active_groups(groups)
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            active = {"?": 0}
            log(f"describe groups failed: {exc}")
        if not active:
            return
        if time.monotonic() > deadline:
            raise StackError(f"groups still have members after {timeout_s:.0f}s: {active}")
        time.sleep(0.5)


def wait_leaders(timeout_s: float) -> None:
    """Until every partition of every topic has a leader, as each broker answers."""
    deadline = time.monotonic() + timeout_s
    for n in range(3):
        client = AdminClient({"bootstrap.servers": settings().kafka_bootstrap_servers.split(",")[n]})
        while True:
            meta = client.list_topics(timeout=5)
            if all(pm.leader >= 0 for tm in meta.topics.values() for pm in tm.partitions.values()) \
                    and "_schemas" in meta.topics:
                break
            if time.monotonic() > deadline:
                raise StackError(f"topics without a leader after {timeout_s:.0f}s")
            time.sleep(0.3)


def wait_isr_whole(timeout_s: float) -> bool:
    """Until no partition is under-replicated (before the next broker is killed)."""
    from choreo.kafka import admin

    client = admin()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            meta = client.list_topics(timeout=5)
            short_isr = [
                (t, p) for t, tm in meta.topics.items() for p, pm in tm.partitions.items()
                if len(pm.isrs) < len(pm.replicas)
            ]
            if not short_isr and len(meta.brokers) >= 3:
                return True
        except Exception:  # noqa: BLE001 - metadata may fail while a broker starts
            pass
        time.sleep(1.0)
    return False


# -- traffic --------------------------------------------------------------------------------

class Submitter(threading.Thread):
    """Publishes the deliveries at a steady rate through the Publisher (acks=all, idempotent)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(name="chaos-submitter", daemon=True)
        self.plan = plan
        self.rng = random.Random(f"requests-{plan.seed}")
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()  # held for one publish: a pause waits for it
        self.accepted: dict[str, float] = {}
        self.unconfirmed: set[str] = set()
        self.refusals = 0  # publishes refused and asked again
        self.sent = 0
        self.error = ""
        self.finished = threading.Event()

    def pause(self) -> None:
        self.gate.clear()
        with self.lock:
            pass

    def resume(self) -> None:
        self.gate.set()

    def request(self, n: int) -> Any:
        from schemas.models import DeliveryRequested, Location

        rng = self.rng
        delivery_id = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        # ~2% are heavier than any drone: refused by the scheduler, the package compensated
        weight = round(rng.uniform(26.0, 40.0), 2) if rng.random() < 0.02 else round(rng.uniform(0.2, 20.0), 2)
        return DeliveryRequested(
            delivery_id=delivery_id, owner_id=f"owner-{n % 97}",
            pickup=Location(lat=52.5 + rng.random() / 10, lon=13.4, address=f"{n} Pickup St"),
            dropoff=Location(lat=52.4, lon=13.3 + rng.random() / 10, address=f"{n} Drop Rd"),
            package_size=rng.choice(["SMALL", "MEDIUM", "LARGE"]), weight_kg=weight,
            requested_at=datetime.now(UTC),
        )

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - reported in the result, never swallowed
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"submitter failed: {self.error}")
        finally:
            self.finished.set()

    def _run(self) -> None:
        from choreo.envelope import derived_id
        from choreo.publisher import Publisher
        from consumers.workflow import WORKFLOW

        publisher = Publisher("chaos", WORKFLOW)

        def confirmed(err: KafkaError | None, msg: Message | None) -> None:
            key = msg.key() if msg is not None else None
            if key is None:
                return
            if err is None:
                self.accepted[key.decode()] = time.monotonic()
            else:
                self.unconfirmed.add(key.decode())

        interval = 1.0 / self.plan.rate_per_s
        next_at = time.monotonic()
        for n in range(self.plan.deliveries):
            request = self.request(n)
            # a poll returns as soon as it served a delivery report: wait out the interval
            while (wait := next_at - time.monotonic()) > 0:
                publisher.poll(wait)
            while True:
                with self.lock:  # the gate is checked under the lock: a pause waits for us
                    if self.gate.is_set():
                        self._publish(publisher, request, derived_id(request.delivery_id, "chaos-request"),
                                      confirmed)
                        break
                publisher.poll(0.1)
            next_at = max(next_at + interval, time.monotonic() - 1.0)  # no burst after a pause
        remaining = int(publisher.producer.flush(120))
        if remaining:
            log(f"{remaining} requests still unconfirmed after the final flush")


    def _publish(self, publisher: Any, request: Any, event_id: str,
                 confirmed: Callable[[KafkaError | None, Message | None], None]) -> None:
        """Publish, asking again for up to ``PUBLISH_RETRY_S`` when refused, as a client
        retries a 503: the edge refuses while it cannot open the steps (a Redis master
        failing over). Still refused then: counted, not accepted."""
        deadline = time.monotonic() + PUBLISH_RETRY_S
        while True:
            try:
                publisher.publish(request, event_id, on_delivery=confirmed)
                break
            except Exception as exc:  # noqa: BLE001 - refused: asked again, or counted
                if time.monotonic() >= deadline:
                    self.unconfirmed.add(request.delivery_id)
                    log(f"publish refused: {type(exc).__name__}: {str(exc)[:200]}")
                    break
                self.refusals += 1
                publisher.poll(0.5)
        self.sent += 1


class Duplicator(threading.Thread):
    """Copies a sample of step events back into their topics, some seconds later (so the
    copies also arrive out of order), with a ``chaos.copy`` header."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(name="chaos-duplicator", daemon=True)
        self.plan = plan
        self.rng = random.Random(f"copies-{plan.seed}")
        self.stop_flag = threading.Event()
        self.copies: Counter[str] = Counter()
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"duplicator failed: {self.error}")

    def _run(self) -> None:
        from choreo.kafka import base_config

        consumer = Consumer({**base_config(), "group.id": f"chaos-dup-{uuid.uuid4().hex[:8]}",
                             "enable.auto.commit": False, "isolation.level": "read_committed",
                             "auto.offset.reset": "latest", "log_level": 0})
        producer = Producer({**base_config(), "enable.idempotence": True, "acks": "all",
                             "linger.ms": 5, "log_level": 0})
        consumer.subscribe(list(DUPLICATED))
        held: list[tuple[float, int, str, bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]] = []
        seq = 0
        try:
            while not self.stop_flag.is_set():
                for msg in consumer.consume(200, 0.2):
                    if msg.error() is not None or self.rng.random() >= self.plan.duplicate_rate:
                        continue
                    headers: list[tuple[str, str | bytes | None]] = list(pairs(headers_if_readable(msg)))
                    if any(k == COPY_HEADER for k, _ in headers):
                        continue
                    due = time.monotonic() + self.rng.uniform(0.0, self.plan.max_copy_delay_s)
                    seq += 1
                    heapq.heappush(held, (due, seq, msg.topic() or "", msg.key(), msg.value(),
                                          [*headers, (COPY_HEADER, b"1")]))
                now = time.monotonic()
                while held and held[0][0] <= now:
                    self._copy(producer, heapq.heappop(held))
                producer.poll(0)
            while held:  # faults are over: what is held goes out now
                self._copy(producer, heapq.heappop(held))
            producer.flush(60)
        finally:
            consumer.close()

    def _copy(self, producer: Producer,
              item: tuple[float, int, str, bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]) -> None:
        _, _, topic, key, value, headers = item
        producer.produce(topic, key=key, value=value, headers=headers)
        self.copies[topic] += 1


class Tracker(threading.Thread):
    """Follows the outcomes (read_committed) to know when every delivery has ended."""

    def __init__(self) -> None:
        super().__init__(name="chaos-tracker", daemon=True)
        self.lock = threading.Lock()
        self.terminal: Counter[str] = Counter()
        self.needs: dict[str, set[str]] = {}
        self.undone: dict[str, set[str]] = defaultdict(set)
        self.stop_flag = threading.Event()
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
            log(f"tracker failed: {self.error}")

    def _run(self) -> None:
        from choreo.ops.records import BodyDecoder, reader

        decode = BodyDecoder().read  # a registry that cannot be reached fails the tracker, not a check
        consumer = reader(log_level=0)
        undo_of = undo_topics()
        topics = [*TERMINAL, *undo_of]
        meta = consumer.list_topics(timeout=10)
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING)
                         for t in topics for p in meta.topics[t].partitions])
        try:
            while not self.stop_flag.is_set():
                for msg in consumer.consume(1000, 0.2):
                    key, topic = msg.key(), msg.topic() or ""
                    if msg.error() is not None or key is None:
                        continue
                    delivery = key.decode(errors="replace")
                    with self.lock:
                        if topic in TERMINAL:
                            self.terminal[delivery] += 1
                        if topic == "delivery.failed":
                            body = decode(topic, msg.value())
                            wanted = body.get("compensate", []) if isinstance(body, dict) else []
                            self.needs[delivery] = {str(s) for s in wanted}
                        if topic in undo_of:
                            self.undone[delivery].add(undo_of[topic])
        finally:
            consumer.close()

    def pending(self, ids: list[str]) -> list[str]:
        with self.lock:
            return [d for d in ids if not self.terminal[d] or not self.needs.get(d, set()) <= self.undone[d]]


# -- faults ---------------------------------------------------------------------------------

@dataclass
class FaultLog:
    service_kills: int = 0
    broker_kills: int = 0
    pauses: int = 0
    redis_losses: int = 0
    redis_master_kills: int = 0
    rebuild: dict[str, Any] = field(default_factory=dict)
    skipped: int = 0
    isr_waits_s: float = 0.0
    events: list[str] = field(default_factory=list)

    def note(self, t: float, text: str) -> None:
        self.events.append(f"+{t:.1f}s {text}")
        log(text)


class Chaos:
    def __init__(self, plan: Plan, stack: Stack, submitter: Submitter, duplicator: Duplicator) -> None:
        self.plan = plan
        self.stack = stack
        self.submitter = submitter
        self.duplicator = duplicator
        self.faults = FaultLog()
        self.restores: list[tuple[float, int, str, Callable[[], None]]] = []
        self.busy: set[str] = set()  # processes down or paused right now
        self.fleet_before_loss: list[tuple[bytes, dict[bytes, bytes]]] = []
        self.redis_lost_at_ms = 2**62
        self._seq = 0
        self.started = 0.0
        self.settle_transactions = True

    def _later(self, delay_s: float, what: str, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self.restores, (time.monotonic() + delay_s, self._seq, what, action))

    def _now(self) -> float:
        return time.monotonic() - self.started

    def run_faults(self) -> None:
        """Carry out the plan while the traffic flows; return when both are over and every
        fault is undone (killed processes restarted, paused ones resumed, brokers back)."""
        rng = random.Random(f"durations-{self.plan.seed}")
        self.started = time.monotonic()
        todo = list(self.plan.faults)
        while todo or self.restores or not self.submitter.finished.is_set():
            now = time.monotonic()
            while self.restores and self.restores[0][0] <= now:
                _, _, what, action = heapq.heappop(self.restores)
                self._restore(what, action)
            while todo and todo[0].at_s <= self._now():
                self._inject(todo.pop(0), rng)
            if self.submitter.error:
                raise RuntimeError(f"submitter failed: {self.submitter.error}")
            time.sleep(0.1)

    def _restore(self, what: str, action: Callable[[], None]) -> None:
        action()
        self.busy.discard(what)

    def _restore_all_now(self) -> None:
        while self.restores:
            _, _, what, action = heapq.heappop(self.restores)
            self._restore(what, action)

    def _inject(self, fault: Fault, rng: random.Random) -> None:
        services = self.stack.services
        if fault.kind in ("kill", "pause"):
            proc = services[fault.target]
            if proc.name in self.busy:
                proc = next((p for p in services if p.name not in self.busy), proc)
            if proc.name in self.busy:
                self.faults.skipped += 1
                return
            self.busy.add(proc.name)
            if fault.kind == "kill":
                proc.kill()
                self.faults.service_kills += 1
                down = rng.uniform(0.5, 3.0)
                self.faults.note(self._now(), f"kill -9 {proc.name}; restart in {down:.1f}s")
                self._later(down, proc.name, partial(_start, proc, 30))
            else:
                proc.terminate(signal.SIGSTOP)
                self.faults.pauses += 1
                self.faults.note(self._now(), f"SIGSTOP {proc.name} for {self.plan.pause_s:.0f}s")
                self._later(self.plan.pause_s, proc.name, partial(_resume, proc))
        elif fault.kind == "broker":
            started = time.monotonic()
            if not wait_isr_whole(90):
                log("ISR not whole after 90s; killing the broker anyway")
            self.faults.isr_waits_s += time.monotonic() - started
            node = self.stack.cluster.node(fault.target)
            node.kill()
            self.faults.broker_kills += 1
            down = rng.uniform(5.0, 10.0)
            self.busy.add(node.name)
            self.faults.note(self._now(), f"kill -9 broker {node.name}; restart in {down:.1f}s")
            self._later(down, node.name, partial(_start, node, 120))
        elif fault.kind == "redis_master":
            self._kill_redis_master()
        elif fault.kind == "redis":
            outage = time.monotonic()
            self._lose_redis()
            # the traffic was paused meanwhile: the rest of the plan keeps its spacing
            self.started += time.monotonic() - outage

    def _kill_redis_master(self) -> None:
        """kill -9 one master under traffic; its replica takes over, and the killed node comes
        back a few seconds later as the new master's replica (until then the batches on its
        slots fail their wait for a replica and are done again)."""
        from consumers.drone_scheduler import fleet

        cluster = self.stack.redis_cluster
        assert cluster is not None
        started = time.monotonic()
        # the master of the drone pool: a hold it loses would book a drone twice. What the
        # pool's history says at the kill is judged apart from what follows it, as across
        # the single node's loss
        client = connect(self.stack.cfg.redis_url, socket_timeout=10)
        node = cast(redis.RedisCluster, client).get_node_from_key(fleet.free_key)  # type: ignore[no-untyped-call]
        pool_master = int(node.port)
        self.fleet_before_loss = fleet.history(client)
        self.redis_lost_at_ms = int(time.time() * 1000)
        client.close()
        killed, promoted = cluster.kill_master(timeout_s=60, port=pool_master)
        self.faults.redis_master_kills += 1
        node = cluster.node(killed)
        self.busy.add(node.name)
        self.faults.note(self._now(), f"kill -9 redis master {killed}; {promoted} took over in "
                                      f"{time.monotonic() - started:.1f}s; the old master back in 5s")
        self._later(5.0, node.name, partial(_start, node, 30))

    def _lose_redis(self) -> None:
        from choreo.ops.rebuild import rebuild
        from consumers.drone_scheduler import fleet
        from consumers.workflow import WORKFLOW

        started = time.monotonic()
        self.faults.note(self._now(), "redis loss: pausing traffic, stopping services")
        self.submitter.pause()
        self._restore_all_now()
        stop_all(self.stack.services, timeout_s=20)
        if not wait_isr_whole(120):  # the rebuild reads committed offsets: brokers must be whole
            log("ISR not whole after 120s; rebuilding anyway")
        # rebuild-state reads up to each partition's last stable offset: a transaction of a
        # killed instance that is still open (up to transaction.timeout.ms) or decided but not
        # yet marked is invisible to it, and becomes visible after the rebuild (reported: the
        # tool should wait for this itself; the procedure does it until then)
        in_doubt_s = wait_transactions_settled(90, log) if self.settle_transactions else -1.0
        wait_groups_empty(self.stack.groups, 60)
        client = connect(self.stack.cfg.redis_url, socket_timeout=10)
        self.fleet_before_loss = fleet.history(client)
        self.redis_lost_at_ms = int(time.time() * 1000)
        self.stack.redis.kill()
        # every connection this process still holds leaves the dead server's side of it in
        # FIN_WAIT2 until it times out (tcp_fin_timeout, 60 s), and the port can't be bound
        client.connection_pool.disconnect()
        port = int(urlsplit(self.stack.cfg.redis_url).port or 6379)
        deadline = time.monotonic() + 90
        while port_in_use(HOST, port) and time.monotonic() < deadline:
            time.sleep(1)
        workdir = self.stack.redis.workdir
        for path in workdir.iterdir():
            if path.suffix in (".pid", ".log"):
                continue
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.stack.redis.start(timeout_s=30)
        # the registry, still running, takes its lease again at once: any other key is data
        # that survived the loss
        survived = [k for k in client.scan_iter(count=1000) if not is_lease_key(k)]
        assert not survived, f"redis came back with data: {survived[:5]}"
        self.faults.note(self._now(), "redis restarted empty; rebuild-state")
        for attempt in range(1, 4):  # merge-only, so a rebuild cut short is simply run again
            try:
                report = rebuild(WORKFLOW, client=client)
                break
            except KafkaException as exc:
                if attempt == 3:
                    raise
                log(f"rebuild-state failed ({exc}); running it again")
                time.sleep(3)
        self.faults.rebuild = {
            "records_read": report.records_read, "deliveries": report.deliveries,
            "outcomes": report.outcomes, "open_steps": report.open_steps,
            "bookings_restored": report.bookings_restored, "bookings_superseded": report.bookings_superseded,
            "booking_conflicts": len(report.booking_conflicts), "seconds": round(report.seconds, 1),
            "waited_for_open_transactions_s": round(in_doubt_s, 1),
        }
        self.stack.start_services()
        self.submitter.resume()
        self.faults.redis_losses += 1
        self.faults.rebuild["outage_s"] = round(time.monotonic() - started, 1)
        self.faults.note(self._now(), f"services back after redis loss: {self.faults.rebuild}")


def died_on_their_own(services: list[ManagedProcess]) -> list[str]:
    """The instances that are not running, each with how it ended when this process started
    it (a signal, such as SIGSEGV, tells a crash from an exit)."""
    died = []
    for proc in services:
        if proc.running():
            continue
        died.append(f"{proc.name}: {describe_exit(proc.exit_code())}")
    return died


def _resume(proc: ManagedProcess) -> None:
    proc.terminate(signal.SIGCONT)


def _start(proc: ManagedProcess, timeout_s: float = 30) -> None:
    try:
        proc.start(timeout_s=timeout_s)
    except StackError as exc:  # tried again once: a port may linger a moment
        log(f"restart of {proc.name} failed ({exc}); retrying")
        time.sleep(2)
        proc.start(timeout_s=timeout_s)


# -- the checks -----------------------------------------------------------------------------

@dataclass
class FleetHistory:
    """The fleet's history before the Redis loss, and the one written since (it begins with
    the rebuild's restored bookings)."""

    before_loss: list[tuple[bytes, dict[bytes, bytes]]]
    after_loss: list[tuple[bytes, dict[bytes, bytes]]]
    lost_at_ms: int = 2**62  # when Redis was lost (services stopped, transactions settled)

    def double_bookings(self, booked: dict[str, str], booked_at: dict[str, int] | None = None,
                        shipped_at: dict[str, int] | None = None) -> tuple[list[str], int]:
        """Every reservation of a held drone; and how many holds at the loss were forgotten
        because their booking had not reached Kafka by then (redone after the rebuild, not a
        violation). A hold whose booking was committed before the loss stays held across it: a
        rebuild that lost it shows up as the drone reserved again while its holder flies it.
        A booking committed only after the loss is the redone reservation, which may well pick
        the same drone again: the hold at the loss was still forgotten. A hold whose delivery
        was shipped before the loss had ended (the flight was over; the supervisor's record of
        the shipment may not have given the drone back yet), and the rebuild frees it."""
        from choreo.pool import violations_in

        found, held = violations_in(self.before_loss)
        times, shipped = booked_at or {}, shipped_at or {}
        flying = {drone: delivery for drone, delivery in held.items()
                  if shipped.get(delivery, 2**62) >= self.lost_at_ms}
        kept = {drone: delivery for drone, delivery in flying.items()
                if booked.get(delivery) == drone and times.get(delivery, 0) < self.lost_at_ms}
        after, _ = violations_in(self.after_loss, holding=kept)
        return found + after, len(flying) - len(kept)

    def evidence(self, violations: list[str], found: Findings) -> dict[str, Any]:
        """Each doubled drone's history on both sides of the loss, with what Kafka holds of the
        deliveries involved: what a person needs to tell a checker's mistake from a real one."""
        drones = {v.split(" ", 1)[0] for v in violations}
        out: dict[str, Any] = {}
        for drone in sorted(drones):
            rows = [{"side": side, "id": eid.decode(), **{k.decode(): v.decode() for k, v in fields.items()}}
                    for side, entries in (("before", self.before_loss), ("after", self.after_loss))
                    for eid, fields in entries if fields[b"drone"].decode() == drone]
            deliveries = {row["delivery"] for row in rows}
            out[drone] = {"history": rows, "kafka": {
                d: {"booked": found.booked.get(d), "booked_at_ms": found.booked_at.get(d),
                    "shipped": d in found.shipped, "failed": sorted(found.failed.get(d, ())),
                    "terminal": found.terminal[d]} for d in sorted(deliveries)}}
        return out


@dataclass
class Findings:
    requested: set[str] = field(default_factory=set)
    terminal: Counter[str] = field(default_factory=Counter)
    shipped: set[str] = field(default_factory=set)
    shipped_at: dict[str, int] = field(default_factory=dict)  # delivery -> its shipment's time (ms)
    failed: dict[str, set[str]] = field(default_factory=dict)
    undone: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    ids: dict[str, Counter[Any]] = field(default_factory=lambda: defaultdict(Counter))
    # where each id was first seen, and every later copy: the evidence of a duplicate
    first_at: dict[str, dict[Any, str]] = field(default_factory=lambda: defaultdict(dict))
    duplicate_at: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # by topic
    dead_letters: Counter[str] = field(default_factory=Counter)
    booked: dict[str, str] = field(default_factory=dict)  # delivery -> its committed drone
    booked_at: dict[str, int] = field(default_factory=dict)  # delivery -> that record's time (ms)
    copies_read: int = 0
    records: int = 0
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def undo_topics() -> dict[str, str]:
    """The topic whose event confirms each undo -> the step it undoes (the declarations')."""
    from consumers.workflow import WORKFLOW

    return {confirmed.topic: forward for forward, (_, confirmed) in WORKFLOW.compensations().items()}


def read_everything() -> Findings:
    from choreo.ops.records import BodyDecoder, existing_topics, read, reader, resolve

    found = Findings()
    decode = BodyDecoder().read  # a registry that cannot be reached fails the run, not a check
    consumer = reader(log_level=0)
    undo_of = undo_topics()
    try:
        topics = sorted(t for t in existing_topics(consumer) if t not in INTERNAL_TOPICS)
        spans = [s for t in topics for s in resolve(consumer, t)]
        for r in read(consumer, spans, idle_timeout_s=60):
            found.records += 1
            if r.topic.endswith(".dlq"):
                found.dead_letters[f"{r.topic}:{r.header('dlq.reason')}"] += 1
                continue
            if r.header(COPY_HEADER) is not None:
                found.copies_read += 1
                continue
            env = r.envelope
            delivery = env.correlation_id if env is not None else r.key_text
            if env is None:
                found.ids[r.topic]["<no envelope>"] += 1
            else:
                key: Any = (env.event_id, env.attempt) if r.topic.startswith("retry.") else env.event_id
                found.ids[r.topic][key] += 1
                where = f"{r.position}@{r.timestamp_ms} by {env.producer} (delivery {delivery})"
                first = found.first_at[r.topic].setdefault(key, where)
                if first is not where:
                    found.duplicate_at[r.topic].append(f"{key} first {first}, again {where}")
            if r.topic == EDGE_TOPIC:
                found.requested.add(delivery)
            if r.topic in TERMINAL:
                found.terminal[delivery] += 1
            if r.topic == "delivery.shipped":
                found.shipped.add(delivery)
                found.shipped_at.setdefault(delivery, r.timestamp_ms)
            if r.topic == "delivery.failed":
                body = decode(r.topic, r.value)
                wanted = body.get("compensate", []) if isinstance(body, dict) else []
                found.failed[delivery] = {str(s) for s in wanted}
            if r.topic in undo_of:
                found.undone[delivery].add(undo_of[r.topic])
            if r.topic == "drone.scheduled":
                body = decode(r.topic, r.value)
                found.booked[delivery] = str(body.get("drone_id", "")) if isinstance(body, dict) else ""
                found.booked_at[delivery] = r.timestamp_ms
    finally:
        consumer.close()
    return found


def judge(submitter: Submitter, found: Findings, fleet_history: FleetHistory,
          late: list[str]) -> dict[str, Any]:

    accepted = set(submitter.accepted)
    landed_unconfirmed = found.requested - accepted
    universe = accepted | found.requested  # a request that landed must end too
    missing = sorted(d for d in universe if found.terminal[d] == 0)
    multiple = sorted(d for d in universe if found.terminal[d] > 1)
    uncompensated = sorted(d for d, need in found.failed.items() if not need <= found.undone[d])
    lost = sorted(accepted - found.requested)
    duplicates = {t: sum(n - 1 for n in c.values() if n > 1) for t, c in found.ids.items()}
    duplicates = {t: n for t, n in duplicates.items() if n}
    edge_duplicates = duplicates.pop(EDGE_TOPIC, 0)
    doubled_drones, forgotten = fleet_history.double_bookings(found.booked, found.booked_at, found.shipped_at)
    dead = sum(found.dead_letters.values())
    violations = {
        "missing_terminal": len(missing),
        "multiple_terminal": len(multiple),
        "uncompensated": len(uncompensated),
        "duplicate_event_ids": sum(duplicates.values()),
        "double_bookings": len(doubled_drones),
        "lost": len(lost),
        "dead_lettered": dead,
        "late": len(late),
    }
    examples = {
        "missing_terminal": missing[:5], "multiple_terminal": multiple[:5],
        "uncompensated": uncompensated[:5], "lost": lost[:5], "double_bookings": doubled_drones[:5],
        "late": late[:5],
        "duplicate_event_ids": [d for t, ds in found.duplicate_at.items() if t != EDGE_TOPIC for d in ds][:5],
    }
    return {
        "accepted": len(accepted),
        "unconfirmed": len(submitter.unconfirmed),
        "publish_refusals_retried": submitter.refusals,
        "unconfirmed_landed": len(landed_unconfirmed),
        "requested_in_topic": len(found.requested),
        "shipped": len(found.shipped & universe),
        "failed": len(set(found.failed) & universe),
        "failed_compensated": len(set(found.failed) - set(uncompensated)),
        "fleet_history_entries": len(fleet_history.before_loss) + len(fleet_history.after_loss),
        "uncommitted_holds_forgotten": forgotten,
        "records_read": found.records,
        "copies_read": found.copies_read,
        "duplicates_by_topic": duplicates,
        "edge_duplicates": edge_duplicates,
        "edge_duplicate_examples": found.duplicate_at.get(EDGE_TOPIC, [])[:5],
        "dead_letters_by_topic": dict(found.dead_letters),
        "violations": violations,
        "violation_examples": {k: v for k, v in examples.items() if v},
    }


def stuck_evidence(deliveries: list[str], client: redis.Redis, workflow: Workflow, out: Path) -> dict[str, Any]:
    """What a person needs to tell why a delivery never ended, taken before the stack stops
    (a CI log keeps only the JSON line): each delivery's records in causal order, its state
    table and each step's place in the deadline index. Bodies are left undecoded (customer
    data); the full traces go to ``out``."""
    from choreo.ops.trace import trace
    from choreo.state import deadline_index, index_member

    compact: dict[str, Any] = {}
    full: dict[str, Any] = {}
    for delivery in deliveries:
        try:
            story = trace(delivery, workflow, redis_client=client, decode=False)
        except (KafkaException, redis.RedisError) as exc:
            compact[delivery] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        full[delivery] = story.as_dict()
        steps = [s.name for s in workflow.steps if f"{s.name}.status" in story.state]
        compact[delivery] = {
            "hops": [f"+{h.since_start_ms}ms {h.topic}[{h.partition}]@{h.offset} a{h.attempt} "
                     f"by {h.producer} read:{','.join(g for g, read in h.consumed_by.items() if read)}"
                     for h in story.hops],
            "state": story.state,
            "deadlines": {s: client.zscore(deadline_index(delivery), index_member(delivery, s)) for s in steps},
        }
    out.write_text(json.dumps(full, indent=1, default=str))
    return compact


# -- the run --------------------------------------------------------------------------------

def run(deliveries: int, seed: int, short: bool, *, ports: Ports | None = None,
        data_dir: Path | None = None, rate_per_s: float | None = None, redis_loss: bool = True,
        redis_cluster: bool = False, settle_timeout_s: float | None = None, log_level: str = "WARNING",
        leader_rebalance_s: int = LEADER_REBALANCE_S) -> dict[str, Any]:
    """One chaos run on a private stack; the summary dict (``ok`` false on any violation).

    Every process it started is stopped before it returns, whatever happened.
    """
    ports = ports or Ports()
    data_dir = data_dir or (REPO_ROOT / ".stack" / "chaos")
    env = private_env(ports, data_dir, redis_cluster)
    service_env = {**env, **AGENT_ENV, "CHOREO_LOG_LEVEL": log_level}
    plan = make_plan(deliveries, seed, short, services=10, rate_per_s=rate_per_s,
                     redis_loss=redis_loss, redis_cluster=redis_cluster, settle_timeout_s=settle_timeout_s)
    t0 = time.monotonic()
    summary: dict[str, Any] = {
        "seed": seed, "form": "short" if short else "full", "deliveries": deliveries,
        "rate_per_s": plan.rate_per_s, "settle_timeout_s": plan.settle_timeout_s,
        "redis": "cluster" if redis_cluster else "single",
    }
    with cluster_lock(ports), using(env) as cfg:
        stack = Stack(cfg, ports, service_env, leader_rebalance_s, redis_cluster)
        submitter = Submitter(plan)
        duplicator = Duplicator(plan)
        tracker = Tracker()
        chaos = Chaos(plan, stack, submitter, duplicator)
        try:
            _clean_previous(stack, data_dir, ports)
            summary.update(_drive(plan, stack, submitter, duplicator, tracker, chaos))
        except Exception as exc:  # noqa: BLE001 - the run fails with its reason, cleaned up
            summary["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            log(f"run failed: {summary['error']}")
        finally:
            tracker.stop_flag.set()
            duplicator.stop_flag.set()
            stack.stop_everything()
        summary["faults"] = {
            "service_kills": chaos.faults.service_kills, "broker_kills": chaos.faults.broker_kills,
            "pauses": chaos.faults.pauses, "redis_losses": chaos.faults.redis_losses,
            "redis_master_kills": chaos.faults.redis_master_kills,
            "skipped": chaos.faults.skipped, "copies_injected": sum(duplicator.copies.values()),
            "rebuild": chaos.faults.rebuild,
        }
    summary["seconds"] = round(time.monotonic() - t0, 1)
    violations: dict[str, int] = summary.get("violations", {})
    summary["violation_count"] = sum(violations.values())
    summary["ok"] = "error" not in summary and bool(violations) and summary["violation_count"] == 0
    return summary


def _clean_previous(stack: Stack, data_dir: Path, ports: Ports) -> None:
    """Stop what a previous (crashed) run left behind, then start from empty data."""
    stack.stop_everything()
    taken = [p for p in ports.all(stack.redis_cluster is not None) if port_in_use(HOST, p)]
    if taken:
        raise StackError(f"ports {taken} are taken by another process (another three-node cluster "
                         f"or chaos run?); choose others with --kafka-port/--redis-port/--registry-port")
    if data_dir.exists():
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True)


def _drive(plan: Plan, stack: Stack, submitter: Submitter, duplicator: Duplicator,
           tracker: Tracker, chaos: Chaos) -> dict[str, Any]:
    from choreo import contracts, topology
    from choreo.kafka import ensure_topics
    from choreo.runtime_events import RUNTIME_EVENTS
    from consumers.drone_scheduler import fleet
    from consumers.workflow import WORKFLOW

    started = time.monotonic()
    log(f"starting the private stack in {stack.cfg.data_dir}")
    stack.cluster.start(stack.cfg.start_timeout_s)
    stack.start_redis()
    topology.create(WORKFLOW)
    # the registry creates its store topic itself, but on a fresh multi-node cluster it then
    # asks for the watermarks before the metadata has spread and exits (reported): create it
    # first, with the registry's own settings, and wait until every topic has a leader
    ensure_topics({"_schemas": 1}, config={"cleanup.policy": "compact", "min.compaction.lag.ms": "0"})
    wait_leaders(60)
    stack.registry.start(timeout_s=60)
    contracts.register(contracts.topic_models(WORKFLOW, RUNTIME_EVENTS))
    stack.start_services()
    startup_s = time.monotonic() - started
    tracker.start()
    duplicator.start()
    log(f"traffic: {plan.deliveries} deliveries at {plan.rate_per_s:g}/s; {len(plan.faults)} faults planned")
    traffic_started = time.monotonic()
    submitter.start()
    chaos.run_faults()
    duplicator.stop_flag.set()
    duplicator.join(90)
    faults_over = time.monotonic()
    log(f"faults over; accepted {len(submitter.accepted)}; waiting up to {plan.settle_timeout_s:.0f}s "
        "for every delivery to end")
    if submitter.error:
        raise RuntimeError(f"submitter failed: {submitter.error}")
    pending = tracker.pending(list(submitter.accepted))
    while pending and time.monotonic() - faults_over < plan.settle_timeout_s:
        if tracker.error:
            raise RuntimeError(f"tracker failed: {tracker.error}")
        time.sleep(1.0)
        pending = tracker.pending(pending)
    settle_s = time.monotonic() - faults_over
    time.sleep(3.0)  # a last look for duplicates that would follow an outcome
    client = connect(stack.cfg.redis_url, socket_timeout=10)
    kept = drones_kept(client, fleet, set(submitter.accepted) - set(pending), DRONES_BACK_S)
    log(f"settled in {settle_s:.1f}s ({len(pending)} pending); stopping services, reading every topic")
    died = died_on_their_own(stack.services)
    stop_all(stack.services, timeout_s=20)
    since = fleet.history(client)
    if stack.redis_cluster is not None and chaos.fleet_before_loss:
        # the stream outlived the master kill: what came after it is what follows its last entry
        since = [entry for entry in since if _stream_id(entry[0]) > _stream_id(chaos.fleet_before_loss[-1][0])]
    history = FleetHistory(chaos.fleet_before_loss, since, chaos.redis_lost_at_ms)
    held_at_end = int(client.hlen(fleet.held_key))
    found = read_everything()
    result = judge(submitter, found, history, pending)
    # every kill of the plan was followed by a restart: an instance down now died by itself,
    # and nothing restarted it (a dead supervisor leaves every stuck delivery stuck)
    result["violations"]["services_died"] = len(died)
    if died:
        result["violation_examples"]["services_died"] = died
    # a drone booked for a delivery that ended is out of the fleet for good
    result["violations"]["drones_kept_by_ended_deliveries"] = len(kept)
    if kept:
        result["violation_examples"]["drones_kept_by_ended_deliveries"] = sorted(kept.items())[:5]
    if result["violations"]["double_bookings"]:
        evidence = stack.cfg.data_dir / "double-bookings.json"
        evidence.write_text(json.dumps(history.evidence(result["violation_examples"]["double_bookings"], found),
                                       indent=1))
        result["double_booking_evidence"] = str(evidence)
    stuck = sorted({*pending, *result["violation_examples"].get("missing_terminal", [])})[:STUCK_EVIDENCE]
    if stuck:
        evidence_file = stack.cfg.data_dir / "stuck-deliveries.json"
        result["stuck_evidence"] = stuck_evidence(stuck, client, WORKFLOW, evidence_file)
    result.update({"startup_s": round(startup_s, 1), "traffic_s": round(faults_over - traffic_started, 1),
                   "settle_s": round(settle_s, 1), "drones_held_at_end": held_at_end,
                   "fault_log": chaos.faults.events[-60:]})
    return result


def drones_kept(client: redis.Redis, fleet: Pool, ended: set[str], timeout_s: float) -> dict[str, str]:
    """The drones still booked for deliveries that ended (shipped, or failed with their undos
    confirmed), by delivery. The supervisor gives a shipped delivery's drone back as it reads
    the shipment, after the outcome is out: they are waited for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        booked = {text(holder): text(member) for holder, member in client.hgetall(fleet.booking_key).items()}
        kept = {holder: member for holder, member in booked.items() if holder in ended}
        if not kept or time.monotonic() > deadline:
            return kept
        time.sleep(0.5)


def _stream_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.decode().partition("-")
    return int(ms), int(seq or 0)


# -- the command ----------------------------------------------------------------------------

app = typer.Typer(add_completion=False, help="Chaos run on a private three-node stack (see infra/chaos.py).")


@app.callback(invoke_without_command=True)
def chaos_command(
    short: bool = typer.Option(False, "--short", help="the CI form (2,000 deliveries, one broker kill)"),
    deliveries: int = typer.Option(0, "--deliveries", "-n", help="deliveries (default 100,000; short 2,000)"),
    seed: int = typer.Option(0, help="seed of every random choice (0: pick one and print it)"),
    rate: float = typer.Option(0.0, help="deliveries per second (default: 40 short, 60 full)"),
    no_redis_loss: bool = typer.Option(False, "--no-redis-loss", help="skip the Redis loss and rebuild"),
    redis_cluster: bool = typer.Option(False, "--redis-cluster",
                                       help="a six-node Redis Cluster from the Redis port on; one master "
                                            "is killed under traffic instead of the Redis loss"),
    settle_timeout: float = typer.Option(0.0, help="seconds every delivery has to end after the faults"),
    kafka_port: int = typer.Option(19092, help="first broker port (three brokers + controller use 6)"),
    redis_port: int = typer.Option(0, help="the private Redis port (the cluster's first node); "
                                           "default 16379, on a cluster 16400 (its bus ports "
                                           "26400-26405 stay clear of the secured stack's 26379)"),
    registry_port: int = typer.Option(18081, help="the private registry port"),
    log_level: str = typer.Option("WARNING", help="the services' log level"),
    verbose: bool = typer.Option(False, "--verbose", help="keep the fault log in the JSON line"),
    leader_rebalance: int = typer.Option(LEADER_REBALANCE_S, "--leader-rebalance",
                                         help="seconds between the controller's hand-backs of "
                                              "partitions to a restarted broker (20: leaders and "
                                              "coordinators move in every run)"),
) -> None:
    """Run the chaos test on a private three-node stack; print one JSON line; exit 1 on any violation."""
    chosen_seed = seed or random.SystemRandom().randrange(1, 2**31)
    count = deliveries or (SHORT_DELIVERIES if short else FULL_DELIVERIES)
    redis_port = redis_port or (CLUSTER_REDIS_PORT if redis_cluster else Ports().redis)
    summary = run(count, chosen_seed, short, ports=Ports(kafka_port, redis_port, registry_port),
                  rate_per_s=rate or None, redis_loss=not no_redis_loss, redis_cluster=redis_cluster,
                  settle_timeout_s=settle_timeout or None, log_level=log_level,
                  leader_rebalance_s=leader_rebalance)
    if not verbose:
        summary.pop("fault_log", None)
    print(json.dumps(summary, sort_keys=False), flush=True)
    if not summary["ok"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
