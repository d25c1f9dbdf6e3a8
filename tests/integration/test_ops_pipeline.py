"""Rebuild after FLUSHALL and the traces of a compensated and a requeued delivery, on the
real stack.

The pipeline runs as real processes with the real business rules, on this test's private
topics, consumer groups and Redis (``tests/services/ops_pipeline.py``): the shared stack
may be running a demo or another test's pipeline on the real topics and groups, and a
FLUSHALL of the shared Redis would pull the rug from under them.
"""

from __future__ import annotations

import io
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from datetime import UTC, datetime
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import fastavro
import pytest
import redis
from confluent_kafka import Producer
from confluent_kafka.admin import NewPartitions
from confluent_kafka.schema_registry import Schema

from choreo import topology
from choreo.config import settings
from choreo.kafka import admin, ensure_topics
from choreo.join import UNREAD_FAILURE_S
from choreo.ops import status
from choreo.ops.rebuild import DeliveryFacts, RebuildReport, Rebuilder, rebuild
from choreo.ops.records import Rec, partition_for
from choreo.ops.trace import trace
from choreo.dedupe import seen_key
from choreo.envelope import Envelope, now_ms
from choreo.publisher import Publish, Publisher
from choreo.redis_client import connect
from choreo.release import Releaser, released
from choreo.runner import RECOVERY_TOPIC
from choreo.runtime_events import CompensationRecord
from choreo.serde import Encoder, registry_client
from choreo.service import retry_topic
from choreo.supervision import CLOSED_BY_FAILURE, awaiting_operator_index
from choreo.state import StateTable, delivery_key, index_member, text
from choreo.workflow import Workflow
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from consumers.delivery import RETENTION_S as DECIDED_RETENTION_S
from infra.chaos import stuck_evidence
from schemas.models import ALL_EVENTS, DeliveryFailed, DroneReleased, DroneScheduled, PackageReady
from tests.factories import delivery_request
from tests.helpers import CLUSTER_URL, ServiceProcess, read_topic, start_group_at_end, wait_consuming, wait_for
from tests.services import ops_pipeline

pytestmark = pytest.mark.integration

FLEET = 200
# a shipped delivery's state table is released soon after it ends (choreo.release): the trace
# then finds the request event in the entry topic by itself
STARTS = ("state table", "request event before the state table's times", "request event")


@pytest.fixture()
def private_redis() -> Iterator[redis.Redis]:
    if CLUSTER_URL:  # the cluster lane: the cluster is this test's alone while it runs
        client = connect(CLUSTER_URL, socket_timeout=5)
        client.flushall()
        yield client
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="ops-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=5)
    wait_for(lambda: _pings(client), timeout_s=10, interval_s=0.1, what="private redis")
    yield client
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(workdir, ignore_errors=True)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@dataclass
class IsolatedPipeline:
    prefix: str
    client: redis.Redis
    env: dict[str, str] = field(default_factory=dict)
    procs: list[ServiceProcess] = field(default_factory=list)

    @property
    def flow(self) -> Workflow:
        return ops_pipeline.workflow(self.prefix, ops_pipeline.build(self.prefix))

    def _env(self) -> dict[str, str]:
        url = CLUSTER_URL or "redis://{host}:{port}/0".format(**self.client.connection_pool.connection_kwargs)
        return {"OPS_PREFIX": self.prefix, "REDIS_URL": url,
                "DRONE_FLEET_SIZE": str(FLEET), **self.env}

    def start(self) -> IsolatedPipeline:
        env = self._env()
        self.procs = [ServiceProcess(f"tests.services.ops_pipeline:{role}", instance=uuid.uuid4().hex[:6],
                                     env=env, workflow="tests.services.ops_pipeline:WORKFLOW").start()
                      for role in ops_pipeline.ROLES]
        return self

    def supervise(self, name: str, **env: str) -> ServiceProcess:
        """The real supervisor on this pipeline: its own group and lease (``name``), this
        pipeline's topics, workflow and Redis. A new group joins the shared recovery topic
        at its end, as a deployed one would, not at its history."""
        start_group_at_end(name, RECOVERY_TOPIC)
        proc = ServiceProcess("choreo.supervisor:service", instance=name,
                              workflow="tests.services.ops_pipeline:WORKFLOW",
                              env={**self._env(), "SUPERVISOR_NAME": name,
                                   "SUPERVISOR_TOPIC_PREFIX": self.prefix,
                                   "SUPERVISOR_WORKFLOW": "tests.services.ops_pipeline:WORKFLOW", **env})
        self.procs.append(proc.start())
        return proc

    def stop(self) -> None:
        """SIGTERM to every instance at once, then wait: each finishes its batch and leaves."""
        for proc in self.procs:
            if proc.proc is not None and proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.stop()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()

    def submit(self, n: int, **overrides: float) -> list[str]:
        publisher = Publisher("test", self.flow, redis_client=self.client)
        requests = [delivery_request(weight_kg=overrides.get("weight_kg", 1.0 + i % 4)) for i in range(n)]
        for r in requests:
            publisher.publish(r, str(uuid.uuid4()), topic=self.prefix + "delivery.requested")
        publisher.flush(30)
        return [r.delivery_id for r in requests]

    def terminal(self, ids: set[str]) -> Counter[str]:
        counts: Counter[str] = Counter()
        for topic in ("delivery.shipped", "delivery.failed"):
            for record in read_topic(self.prefix + topic):
                if record.key and record.key.decode() in ids:
                    counts[record.key.decode()] += 1
        return counts


