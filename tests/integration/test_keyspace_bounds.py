"""Every Redis key a pipeline run leaves has a TTL or a declared bound: nothing lives forever
or grows without end.

The run is the real pipeline (``tests/services/ops_pipeline.py``: the services' own rules on
this test's private topics and groups, the notifier included), the real supervisor, and the
real submit path (``producers.submit``, owner tokens and idempotency keys on), against a
database of the shared stack's Redis that belongs to this module. Its deliveries end every
way a delivery can: shipped and released, failed with their package cancelled (a parcel no
drone carries), failed by the supervisor (steps opened for a request that was never
produced: past their deadline twice, the budget this run gives), and dead-lettered (an
undecodable event of a delivery, and one of no delivery at all). Then the services stop
and the whole database is walked with SCAN.

The rule: a key has a TTL no longer than the dedupe window (``CHOREO_DEDUPE_TTL_S``: what is
kept about a delivery goes with its tombstone, so it totals at most rate x window), or the
part of its name before the first ':' is one of ``BOUNDED``, whose entry says what bounds it
and checks its size. Key names are matched by that prefix only, so the rule holds whatever
hash tags follow it. (The schema registry keeps its records in the stack's own database,
not in this one.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import redis
from confluent_kafka import Producer

from choreo import topology
from choreo.config import settings
from choreo.envelope import Envelope
from choreo.kafka import ensure_topics
from choreo.pool import HISTORY_MAX
from choreo.publisher import Publish, Publisher
from choreo.release import released
from choreo.runner import RECOVERY_TOPIC
from choreo.state import delivery_key
from choreo.workflow import Workflow
from producers.admission import Admission
from producers.settings import IngestionSettings
from producers.submit import Submitter
from schemas.models import ALL_EVENTS, DeliveryRequested
from tests.factories import delivery_request, request_body
from tests.helpers import ServiceProcess, read_topic, start_group_at_end, wait_consuming, wait_for
from tests.services import ops_pipeline

pytestmark = pytest.mark.integration

DB = 13  # this module's database of the shared Redis
FLEET = 60
SHIPPED, HEAVY = 30, 6  # HEAVY: 99 kg, more than any drone carries: failed, package cancelled
MODULE = "tests.services.ops_pipeline"
# the steps' deadline: the supervisor fails the orphan past two of them (the join's is twice it)
DEADLINE_S = 10.0
IN_FLIGHT_CAP = 10_000


@dataclass(frozen=True)
class Bound:
    """Why keys of a prefix may live without a TTL, and how big one may get."""

    why: str
    limits: dict[str, int]  # by type, the most entries (bytes for a string) a key may hold


INTEGER = 20  # bytes of a 64-bit counter
RUN_DELIVERIES = SHIPPED + HEAVY + 2
# the structures that may live without a TTL, by the part of their name before the first ':'
BOUNDED = {
    "fleet": Bound("the drone pool: free, held and booking sized by the fleet, its history a stream "
                   "capped by MAXLEN", {"zset": FLEET, "hash": FLEET, "string": INTEGER, "stream": HISTORY_MAX}),
    "deadlines": Bound("the deadline index: one member per open step, gone when it closes",
                       {"zset": RUN_DELIVERIES * len(ops_pipeline.WORKFLOW.steps)}),
    "awaiting-operator": Bound("the steps whose undo failed for good, until an operator decides or the "
                               "supervisor trims them with their state's wait",
                               {"zset": RUN_DELIVERIES * len(ops_pipeline.WORKFLOW.steps)}),
    "ingestion": Bound("admission: the deliveries in flight, capped by INGESTION_MAX_IN_FLIGHT, and "
                       "their owners", {"zset": IN_FLIGHT_CAP, "hash": IN_FLIGHT_CAP}),
    "release": Bound("terminals awaiting release, capped per partition by the releaser",
                     {"zset": 200_000}),  # Releaser's cap
    "lease": Bound("a supervisor lease's fence counter, one per supervisor name", {"string": INTEGER}),
    "layout": Bound("the state's layout version: one key (choreo.layout)", {"string": INTEGER}),
}


@dataclass(frozen=True)
class Key:
    name: str
    kind: str
    ttl_s: int
    size: int  # entries (bytes for a string)
    memory: int

    @property
    def prefix(self) -> str:
        return self.name.split(":", 1)[0]

    def __str__(self) -> str:
        return f"{self.name} type={self.kind} ttl={self.ttl_s} size={self.size} bytes={self.memory}"


SIZE = {"hash": "HLEN", "zset": "ZCARD", "set": "SCARD", "list": "LLEN", "stream": "XLEN",
        "string": "STRLEN"}


def walk(client: redis.Redis) -> list[Key]:
    """Every key of the database, with its type, TTL, size and memory."""
    keys = sorted(client.scan_iter(count=1000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
        pipe.ttl(key)
        pipe.memory_usage(key)
    facts = pipe.execute()
    kinds = [k.decode() for k in facts[0::3]]
    pipe = client.pipeline(transaction=False)
    for key, kind in zip(keys, kinds):
        pipe.execute_command(SIZE.get(kind, "EXISTS"), key)
    sizes = pipe.execute()
    return [Key(key.decode(), kind, int(ttl), int(size), int(memory or 0))
            for key, kind, ttl, memory, size in zip(keys, kinds, facts[1::3], facts[2::3], sizes)]


def offenders(keys: list[Key], max_ttl_s: int) -> list[tuple[Key, str]]:
    """Keys with neither a TTL within ``max_ttl_s`` nor a declared bound that holds them,
    each with why."""
    found = []
    for key in keys:
        bound = BOUNDED.get(key.prefix)
        if key.ttl_s > max_ttl_s:
            found.append((key, f"expires only after {key.ttl_s}s, past the dedupe window {max_ttl_s}s"))
        elif key.ttl_s > 0:
            continue
        elif bound is None:
            found.append((key, "no TTL, no declared bound"))
        elif key.kind not in bound.limits:
            found.append((key, f"a {key.kind} where {key.prefix!r} declares {sorted(bound.limits)}"))
        elif key.size > bound.limits[key.kind]:
            found.append((key, f"past its bound {bound.limits[key.kind]} ({bound.why})"))
    return found


def report(found: list[tuple[Key, str]]) -> str:
    lines = [f"{key}: {why}" for key, why in found]
    for line in lines:
        print("  OFFENDER", line)
    return f"{len(lines)} keys can live forever, too long, or grow without bound:\n" + "\n".join(lines[:40])


class Routed(Publisher):
    """The ingestion's publisher, writing to this test's prefixed entry topic."""

    def __init__(self, prefix: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def publish_many(self, items: Any) -> Any:
        return super().publish_many([replace(i, topic=self.prefix + (i.topic or i.event.topic)) for i in items])


@dataclass
class Run:
    prefix: str
    flow: Workflow
    client: redis.Redis
    procs: list[ServiceProcess]

    def topic(self, name: str) -> str:
        return self.prefix + name

    def keys(self, name: str) -> set[str]:
        return {r.key.decode() for r in read_topic(self.topic(name)) if r.key}


@dataclass(frozen=True)
class Walked:
    keys: list[Key]
    ended: dict[str, set[str]]  # how they ended -> delivery ids


@pytest.fixture(scope="module")
def walked(stack: None) -> Iterator[Walked]:
    """The run, once for the module's tests, and the keyspace it left."""
    unique = uuid.uuid4().hex[:10]
    prefix = f"t.ks.{unique}."
    client = redis.Redis(host="127.0.0.1", port=6379, db=DB)
    client.flushdb()  # this database belongs to this module
    flow = ops_pipeline.workflow(prefix, ops_pipeline.build(prefix, deadline_s=DEADLINE_S))
    topology.create(flow, partitions=3)
    ensure_topics({f"{prefix}{m.topic}{suffix}": 3 for m in ALL_EVENTS for suffix in ("", ".dlq")
                   if m.topic not in ("recovery", "compensation.log")})
    ensure_topics({prefix + "compensation.log": 3}, config={"cleanup.policy": "compact"})
    supervisor = f"sup-ks-{unique}"
    start_group_at_end(supervisor, RECOVERY_TOPIC)
    env = {"OPS_PREFIX": prefix, "REDIS_URL": f"redis://127.0.0.1:6379/{DB}", "DRONE_FLEET_SIZE": str(FLEET),
           "OPS_DEADLINE_S": str(DEADLINE_S)}
    procs = [ServiceProcess(f"{MODULE}:{role}", instance=unique, env=env, workflow=f"{MODULE}:WORKFLOW").start()
             for role in ops_pipeline.ROLES]
    procs.append(ServiceProcess("choreo.supervisor:service", instance=supervisor, workflow=f"{MODULE}:WORKFLOW",
                                env={**env, "SUPERVISOR_NAME": supervisor, "SUPERVISOR_TOPIC_PREFIX": prefix,
                                     "SUPERVISOR_WORKFLOW": f"{MODULE}:WORKFLOW",
                                     "SUPERVISOR_SCAN_PERIOD_S": "0.2", "SUPERVISOR_BACKOFF_BASE_S": "0.3",
                                     "SUPERVISOR_LEASE_TTL_S": "2", "SUPERVISOR_MAX_TRIES": "2"}).start())
    try:
        ended = end_every_way(Run(prefix, flow, client, procs))
        keys = walk(client)
        summarize(keys)
        yield Walked(keys, ended)
    finally:
        for proc in procs:
            proc.kill()
        client.close()


def submit(run: Run, plain: list[DeliveryRequested]) -> set[str]:
    """The real submit path for the ones that ship, a plain publish for ``plain`` (ids the
    test chooses, weights the door refuses); the ids submitted."""
    cfg = IngestionSettings(INGESTION_MAX_IN_FLIGHT=IN_FLIGHT_CAP, INGESTION_OWNER_SHARE=1,
                            INGESTION_MAX_BACKLOG=0)
    submitter = Submitter(cfg, workflow=run.flow, redis_client=run.client,
                          publisher=Routed(run.prefix, "ingestion", run.flow, redis_client=run.client),
                          admission=Admission(cfg, run.client, run.flow, run.topic("delivery.requested"))).start()
    try:
        sent = [submitter.submit(request_body(owner_id=f"owner-{i % 3}"), idempotency_key=str(uuid.uuid4()),
                                 owner=f"owner-{i % 3}") for i in range(SHIPPED)]
        for submission in sent:
            submission.confirmed.result(timeout=60)
    finally:
        submitter.close()
    publish(run, plain)
    return {s.delivery_id for s in sent}


def publish(run: Run, requests: list[DeliveryRequested]) -> None:
    """A plain publish of ``requests``, past the door."""
    publisher = Publisher("test", run.flow, redis_client=run.client)
    publisher.publish_many([Publish(r, str(uuid.uuid4()), topic=run.topic("delivery.requested")) for r in requests])
    publisher.flush(30)