@pytest.fixture()
def isolated(stack: None, private_redis: redis.Redis, unique: str,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[IsolatedPipeline]:
    monkeypatch.setenv("DRONE_FLEET_SIZE", str(FLEET))  # what the rebuild grows the fleet to
    pipeline = IsolatedPipeline(f"t.ops.{unique}.", private_redis)
    topology.create(pipeline.flow, partitions=3)
    # outputs are declared by model (unprefixed names): create their prefixed topics too, so
    # nothing is auto-created with another partition count
    ensure_topics({f"{pipeline.prefix}{m.topic}{suffix}": 3 for m in ALL_EVENTS for suffix in ("", ".dlq")
                   if m.topic not in ("recovery", "compensation.log")})
    yield pipeline
    pipeline.kill()


def test_flushall_mid_run_then_rebuild_every_delivery_ends_once(isolated: IsolatedPipeline) -> None:
    isolated.env = {"AGENT_WAREHOUSE_LATENCY_MS": "40", "OPS_BATCH": "10"}
    client = isolated.client
    started = int(time.time() * 1000)
    isolated.start()
    ids = set(isolated.submit(200))
    wait_for(lambda: len(isolated.terminal(ids)) >= 20, timeout_s=40, interval_s=0.3, what="first deliveries")
    with pytest.raises(RuntimeError, match="still consuming"):
        rebuild(isolated.flow, since_ms=started - 5000, client=client, prefix=isolated.prefix)
    isolated.stop()  # pause: each instance finishes its batch, commits and leaves its group
    before = isolated.terminal(ids)
    assert 20 <= len(before) < len(ids), "the wipe must hit deliveries in flight"
    client.flushall()
    report = rebuild(isolated.flow, since_ms=started - 5000, client=client,
                     prefix=isolated.prefix, pass_records=100)
    assert report.outcomes == len(before)
    assert report.booking_conflicts == []
    assert report.steps > 0 and report.seen_entries > 0
    # the side topics' pass, then each partition (the isolated topics have 3) in shares of
    # its deliveries, as it holds more than 100 records: no pass held a partition's worth
    assert report.passes > 1 + 3 and 0 < report.most_deliveries_held < report.deliveries / 3
    # none forever: a failure waits for the supervisor's reading (none runs yet) at most a day
    failed = {r.key.decode() for r in read_topic(isolated.prefix + "delivery.failed") if r.key}
    assert all(0 < client.ttl(delivery_key(d)) <= (UNREAD_FAILURE_S if d in failed else DECIDED_RETENTION_S)
               for d in before)
    isolated.start()  # resume
    isolated.supervise(f"sup-ops-{uuid.uuid4().hex[:8]}")  # it gives the shipped deliveries' drones back
    counts = wait_for(lambda: len(c := isolated.terminal(ids)) == len(ids) and c, timeout_s=60,
                      interval_s=0.5, what="every delivery to end")
    assert set(counts.values()) == {1}
    assert fleet.double_bookings(client) == []
    # every drone came back: the fleet is whole again, no booking leaked
    wait_for(lambda: not (set(_bookings(client)) & ids), timeout_s=20, what="drones returned")
    held = {k.decode(): v.decode() for k, v in client.hgetall(fleet.held_key).items()}
    assert all(_bookings(client).get(d) == drone for drone, d in held.items())
    # the rebuild handed the deliveries shipped before the wipe back to the release (its
    # record of their terminals was wiped too): once their readers are past, they are freed
    shipped = {r.key.decode() for r in read_topic(isolated.prefix + "delivery.shipped")
               if r.key and r.key.decode() in before}
    assert shipped and report.awaiting_release == len(shipped)
    releaser = Releaser(client, admin(), isolated.prefix + "delivery.shipped",
                        isolated.flow.consumer_groups(isolated.prefix + "delivery.shipped"),
                        [s.name for s in isolated.flow.services], isolated.flow.released_keys, 600)
    wait_for(lambda: releaser.release_due(int(time.time() * 1000)) and released(client, shipped) == shipped,
             timeout_s=30, interval_s=0.5, what="the deliveries shipped before the wipe released")


def test_rebuild_restores_a_drone_only_to_its_latest_booking(isolated: IsolatedPipeline) -> None:
    """A kill can abort the transaction of a release whose Redis effect already ran: Kafka
    then shows the drone booked by A (never released) and later by B. Only B can hold it,
    even when a copy of A's booking (a replay, a redrive) was written after B's."""
    started = int(time.time() * 1000)
    first, second = _book_drone_twice(isolated)
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client,
                     prefix=isolated.prefix)
    # the side topics, then the two partitions the bookings are in: the latest holder is
    # known across passes
    assert report.passes == 3 and report.most_deliveries_held == 1 and report.one_group_because == ""
    assert report.booking_conflicts == []
    assert (report.bookings_restored, report.bookings_superseded) == (1, 1)
    assert isolated.client.hget(fleet.held_key, "drone-00007") == second.encode()
    assert _bookings(isolated.client).get(first) is None


def test_rebuild_restores_a_booking_a_newer_version_of_its_service_wrote(isolated: IsolatedPipeline) -> None:
    """A v2 of the drone service adds an optional field to ``drone.scheduled``, as a rolling
    upgrade may (the registry's BACKWARD check). The rebuild reads bodies as their writer
    wrote them, and the v1 model refused the whole body for the field it does not know: the
    booking and the join's part were not restored, and the drone was free while booked."""
    started = int(time.time() * 1000)
    topic = isolated.prefix + DroneScheduled.topic
    v2 = json.loads(DroneScheduled.avro_schema())
    v2["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    schema_id = registry_client().register_schema(f"{topic}-value", Schema(json.dumps(v2), "AVRO"))
    delivery = str(uuid.uuid4())
    booking = DroneScheduled(delivery_id=delivery, drone_id="drone-00007", scheduled_at=datetime.now(UTC))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v2), {**booking.to_avro(), "note": "from v2"})
    envelope = Envelope.first(str(uuid.uuid4()), delivery, "DroneScheduled", "drone-scheduler")
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})
    producer.produce(topic, key=delivery.encode(), value=b"\x00" + schema_id.to_bytes(4, "big") + body.getvalue(),
                     headers=envelope.to_headers())
    assert producer.flush(30) == 0
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client, prefix=isolated.prefix)
    assert report.bookings_restored == 1
    assert _bookings(isolated.client).get(delivery) == "drone-00007"
    assert isolated.client.hexists(delivery_key(delivery), "fanin.drone")


def _ids_in_partitions(count: int, partitions: int = 3) -> list[str]:
    """Delivery ids that each lie in another partition (by the producers' partitioner): the
    rebuild reads them in different passes."""
    found: dict[int, str] = {}
    while len(found) < count:
        delivery = str(uuid.uuid4())
        found.setdefault(partition_for(delivery.encode(), partitions), delivery)
    return list(found.values())


def _book_drone_twice(isolated: IsolatedPipeline) -> tuple[str, str]:
    """Two deliveries, in different partitions, that booked one drone in turn, and a later
    copy of the first booking (a replay, a redrive): only the second can hold the drone."""
    publisher = Publisher("test", redis_client=isolated.client)
    first, second = (delivery_request(delivery) for delivery in _ids_in_partitions(2))
    bookings = [(DroneScheduled(delivery_id=request.delivery_id, drone_id="drone-00007",
                                scheduled_at=datetime.now(UTC)), str(uuid.uuid4()))
                for request in (first, second)]
    for booking, event_id in [*bookings, bookings[0]]:
        publisher.publish(booking, event_id, topic=isolated.prefix + DroneScheduled.topic)
        publisher.flush(30)
        time.sleep(0.01)  # each is produced later, as the fleet script ordered the first two
    return first.delivery_id, second.delivery_id


def test_a_rebuild_reads_the_window_in_one_pass_when_its_topics_are_not_co_partitioned(
        isolated: IsolatedPipeline) -> None:
    """A partition number holds the same deliveries in every topic only when the counts
    agree: with one topic grown, the rebuild reads the workflow's topics in one pass."""
    started = int(time.time() * 1000)
    grown = isolated.prefix + PackageReady.topic
    client = admin()  # held until the answer: a destroyed handle fails its futures
    client.create_partitions([NewPartitions(grown, 4)])[grown].result(timeout=30)
    first, second = _book_drone_twice(isolated)
    ready = PackageReady(delivery_id=first, package_id=f"pkg-{first}", package_size="S", weight_kg=1.0,
                         ready_at=datetime.now(UTC))
    publisher = Publisher("test", redis_client=isolated.client)
    publisher.publish(ready, str(uuid.uuid4()), topic=grown)
    publisher.flush(30)
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client,
                     prefix=isolated.prefix)
    assert report.passes == 2 and report.most_deliveries_held == report.deliveries == 2
    assert report.one_group_because == "the workflow's topics have different partition counts"
    assert report.fanin_fields == 3  # both drones and the package
    assert (report.bookings_restored, report.bookings_superseded) == (1, 1)
    assert isolated.client.hget(fleet.held_key, "drone-00007") == second.encode()
    assert _bookings(isolated.client).get(first) is None