def poison(topic: str, delivery_id: str) -> None:
    """An undecodable event of ``delivery_id``, with a valid envelope: a dead letter."""
    headers = Envelope(str(uuid.uuid4()), delivery_id, event_type="Poison").to_headers()
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    producer.produce(topic, key=delivery_id.encode(), value=b"\x00garbage", headers=headers)
    producer.flush(10)


def end_every_way(run: Run) -> dict[str, set[str]]:
    """Deliveries that end each way, every one ended and its aftermath done, then the
    services stopped (nothing writes while the keyspace is walked)."""
    orphan = str(uuid.uuid4())  # its steps opened, its request never produced: the supervisor fails it
    publisher = Publisher("test", run.flow, redis_client=run.client)
    publisher.open_steps([(orphan, run.topic("delivery.requested"))])
    # the others' steps open once every service consumes: a start slower than a deadline
    # would requeue them, and a second miss fail them
    wait_consuming(s.name for s in run.flow.services)
    # a dead letter of it once its steps are open (before, there is no state to note it in),
    # its request published at once after: it ships, and its state is kept
    kept = delivery_request()
    publisher.open_steps([(kept.delivery_id, run.topic("delivery.requested"))])
    poison(run.topic("delivery.requested"), kept.delivery_id)
    wait_for(lambda: run.client.hexists(delivery_key(kept.delivery_id), "dead_letters"), timeout_s=30,
             what="the dead letter noted in the delivery's state")
    publish(run, [kept])
    heavy = [delivery_request(weight_kg=99.0) for _ in range(HEAVY)]
    shipping = submit(run, heavy) | {kept.delivery_id}
    heavy_ids = {r.delivery_id for r in heavy}
    stray = str(uuid.uuid4())
    poison(run.topic("delivery.requested"), stray)  # a dead letter of no delivery at all
    wait_for(lambda: run.keys("delivery.shipped") | run.keys("delivery.failed") >= shipping | heavy_ids | {orphan},
             timeout_s=150, interval_s=1.0, what="every delivery to end")
    assert run.keys("delivery.shipped") >= shipping and run.keys("delivery.failed") >= heavy_ids | {orphan}
    lettered = sorted(shipping - {kept.delivery_id})[0]
    poison(run.topic("delivery.shipped"), lettered)  # read after its end by the notifier
    wait_for(lambda: run.keys("package.cancelled") >= heavy_ids, timeout_s=60,
             what="the heavy ones' packages cancelled")
    wait_for(lambda: lettered in run.keys("delivery.shipped.dlq")
             and {stray, kept.delivery_id} <= run.keys("delivery.requested.dlq"), timeout_s=60, what="the dead letters")
    freed = shipping - {lettered, kept.delivery_id}
    wait_for(lambda: released(run.client, freed) == freed, timeout_s=60, what="the shipped deliveries released")
    for proc in run.procs:
        proc.stop()
    assert kept.delivery_id not in released(run.client, [kept.delivery_id])  # kept for a redrive
    return {"shipped and released": freed, "compensated": heavy_ids, "failed by the supervisor": {orphan},
            "dead-lettered": {lettered, stray, kept.delivery_id}}


def summarize(keys: list[Key]) -> None:
    print(f"\n{len(keys)} keys after the run:")
    by_prefix: dict[str, list[Key]] = {}
    for key in keys:
        by_prefix.setdefault(key.prefix, []).append(key)
    for prefix, group in sorted(by_prefix.items()):
        forever = [k for k in group if k.ttl_s < 0]
        print(f"  {prefix}: {len(group)} keys, {len(forever)} without TTL (largest "
              f"{max((k.size for k in forever), default=0)} entries), longest TTL "
              f"{max(k.ttl_s for k in group)}s, types {sorted({k.kind for k in group})}, "
              f"{sum(k.memory for k in group)} bytes")


def test_every_key_left_by_a_run_has_a_ttl_or_a_declared_bound(walked: Walked) -> None:
    for how, ids in walked.ended.items():  # the walk saw what each ending leaves
        assert all(any(d in k.name for k in walked.keys) for d in ids), how
    found = offenders(walked.keys, settings().dedupe_ttl_s)
    assert not found, report(found)