def test_a_record_outside_its_deliverys_partition_makes_the_rebuild_read_its_topics_together(
        isolated: IsolatedPipeline) -> None:
    """A delivery's release lies in another partition than its booking (keyed by something
    else than its delivery; partitions added within the window or another partitioner do
    the same). Read a partition at a time, the booking would be restored to a finished
    delivery; the rebuild finds the record first and reads the topics as one group."""
    started = int(time.time() * 1000)
    booked, key = _ids_in_partitions(2)
    publisher = Publisher("test", redis_client=isolated.client)
    publisher.publish(DroneScheduled(delivery_id=booked, drone_id="drone-00007", scheduled_at=datetime.now(UTC)),
                      str(uuid.uuid4()), topic=isolated.prefix + DroneScheduled.topic)
    # the booked delivery's release, keyed by another delivery's id: in another partition
    release = DroneReleased(delivery_id=booked, drone_id="drone-00007", released_at=datetime.now(UTC))
    target = isolated.prefix + DroneReleased.topic
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})
    producer.produce(target, key=key.encode(), value=Encoder(DroneReleased, target, registry_client())(release),
                     headers=Envelope.first(str(uuid.uuid4()), booked, "DroneReleased", "test").to_headers())
    assert producer.flush(30) == 0
    publisher.flush(30)
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client,
                     prefix=isolated.prefix)
    assert isolated.client.hget(fleet.held_key, "drone-00007") is None
    assert (report.bookings_restored, report.bookings_superseded) == (0, 0)
    assert report.one_group_because.endswith("lies outside its delivery's partition")
    assert report.passes == 2 and report.deliveries == 1


def test_rebuild_restores_a_requeued_step_at_its_attempt(isolated: IsolatedPipeline) -> None:
    """Redis is lost while a requeue (attempt 2) waits unread in its retry topic. The rebuild
    opens the step at attempt 2: the supervisor's next claim is then attempt 3. Opened at
    attempt 1, as it was, the claim was attempt 2 again, and the same retry went out twice
    (the short chaos run caught it once: one (event id, attempt) twice on a retry topic)."""
    started = int(time.time() * 1000)
    flow = isolated.flow
    drone = next(s for s in flow.services if any(h.step == "drone" for h in s.handlers.values()))
    request = delivery_request()
    requeue = Envelope.first(str(uuid.uuid4()), request.delivery_id, "DeliveryRequested",
                             "supervisor").with_attempt(2)
    publisher = Publisher("test", redis_client=isolated.client)
    retry = retry_topic(drone.name, isolated.prefix + "delivery.requested")
    [sent] = publisher.publish_many([Publish(request, requeue.event_id, topic=retry, envelope=requeue)])
    assert not isinstance(sent, Exception)
    publisher.flush(30)
    report = rebuild(flow, since_ms=started - 5000, client=isolated.client,
                     prefix=isolated.prefix)
    assert report.open_steps >= 1
    step = StateTable(isolated.client).steps(request.delivery_id)["drone"]
    assert (step.status, step.attempt) == ("pending", 2)


def test_rebuild_begins_no_step_from_a_request_its_services_dead_letter_unread(isolated: IsolatedPipeline) -> None:
    """Redis is lost with three requests unread in the entry topic: a good one, one past the
    services' hop limit, and one written with another topic's schema. The services
    dead-letter the last two unread (``Runner._prepare``), so the rebuild opens the good
    one's steps alone; restored as pending, the others' steps would be requeued with the same
    bytes until the supervisor failed their deliveries."""
    started = int(time.time() * 1000)
    flow = isolated.flow
    topic = isolated.prefix + "delivery.requested"
    limit = min(s.max_hops for s in flow.services if topic in s.handlers)
    good, far, foreign = delivery_request(), delivery_request(), delivery_request()
    far_envelope = replace(Envelope.first(str(uuid.uuid4()), far.delivery_id, "DeliveryRequested", "test"),
                           hops=limit + 1)
    publisher = Publisher("test", redis_client=isolated.client)
    sent = publisher.publish_many([Publish(good, str(uuid.uuid4()), topic=topic),
                                   Publish(far, str(uuid.uuid4()), topic=topic, envelope=far_envelope)])
    assert not any(isinstance(e, Exception) for e in sent)
    publisher.flush(30)
    # a body of the foreign delivery, in a schema registered under another topic's subject
    ready = PackageReady(delivery_id=foreign.delivery_id, package_id="p", package_size="SMALL", weight_kg=1.0,
                         ready_at=datetime.now(UTC))
    value = Encoder(PackageReady, isolated.prefix + PackageReady.topic, registry_client())(ready)
    envelope = Envelope.first(str(uuid.uuid4()), foreign.delivery_id, "DeliveryRequested", "test")
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})
    producer.produce(topic, key=foreign.delivery_id.encode(), value=value, headers=envelope.to_headers())
    assert producer.flush(30) == 0
    isolated.client.flushall()  # Redis lost
    report = rebuild(flow, since_ms=started - 5000, client=isolated.client, prefix=isolated.prefix)
    table = StateTable(isolated.client)
    assert {name: s.status for name, s in table.steps(good.delivery_id).items()} == {
        "package": "pending", "drone": "pending"}
    assert table.steps(far.delivery_id) == {} and table.steps(foreign.delivery_id) == {}
    assert report.open_steps == 2


def test_rebuild_closes_the_unbegun_steps_of_a_delivery_that_failed(isolated: IsolatedPipeline) -> None:
    """Redis is lost after the supervisor failed a delivery whose request its step services
    had not read yet (they lagged past its deadlines). The supervisor had closed those steps
    with a new token, in Redis only. Opened again as pending, the drone step would take a
    drone for a failed delivery once its service read the request, and nothing would give it
    back (the failure is not read again). The rebuild closes them as the supervisor did."""
    started = int(time.time() * 1000)
    [delivery] = isolated.submit(1)
    failure = DeliveryFailed(delivery_id=delivery, reason="DEADLINE_MISSED", detail="drone pending after 3 tries",
                             failed_step="drone", compensate=[], failed_at=datetime.now(UTC))
    publisher = Publisher("supervisor", redis_client=isolated.client)
    publisher.publish(failure, str(uuid.uuid4()), topic=isolated.prefix + DeliveryFailed.topic)
    publisher.flush(30)
    isolated.client.flushall()  # Redis lost, with the supervisor's closing of the steps
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client, prefix=isolated.prefix)
    assert (report.outcomes, report.open_steps, report.closed_steps) == (1, 0, 2)
    steps = StateTable(isolated.client).steps(delivery)
    assert {name: (s.status, s.attempt, s.error) for name, s in steps.items()} == {
        name: ("failed", 2, CLOSED_BY_FAILURE) for name in ("package", "drone")}
    join = isolated.flow.joins[0]  # no supervisor read the failure: its state waits for one
    assert join.retention_s < isolated.client.ttl(delivery_key(delivery)) <= join.unread_failure_s
    isolated.start()  # the services read the request now: the stale trigger starts nothing
    services = {s.name for s in isolated.flow.services if s.name.endswith(("package", "drone-scheduler"))}
    wait_for(lambda: {text(f).split(":", 1)[0] for f in isolated.client.hkeys(seen_key(delivery))} >= services,
             timeout_s=60, interval_s=0.3, what="both step services to read the request")
    time.sleep(1.0)  # past their batch's commit
    assert delivery not in _bookings(isolated.client)
    for topic in (DroneScheduled.topic, PackageReady.topic):
        assert not [r for r in read_topic(isolated.prefix + topic, timeout_s=3) if r.key == delivery.encode()]


def test_rebuild_leaves_free_the_drone_of_an_undo_marked_done_by_hand(isolated: IsolatedPipeline) -> None:
    """An operator marked a drone step's failed undo done by hand (``choreo ops
    mark-compensated``): the supervisor gave the drone back with no ``drone.released``, as
    the undo never ran. Its compensation log says the step is compensated, and a rebuild
    after a Redis loss leaves that drone free; the drone of a delivery with no such record is
    held again."""
    started = int(time.time() * 1000)
    marked, held = str(uuid.uuid4()), str(uuid.uuid4())
    publisher = Publisher("drone-scheduler", redis_client=isolated.client)
    for delivery, drone in ((marked, "drone-00001"), (held, "drone-00002")):
        publisher.publish(DroneScheduled(delivery_id=delivery, drone_id=drone, scheduled_at=datetime.now(UTC)),
                          str(uuid.uuid4()), topic=isolated.prefix + DroneScheduled.topic)
    publisher.publish(CompensationRecord(delivery_id=marked, step="drone", status="COMPENSATED", attempt=1,
                                         recorded_at=datetime.now(UTC)),
                      str(uuid.uuid4()), topic=CompensationRecord.topic)  # the supervisor's log
    publisher.flush(30)
    isolated.client.flushall()
    report = rebuild(isolated.flow, since_ms=started - 5000, client=isolated.client, prefix=isolated.prefix)
    bookings = _bookings(isolated.client)
    assert bookings.get(held) == "drone-00002" and marked not in bookings, bookings
    assert (report.bookings_restored, report.bookings_left_free) == (1, 1)
    assert StateTable(isolated.client).fields(marked)["drone.status"] == "compensated"


def test_rebuild_keeps_a_delivery_whose_undo_failed_for_good_waiting_for_an_operator(
        private_redis: redis.Redis) -> None:
    """Its compensation log ends COMPENSATION_FAILED: the rebuilt state waits for the mark
    by hand as long as the supervisor's own state did (a day), not the retention; a failed
    delivery whose undos ended keeps the retention."""
    rebuilder = Rebuilder(WORKFLOW, private_redis)
    waiting, done, before_window = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    rebuilder.facts = {d: DeliveryFacts(outcome="failed") for d in (waiting, done)}  # both read
    rebuilder.compensation = {waiting: {"package": "compensation_failed"}, done: {"package": "compensated"},
                              before_window: {"package": "compensation_failed"}}  # its failure not read
    report = RebuildReport(since_ms=0)
    rebuilder._write_joins(report)
    assert WORKFLOW.retention_s < private_redis.ttl(delivery_key(waiting)) <= WORKFLOW.unread_failure_s
    assert 0 < private_redis.ttl(delivery_key(done)) <= WORKFLOW.retention_s
    # a pass made before_window's state from its undo's records alone (no outcome: no TTL)
    StateTable(private_redis).put(before_window, {"cancel_package.status": "failed"})
    # listed again as waiting for an operator, from the rebuild on, as its state waits from then
    before = now_ms()
    rebuilder._write_side(report)
    assert report.awaiting_operator == 2
    listed = private_redis.zscore(awaiting_operator_index(waiting), index_member(waiting, "package"))
    assert listed is not None and before <= listed <= now_ms()
    assert private_redis.zscore(awaiting_operator_index(done), index_member(done, "package")) is None
    view = status.deliveries(private_redis, undo_steps=status.undo_steps(WORKFLOW))
    assert {(v.delivery_id, v.step) for v in view.awaiting_operator} == {(waiting, "package"),
                                                                         (before_window, "package")}
    # a dead letter of a delivery no pass held is counted for a while, not forever; the state
    # of a delivery in flight (no TTL: a rebuild on a live Redis) keeps its life
    lonely, in_flight = str(uuid.uuid4()), str(uuid.uuid4())
    StateTable(private_redis).put(in_flight, {"package.status": "pending"})
    rebuilder.side_dead_letters = {lonely: 1, in_flight: 1, before_window: 1}
    rebuilder._write_side(report)
    assert text(private_redis.hget(delivery_key(lonely), "dead_letters")) == "1"
    assert 0 < private_redis.ttl(delivery_key(lonely)) <= settings().dedupe_ttl_s
    assert text(private_redis.hget(delivery_key(in_flight), "dead_letters")) == "1"
    assert private_redis.ttl(delivery_key(in_flight)) == -1
    # the state of a failure no pass read waits as the supervisor's would, and then goes
    assert WORKFLOW.retention_s < private_redis.ttl(delivery_key(before_window)) <= WORKFLOW.unread_failure_s
    assert 0 < private_redis.ttl(delivery_key(done)) <= WORKFLOW.retention_s


def test_rebuild_leaves_free_the_drone_a_read_failure_gave_back_though_its_step_completed(
        private_redis: redis.Redis) -> None:
    """A failure written by hand left out the completed drone step: the supervisor's reading
    gave the drone back at once (no step it lists undoes the drone scheduler's work), with no
    ``drone.released``. The rebuild leaves that drone free; a failure that lists the step
    keeps its drone held for the undo, and one no supervisor has read yet for that reading."""
    rebuilder = Rebuilder(WORKFLOW, private_redis)
    now = now_ms()
    # delivery -> (its drone, its holds' record times, its failure lists the drone step, read)
    cases = {
        "omitted": ("drone-00001", [now - 10_000], False, True),  # given back by the reading
        "listed": ("drone-00002", [now - 10_000], True, True),  # its undo gives it back
        "unread": ("drone-00003", [now - 10_000], False, False),  # its reading is still to come
        "held after": ("drone-00004", [now + 1], False, True),  # taken after: not given back
        "about then": ("drone-00005", [now - 1_000], False, True),  # within the clocks' slack
        "copied after": ("drone-00006", [now - 10_000, now + 1], False, True),  # a replay's copy
    }
    ids = {name: str(uuid.uuid4()) for name in cases}
    for offset, (name, (drone, times, lists_drone, read)) in enumerate(cases.items()):
        delivery = ids[name]
        facts = rebuilder.facts.setdefault(delivery, DeliveryFacts())
        failure = DeliveryFailed(delivery_id=delivery, reason="WRITTEN_BY_HAND", detail="", failed_step="package",
                                 compensate=["drone", "package"] if lists_drone else ["package"],
                                 failed_at=datetime.now(UTC))
        for at in (now, now + 20_000):  # the failure and a later copy: the first reading counts
            rebuilder._declared_fact(rebuilder.declared[DeliveryFailed.topic], delivery, facts,
                                     Rec(DeliveryFailed.topic, 0, offset, at, None, None),
                                     lambda _, event=failure: event, lambda _: True, lambda _, read=read: read)
        scheduled = DroneScheduled(delivery_id=delivery, drone_id=drone, scheduled_at=datetime.now(UTC))
        for at in times:  # read after the failure: the order across topics is not defined
            rebuilder._declared_fact(rebuilder.declared[DroneScheduled.topic], delivery, facts,
                                     Rec(DroneScheduled.topic, 0, offset, at, None, None),
                                     lambda _, event=scheduled: event, lambda _: True, lambda _: True)
    rebuilder._keep_holds()
    report = RebuildReport(since_ms=0)
    rebuilder._write_holds(report)
    assert _bookings(private_redis) == {ids[name]: drone for name, (drone, *_) in cases.items() if name != "omitted"}


def _bookings(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(fleet.booking_key).items()}


def test_trace_of_a_compensated_delivery_shows_every_hop_in_order(isolated: IsolatedPipeline,
                                                                  tmp_path: Path, unique: str) -> None:
    isolated.env = {"AGENT_DISPATCH_PERMANENT_RATE": "1.0"}  # every drone booking is refused
    ensure_topics({isolated.prefix + "compensation.log": 3}, config={"cleanup.policy": "compact"})
    isolated.start()
    isolated.supervise(f"sup-ops-{unique}")  # it asks for the undo
    ids = isolated.submit(3)
    target = ids[0]
    wait_for(lambda: any(r.key == target.encode() for r in read_topic(isolated.prefix + "package.cancelled")),
             timeout_s=45, interval_s=0.5, what="the package to be cancelled")
    # the test pipeline declares its outputs by model (unprefixed) and runs no supervisor among
    # its services: name the topics only those read
    undo = [isolated.prefix + t for t in ("delivery.failed", "package.cancelled", "drone.released")]
    found = trace(target, isolated.flow, redis_client=isolated.client, extra_topics=undo)
    assert found.found_start_by in STARTS
    topics = [h.topic.removeprefix(isolated.prefix) for h in found.hops]
    assert topics[0] == "delivery.requested"
    assert set(topics) == {"delivery.requested", "package.ready", "drone.failed", "delivery.failed",
                           "undo.package", "package.cancelled"}
    assert topics.index("delivery.failed") > max(topics.index("package.ready"), topics.index("drone.failed"))
    assert topics.index("package.cancelled") > topics.index("undo.package") > topics.index("delivery.failed")
    shown: set[str] = set()
    for hop in found.hops:  # every hop's cause was shown before it
        assert not hop.causation_id or hop.causation_id in shown, hop
        shown.add(hop.event_id)
    failed = next(h for h in found.hops if h.topic.endswith("delivery.failed"))
    assert isinstance(failed.body, dict) and failed.body["compensate"] == ["package"]
    assert failed.note.startswith("reason=")
    assert all(h.since_previous_ms >= 0 for h in found.hops)
    # one partition per topic, from the request time on: far less than the topics hold
    assert found.stats.partitions <= len(found.hops) * 10
    # what a chaos run reports of a delivery that never ended: the same story, compact, with
    # the state table and the deadline index, and no body decoded (customer data)
    out = tmp_path / "stuck.json"
    evidence = stuck_evidence([target], isolated.client, isolated.flow, out)[target]
    told = [line.split()[1].split("[")[0].removeprefix(isolated.prefix) for line in evidence["hops"]]
    assert told[0] == "delivery.requested"
    assert set(told) == set(topics) - {"delivery.failed", "package.cancelled"}
    assert evidence["state"]["package.status"] == found.state["package.status"]
    assert set(evidence["deadlines"]) <= {s.name for s in isolated.flow.steps}
    assert "package" in evidence["deadlines"]
    written = json.loads(out.read_text())[target]
    assert len(written["hops"]) == len(told) and all(h["body"] == "" for h in written["hops"])


def test_trace_of_a_requeued_delivery(isolated: IsolatedPipeline, unique: str) -> None:
    """The drone step's first attempt fails on every try: the drone scheduler reports it to
    the recovery topic, the supervisor requeues the request to the step's retry topic with
    attempt 2, which works; the trace tells that story hop by hop."""
    prefix = isolated.prefix
    isolated.env = {"OPS_FAIL_FIRST_DRONE": "1"}
    name = f"sup-ops-{unique}"
    ensure_topics({prefix + "compensation.log": 3}, config={"cleanup.policy": "compact"})
    isolated.start()
    isolated.supervise(name, SUPERVISOR_SCAN_PERIOD_S="0.2", SUPERVISOR_BACKOFF_BASE_S="0.3",
                       SUPERVISOR_LEASE_TTL_S="2")
    wait_consuming((prefix + "package", prefix + "drone-scheduler", prefix + "delivery", name))
    target = isolated.submit(1)[0]
    wait_for(lambda: isolated.terminal({target}), timeout_s=45, interval_s=0.5,
             what="the requeued delivery to end")
    found = trace(target, isolated.flow, redis_client=isolated.client)
    # the state table holds each step's last transition, later than the request when the
    # services started slowly: the trace then looks the request up before those times
    assert found.found_start_by in STARTS
    retry = retry_topic(prefix + "drone-scheduler", prefix + "delivery.requested")
    topics = [h.topic.removeprefix(prefix) for h in found.hops]
    assert topics[0] == "delivery.requested"
    assert topics[-1] == "delivery.shipped"  # the final outcome, once, and nothing failed
    assert Counter(topics) == Counter({"delivery.requested": 1, "package.ready": 1, RECOVERY_TOPIC: 1,
                                       retry: 1, "drone.scheduled": 1, "delivery.shipped": 1}), topics
    at = {t: i for i, t in enumerate(topics)}
    assert at["delivery.requested"] < at[RECOVERY_TOPIC] < at[retry] < at["drone.scheduled"] \
        < at["delivery.shipped"]
    assert at["package.ready"] < at["delivery.shipped"]
    hop = {t: found.hops[i] for t, i in at.items()}
    request, report, requeued = hop["delivery.requested"], hop[RECOVERY_TOPIC], hop[retry]
    # the recovery report: the drone scheduler's attempt 1 failed
    assert report.kind == "recovery" and report.attempt == 1
    assert report.producer == prefix + "drone-scheduler" and report.causation_id == request.event_id
    assert isinstance(report.body, dict)
    assert report.body["step"] == "drone" and report.body["kind"] == "FAILED"
    assert report.body["attempt"] == 1 and "attempt 1 fails" in report.body["error"]
    assert report.note == "kind=FAILED (drone)"
    # the requeue: the same request (same event id), attempt 2, by the supervisor, consumed
    assert requeued.kind == "retry" and requeued.attempt == 2 and requeued.producer == name
    assert requeued.event_id == request.event_id and requeued.event_type == "DeliveryRequested"
    assert requeued.consumed_by == {prefix + "drone-scheduler": True}
    assert isinstance(requeued.body, dict) and requeued.body["delivery_id"] == target
    # attempt 2 did the work (after the requeue, see the order above and the state below),
    # and its answer decided the delivery
    assert hop["delivery.shipped"].causation_id == hop["drone.scheduled"].event_id
    shown: set[str] = set()
    for h in found.hops:  # every hop's cause was shown before it
        assert not h.causation_id or h.causation_id in shown, h
        shown.add(h.event_id)
    assert all(h.since_previous_ms >= 0 for h in found.hops)
    assert found.state["outcome"] == "shipped"
    if "done" not in found.state:  # not yet released (choreo.release): the steps are still there
        assert found.state["drone.status"] == "completed" and found.state["drone.attempt"] == "2"
        assert found.state["delivery.status"] == "completed"
    assert found.stats.partitions <= len(found.hops) * 10


def test_a_rebuild_merges_any_number_of_fields_into_a_key_keeping_what_is_there(
        private_redis: redis.Redis) -> None:
    """A hostile writer can give one delivery thousands of dedupe entries (any records with
    its id and fresh event ids): the rebuild must still write them all, where Lua refuses to
    unpack 8,000 values at once, and keep a field that is already there."""
    many, bare = seen_key(f"many-{uuid.uuid4()}"), seen_key(f"bare-{uuid.uuid4()}")
    private_redis.hset(many, "f0", "first")
    private_redis.hset(bare, "f", "v")
    Rebuilder(ops_pipeline.WORKFLOW, private_redis).merge_fields(
        [(many, {f"f{i}": f"v{i}" for i in range(10_000)}, 600), (bare, {}, 300)])
    assert private_redis.hlen(many) == 10_000
    assert private_redis.hget(many, "f0") == b"first" and private_redis.hget(many, "f9999") == b"v9999"
    assert 590 <= private_redis.ttl(many) <= 600 and 290 <= private_redis.ttl(bare) <= 300
