"""The supervisor on the real stack, with every service a real process.

Each test runs the pipeline's real business rules (``tests/services/sup_pipeline.py``) on
its own topics with 2 s deadlines, against a Redis database of its own (the state table,
deadline index, lease and fleet are the supervisor tests' alone), plus the real
``choreo.supervisor`` pointed at those topics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from confluent_kafka import Producer

from choreo import topology
from choreo.config import settings
from choreo.envelope import Envelope, now_ms
from choreo.kafka import CommittedOffsets, ensure_topics
from choreo.lease import holder
from choreo.publisher import Publish, Publisher
from choreo.redis_client import connect
from choreo.runner import RECOVERY_TOPIC, dlq_topic
from choreo.runtime_events import CompensationRecord, UndoByOperator
from choreo.serde import Decoder, registry_client
from choreo.service import retry_topic
from choreo.state import StateTable, delivery_key
from consumers.drone_scheduler import fleet
from schemas.models import DeliveryFailed
from tests.factories import delivery_request
from tests.helpers import (ServiceProcess, free_port, indexed, own_redis_url, read_topic, start_group_at_end,
                           wait_consuming, wait_for)
from tests.services import sup_pipeline

pytestmark = pytest.mark.integration

DB = int(os.environ.get("SUP_TEST_REDIS_DB", "11"))
DEADLINE_S = 2.0
BUDGET = 8  # no in-process retries: each attempt costs 2 tries (begin + the failed try)
ROLE_REF = {"package": "package", "drone": "drone", "delivery": "delivery"}


@dataclass
class World:
    """One test's private pipeline: topics under ``prefix``, Redis database ``DB``."""

    prefix: str
    name: str
    redis: redis.Redis
    env: dict[str, str]
    procs: list[ServiceProcess] = field(default_factory=list)
    # group -> (members, client ids of the instances started), while ``starting``: the groups
    # waited for at the block's end
    pending: dict[str, tuple[int, set[str]]] | None = None

    def topic(self, name: str) -> str:
        return self.prefix + name

    def start(self, role: str, instance: str = "0", members: int = 1, **env: str) -> ServiceProcess:
        """Start one instance and wait until its group has ``members`` with partitions (a step
        published before its service consumes would be late for its 2 s deadline)."""
        proc = ServiceProcess(f"{sup_pipeline.MODULE}:{ROLE_REF[role]}", instance=instance,
                              env={**self.env, **env}, workflow=f"{sup_pipeline.MODULE}:WORKFLOW")
        self.procs.append(proc.start())
        group = self.prefix + {"drone": "drone-scheduler"}.get(role, role)
        self._consuming(group, members, f"{group}-{instance}")
        return proc

    @contextmanager
    def starting(self) -> Iterator[None]:
        """The instances started in the block start side by side: their groups are waited for
        together at its end, where each start alone waits for its own (seconds each)."""
        assert self.pending is None, "one block at a time: an inner one would drop the outer's groups"
        self.pending = {}
        try:
            yield
            waiting, self.pending = self.pending, None
            for group, (members, clients) in waiting.items():
                wait_consuming([group], members, timeout_s=45, clients=clients)
        finally:
            self.pending = None

    def _consuming(self, group: str, members: int, client: str) -> None:
        """Wait until ``group`` consumes with ``members``, the instance started as ``client``
        among them (at the end of a ``starting`` block)."""
        if self.pending is None:
            wait_consuming([group], members, timeout_s=45, clients=[client])
        else:
            self.pending[group] = (members, self.pending.get(group, (0, set()))[1] | {client})

    def supervisor(self, instance: str = "0", members: int = 1, metrics_port: int = 0, **env: str) -> ServiceProcess:
        if members == 1:  # a new group joins the shared recovery topic at its end, as a
            start_group_at_end(self.name, RECOVERY_TOPIC)  # deployed one would (not at its history)
        proc = ServiceProcess("choreo.supervisor:service", instance=f"{self.name}-{instance}",
                              env={**self.env, **env}, workflow=f"{sup_pipeline.MODULE}:WORKFLOW",
                              args=["--metrics-port", str(metrics_port)] if metrics_port else [])
        self.procs.append(proc.start())
        self._consuming(self.name, members, f"{self.name}-{proc.instance}")
        return proc

    def publish(self, n: int, again: Sequence[str] = ()) -> list[str]:
        """``n`` new deliveries' requests, or (``again``) a request under a new event id for
        each of these deliveries."""
        flow = sup_pipeline.workflow(self.prefix, sup_pipeline.build(self.prefix, DEADLINE_S, BUDGET, 0))
        publisher = Publisher("sup-test", workflow=flow, redis_client=self.redis)
        ids = list(again) or [str(uuid.uuid4()) for _ in range(n)]
        for delivery_id in ids:
            publisher.publish(delivery_request(delivery_id), str(uuid.uuid4()),
                              topic=self.topic("delivery.requested"))
        publisher.flush(30)
        return ids

    def halves_published(self, n: int) -> list[str]:
        """``n`` deliveries through the package and drone services, both fan-in halves of each
        published, the delivery service not started."""
        with self.starting():
            self.start("package")
            self.start("drone")
        ids = self.publish(n)
        wait_for(lambda: set(ids) <= set(self.by_delivery("package.ready"))
                 and set(ids) <= set(self.by_delivery("drone.scheduled")), timeout_s=30,
                 what="both halves published")
        return ids

    def state(self, delivery_id: str) -> dict[str, str]:
        return StateTable(self.redis).fields(delivery_id)

    def records(self, name: str) -> list[Any]:
        return read_topic(self.topic(name))

    def by_delivery(self, name: str) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = defaultdict(list)
        for record in self.records(name):
            found[(record.key or b"").decode().split("|")[0]].append(record)
        return found

    def retries(self, service: str) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = defaultdict(list)
        for record in read_topic(retry_topic(self.topic(service), self.topic("delivery.requested"))):
            found[(record.key or b"").decode()].append(record)
        return found

    def log(self, proc: ServiceProcess) -> str:
        path = Path(proc.log_dir) / f"{proc.ref.replace(':', '_')}-{proc.instance}.log"
        return path.read_text(errors="replace")


@pytest.fixture()
def world(stack: None, unique: str) -> Iterator[World]:
    prefix = f"t.sup.{unique}."
    url = own_redis_url(f"redis://127.0.0.1:6379/{DB}")
    client = connect(url)
    client.flushdb()  # this database (the cluster, in the cluster lane) belongs to these tests
    services = sup_pipeline.build(prefix, DEADLINE_S, BUDGET, 0)
    topology.create(sup_pipeline.workflow(prefix, services), partitions=3)
    ensure_topics(sup_pipeline.output_topics(prefix), partitions=3)
    ensure_topics([prefix + "compensation.log"], partitions=3, config={"cleanup.policy": "compact"})
    name = f"sup-{unique}"
    env = {
        "REDIS_URL": url,
        "SUP_PREFIX": prefix, "SUP_DEADLINE_S": str(DEADLINE_S), "SUP_BUDGET": str(BUDGET),
        "SUP_IN_PROCESS_RETRIES": "0", "DRONE_FLEET_SIZE": "40",
        "SUPERVISOR_NAME": name, "SUPERVISOR_TOPIC_PREFIX": prefix,
        "SUPERVISOR_WORKFLOW": f"{sup_pipeline.MODULE}:WORKFLOW",
        "SUPERVISOR_SCAN_PERIOD_S": "0.2", "SUPERVISOR_BACKOFF_BASE_S": "0.4",
        "SUPERVISOR_LEASE_TTL_S": "2", "SUPERVISOR_CONFIRM_S": "4",
    }
    w = World(prefix, name, client, env)
    yield w
    for proc in w.procs:
        proc.kill()
    client.close()


def _shipped_once(world: World, ids: list[str]) -> None:
    shipped = wait_for(lambda: (r := world.by_delivery("delivery.shipped")) and set(ids) <= set(r) and r,
                       timeout_s=45, what="every delivery shipped")
    time.sleep(1.0)  # a second record would follow within a scan or two
    shipped = world.by_delivery("delivery.shipped")
    for delivery_id in ids:  # one record, not one event id: a requeue's replay repeats the id
        assert len(shipped[delivery_id]) == 1, [(r.partition, r.offset) for r in shipped[delivery_id]]
    assert not set(world.by_delivery("delivery.failed")) & set(ids)
    assert fleet.double_bookings(world.redis) == []


# what a service logs of an attempt the supervisor gave away, with the ``why`` it logs (None: any)
SUPERSEDED = {"step.late_answer_dropped": "stale", "step.ignored": "stale", "step.dropped_meanwhile": None}


def test_step_of_a_stopped_service_is_extended_and_completes_when_it_is_back(world: World) -> None:
    with world.starting():
        world.start("package")
        world.start("delivery")
        world.supervisor()
    ids = world.publish(3)  # the drone scheduler is down
    wait_for(lambda: all(int(world.state(d).get("drone.failures", 0)) >= 1 for d in ids),
             timeout_s=30, what="the drone steps extended past their deadline")
    for d in ids:
        state = world.state(d)
        assert state["drone.status"] == "pending" and state["drone.attempt"] == "1"  # same token
    drone = world.start("drone")
    _shipped_once(world, ids)
    # the step takes a new token only for a cause: a begin that lands after an extended
    # deadline lapsed and before the next scan extends it again is refused and reported
    # (DEADLINE_MISSED); an attempt begun in time that runs past its deadline (a fresh
    # process's first batch is slow) is requeued, and what it did after is dropped (its
    # answer at its finish, its effects, or its input read again as stale)
    reports, log = _reports(ids), world.log(drone)
    superseded = Counter(e["delivery_id"] for event, why in SUPERSEDED.items()
                         for e in _logged(log, event) if why is None or e.get("why") == why)
    for d in ids:
        state = world.state(d)
        assert state["drone.status"] == "completed"
        causes = len(reports[d]) + superseded[d]
        attempt = int(state["drone.attempt"])
        assert attempt == 1 if not causes else 2 <= attempt <= 1 + causes, (attempt, reports[d], superseded[d])
        assert state["outcome"] == "shipped"


def test_a_step_killed_mid_work_is_requeued_and_ships_once(world: World) -> None:
    with world.starting():
        world.start("package")
        world.start("delivery")
        world.supervisor()
        drone = world.start("drone", SUP_SLOW_FIRST_DRONE_MS="60000")  # hangs in its first attempt
    ids = world.publish(1)
    wait_for(lambda: all(world.state(d).get("drone.status") == "processing" for d in ids),
             timeout_s=30, what="drone step in progress")
    drone.kill()  # kill -9 mid-step: its batch is neither committed nor finished
    wait_for(lambda: all(world.retries("drone-scheduler").get(d) for d in ids), timeout_s=30,
             what="the stuck steps requeued")
    world.start("drone", instance="1")
    _shipped_once(world, ids)
    for d in ids:
        state = world.state(d)
        assert state["drone.status"] == "completed" and int(state["drone.attempt"]) >= 2


def test_fan_in_half_queued_while_its_service_was_down_past_the_deadline_still_ships(world: World) -> None:
    """The delivery service took the package half, then was down for more than a deadline after
    the drone half was produced: the supervisor claimed the fan-in (attempt 2) and requeued the
    package half. The drone half, queued at attempt 1 all along, must still count."""
    with world.starting():
        world.start("package")
        delivery = world.start("delivery")
        world.supervisor()
    ids = world.publish(2)  # the drone scheduler is down: only the package half arrives
    wait_for(lambda: all(world.state(d).get("fanin.package") for d in ids), timeout_s=30,
             what="the package halves recorded")
    delivery.kill()
    world.start("drone")
    wait_for(lambda: all(int(world.state(d).get("delivery.attempt", 1)) >= 2 for d in ids),
             timeout_s=45, what="the fan-in claimed while its service is down")
    world.start("delivery", instance="1")
    _shipped_once(world, ids)
    for d in ids:
        assert world.state(d)["outcome"] == "shipped"


def test_fan_in_halves_read_after_its_deadline_are_both_requeued_and_it_ships(world: World) -> None:
    """The delivery service read both halves after the fan-in's deadline (it was down, and no
    supervisor ran to extend it): each was consumed as EXPIRED, not run, and reported. The
    requeue must send both, not only the last one read, or the delivery waits for a half it
    was given until its budget fails it (found by a chaos run with the 20 s leader hand-back)."""
    ids = world.halves_published(2)
    time.sleep(DEADLINE_S + 0.5)  # past the fan-in step's deadline, opened with the halves
    world.start("delivery")
    wait_for(lambda: all(len(reports) == 2 for d, reports in _reports(ids).items()), timeout_s=30,
             what="both halves reported as read after the deadline")
    assert not world.by_delivery("delivery.shipped")  # neither half ran
    world.supervisor()
    _shipped_once(world, ids)
    for d in ids:
        state = world.state(d)
        assert state["outcome"] == "shipped" and int(state["delivery.attempt"]) >= 2


def test_requeued_halves_that_joined_and_decided_meanwhile_are_not_published_again(world: World) -> None:
    """Found by a chaos run (146 terminal events published twice). The batch that read the
    package half after the fan-in's deadline aborted, so the half stayed unread. The
    supervisor claimed the step and requeued that half. The half itself was then read again:
    it joined the claimed attempt and decided. The requeued copy came after, and its replay
    published the remembered decision a second time. Staged without the abort: the claim and
    the copies are written as the supervisor writes them, once the halves have decided (both
    halves are copied: the one that ran second decided)."""
    ids = world.halves_published(2)
    claimed_until = now_ms() + 60_000
    for d in ids:  # the supervisor's claim of the fan-in
        StateTable(world.redis).put(d, {"delivery.attempt": 2, "delivery.complete_by": claimed_until})
    world.start("delivery")
    _shipped_once(world, ids)  # the halves joined attempt 2 and decided
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    copied: list[tuple[str, int, int]] = []
    for half in ("package.ready", "drone.scheduled"):  # the requeues, sent before the halves joined
        retry = retry_topic(world.topic("delivery"), world.topic(half))
        for record in world.records(half):
            envelope = record.envelope
            assert envelope is not None
            producer.produce(retry, key=record.key, value=record.value,
                             headers=replace(envelope, attempt=2, deadline_ms=claimed_until).to_headers(),
                             on_delivery=lambda err, msg: copied.append((msg.topic(), msg.partition(), msg.offset())))
    assert producer.flush(30) == 0
    _read_past(world.topic("delivery"), copied, "the copies read")
    _shipped_once(world, ids)


def _read_past(group: str, positions: list[tuple[str, int, int]], what: str) -> None:
    """Wait until ``group`` has committed past each (topic, partition, offset)."""
    offsets = CommittedOffsets()
    try:
        wait_for(lambda: all(committed > offset for topic, partition, offset in positions
                             for committed in offsets.on_topic(group, topic, [partition]).values()),
                 timeout_s=30, what=what)
    finally:
        offsets.close()


def _logged(log: str, event: str) -> list[dict[str, Any]]:
    """A service's structured log lines of one event (librdkafka's own lines are not JSON)."""
    return [entry for line in log.splitlines() if line.startswith("{")
            and (entry := json.loads(line)).get("event") == event]


def _reports(ids: list[str]) -> dict[str, list[Any]]:
    """The recovery reports of these deliveries (the recovery topic is shared: keyed by delivery)."""
    found: dict[str, list[Any]] = {d: [] for d in ids}
    for record in read_topic(RECOVERY_TOPIC):
        delivery_id = (record.key or b"").decode().split("|")[0]
        if delivery_id in found:
            found[delivery_id].append(record)
    return found


def test_a_copy_under_a_new_id_of_a_completed_steps_input_runs_nothing(world: World) -> None:
    """A request published again under a new event id (the same delivery) finds its package
    step completed: a copy, not a replay. Run, it would call the warehouse again under a new
    call id and publish a second package under new ids."""
    with world.starting():
        world.start("package")  # the drone scheduler is down: the delivery stays open, unreleased
        world.supervisor()
    [d] = world.publish(1)
    wait_for(lambda: d in world.by_delivery("package.ready"), timeout_s=30, what="the package step completed")
    assert world.state(d)["package.status"] == "completed"
    world.publish(0, again=[d])
    requests = world.by_delivery("delivery.requested")[d]
    assert len({r.header("event_id") for r in requests}) == 2
    copy = requests[-1]
    _read_past(world.topic("package"), [(copy.topic, copy.partition, copy.offset)], "the copy read")
    assert len(world.by_delivery("package.ready")[d]) == 1
    assert world.state(d)["package.status"] == "completed"
    with world.starting():
        world.start("drone")
        world.start("delivery")
    _shipped_once(world, [d])


def test_a_copy_under_a_new_id_read_beside_its_original_runs_nothing(world: World) -> None:
    """A request and its copy under a new event id, read by services started after both
    were published: the copy finds the package and drone steps the original began (run, or
    expired and requeued). Run, it would call the warehouse and dispatch beside the original
    under new call ids, or be the input the supervisor requeues."""
    [d] = world.publish(1)
    world.publish(0, again=[d])
    with world.starting():
        package = world.start("package")
        drone = world.start("drone")
        world.start("delivery")
        world.supervisor()
    _shipped_once(world, [d])
    copy = world.by_delivery("delivery.requested")[d][-1].header("event_id")
    assert len(world.by_delivery("package.ready")[d]) == 1
    assert len(world.by_delivery("drone.scheduled")[d]) == 1
    for service in (package, drone):  # neither run nor reported (expired, requeued): skipped, and said so
        told = [entry["event"] for line in world.log(service).splitlines()
                if line.startswith("{") and (entry := json.loads(line)).get("event_id") == copy]
        assert told == ["step.copy_skipped"], told


def test_late_answer_of_an_old_attempt_changes_nothing(world: World) -> None:
    with world.starting():
        world.start("package")
        world.start("delivery")
        world.supervisor()
    # attempt 1 takes its drone in its begin, then stalls past its deadline
    drone = world.start("drone", SUP_SLOW_FIRST_DRONE_MS="6000")
    ids = world.publish(1)
    _shipped_once(world, ids)
    # attempt 2 (the supervisor's requeue) was answered the same drone and shipped; attempt
    # 1's answer, after the step went to attempt 2, is refused at its finish and dropped
    wait_for(lambda: {e["delivery_id"] for e in _logged(world.log(drone), "step.late_answer_dropped")
                      if e.get("why") == "stale" and e.get("attempt") == 1} >= set(ids),
             timeout_s=20, what="the old attempt's answer dropped at its finish")
    for d in ids:
        state = world.state(d)
        assert state["drone.status"] == "completed" and int(state["drone.attempt"]) >= 2
        assert state["outcome"] == "shipped"
    reserved = Counter(f[b"delivery"].decode() for _, f in world.redis.xrange(fleet.history_key)
                       if f[b"action"] == b"reserve")
    assert all(reserved[d] == 1 for d in ids)  # the requeue did not book a second drone


def _drones_back(world: World, ids: list[str], how: str) -> None:
    """Each delivery's drone, booked once, is free again, given back ``how`` (the history's
    action: ``failed`` by the supervisor reading the failure, ``release`` by the undo)."""
    wait_for(lambda: not any(world.redis.hget(fleet.booking_key, d) for d in ids), timeout_s=20,
             what="every drone booked free again")
    actions: dict[str, list[str]] = {}
    for _, f in fleet.history(world.redis):
        actions.setdefault(f[b"delivery"].decode(), []).append(f[b"action"].decode())
    assert all(actions.get(d) == ["reserve", how] for d in ids), {d: actions.get(d) for d in ids}


@pytest.mark.parametrize("failing", ["drone", "package"])
def test_failing_step_is_requeued_with_growing_delays_then_compensated(world: World, failing: str) -> None:
    agent = {"drone": "AGENT_DISPATCH_TRANSIENT_RATE", "package": "AGENT_WAREHOUSE_TRANSIENT_RATE"}
    world.env["SUP_BUDGET"] = "10"  # every process reads the one budget from the declarations
    with world.starting():
        world.start("package", **({agent["package"]: "1.0"} if failing == "package" else {}))
        world.start("drone", **({agent["drone"]: "1.0"} if failing == "drone" else {}))
        world.start("delivery")
        supervisor = world.supervisor()
    ids = world.publish(2)
    failed = wait_for(lambda: (r := world.by_delivery("delivery.failed")) and set(ids) <= set(r) and r,
                      timeout_s=90, what="the deliveries failed by the supervisor")
    done, undo = ("package", "package.cancelled") if failing == "drone" else ("drone", "drone.released")
    wait_for(lambda: all(world.state(d).get(f"{done}.status") == "compensated" for d in ids),
             timeout_s=30, what=f"{done} compensated")
    service = "drone-scheduler" if failing == "drone" else "package"
    retries = world.retries(service)
    for d in ids:
        attempts = [int(r.header("attempt") or 0) for r in retries[d]]
        assert attempts == [2, 3, 4, 5]  # four requeues, then the budget (10 tries) was spent
        # the claims' back-offs double, and each requeue waits at least its own after the
        # one before (detection and fetch add to it: a lower bound holds on a loaded machine)
        backoffs = [claim["backoff_ms"] for claim in _logged(world.log(supervisor), "step.claimed")
                    if claim.get("delivery_id") == d and claim.get("step") == failing]
        assert len(backoffs) == 4 and all(b == 2 * a for a, b in zip(backoffs, backoffs[1:])), backoffs
        times = [int(r.header("produced_at_ms") or 0) for r in retries[d]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert all(gap >= backoff for gap, backoff in zip(gaps, backoffs[1:])), (gaps, backoffs)
        event = Decoder(DeliveryFailed, world.topic("delivery.failed"), registry_client())(
            failed[d][0].value)
        assert len({r.header("event_id") for r in failed[d]}) == 1
        assert event.failed_step == failing and event.compensate == [done]
        state = world.state(d)
        assert state["outcome"] == "failed" and state[f"{failing}.status"] == "failed"
        assert state[f"{failing}.tries"] == "10"
        assert state[f"{done}.status"] == "compensated"
    assert set(ids) <= set(world.by_delivery(undo))
    log = wait_for(lambda: (r := world.by_delivery("compensation.log")) and
                   all(len(r.get(d, [])) >= 2 for d in ids) and r, what="compensation log")
    for d in ids:
        statuses = [Decoder(CompensationRecord, world.topic("compensation.log"), registry_client())(
            rec.value).status for rec in log[d]]
        assert statuses == ["COMPENSATING", "COMPENSATED"]
        assert {rec.key for rec in log[d]} == {f"{d}|{done}".encode()}
    # the drone held through dispatch's retries comes back with the failure (its step has no
    # undo to give it back); the one of a completed drone step comes back with its undo
    _drones_back(world, ids, "failed" if failing == "drone" else "release")
    wait_for(lambda: indexed(world.redis) == 0, timeout_s=20, what="an empty index")


def test_a_failure_read_after_the_retention_still_has_its_undos_asked(world: World) -> None:
    """The supervisor was down longer than a decided delivery's retention when its failure
    was published. The state waited for the reading (it expired with the retention, and the
    reading found nothing to undo: each drone was held for good), and the retention counts
    from the reading."""
    world.env["SUP_RETENTION_S"] = "3"  # the join's and the supervisor's (one declaration)
    with world.starting():
        world.start("package", AGENT_WAREHOUSE_PERMANENT_RATE="1.0")  # the package fails: the drone is undone
        world.start("drone")
        world.start("delivery")
    ids = world.publish(2)
    wait_for(lambda: set(ids) <= set(world.by_delivery("delivery.failed")), timeout_s=30,
             what="the deliveries failed by the join")
    time.sleep(4.0)  # past the retention, no supervisor
    assert all(world.state(d).get("outcome") == "failed" for d in ids)
    world.supervisor()
    wait_for(lambda: set(ids) <= set(world.by_delivery("drone.released")), timeout_s=30, what="the drones' undos")
    _drones_back(world, ids, "release")
    # read: the retention from the reading (-2 once gone; never -1, no expiry)
    assert all(world.redis.ttl(delivery_key(d)) in (-2, 0, 1, 2, 3) for d in ids)


def test_compensation_that_keeps_failing_ends_compensation_failed_with_an_alert(world: World) -> None:
    with world.starting():
        world.start("package", AGENT_WAREHOUSE_CANCEL_PERMANENT_RATE="1.0")
        world.start("drone", AGENT_DISPATCH_PERMANENT_RATE="1.0")  # drone refused: the delivery fails
        world.start("delivery")
        supervisor = world.supervisor()
    ids = world.publish(2)
    wait_for(lambda: all(world.state(d).get("package.status") == "compensation_failed" for d in ids),
             timeout_s=45, what="compensation_failed")
    for d in ids:
        state = world.state(d)
        assert state["cancel_package.status"] == "failed"
        assert state["cancel_package.tries"] == str(BUDGET)
        assert "cancel refused" in state["package.error"]
    log = wait_for(lambda: (r := world.by_delivery("compensation.log")) and
                   all(len(r.get(d, [])) >= 2 for d in ids) and r, what="compensation log")
    for d in ids:
        statuses = [Decoder(CompensationRecord, world.topic("compensation.log"), registry_client())(
            rec.value).status for rec in log[d]]
        assert statuses == ["COMPENSATING", "COMPENSATION_FAILED"]
    alerts = [line for line in world.log(supervisor).splitlines() if "alert.compensation_failed" in line]
    assert {d for d in ids if any(d in line for line in alerts)} == set(ids)
    assert all('"level": "error"' in line for line in alerts)
    # the drone held when dispatch refused came back with the refusal, though the chain of
    # undos stopped at the package's
    _drones_back(world, ids, "release")


def _by_hand(delivery_id: str, step: str) -> UndoByOperator:
    return UndoByOperator(delivery_id=delivery_id, step=step, action="DONE_BY_HAND", by="mallory",
                          decided_at=datetime.now(UTC))


def _ops(world: World, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``choreo ops <command>`` as an operator runs it, with the test's Redis and topics."""
    return subprocess.run([sys.executable, "-m", "infra.cli", "ops", command, *args,
                           "--workflow", f"{sup_pipeline.MODULE}:WORKFLOW"],
                          text=True, capture_output=True, timeout=120,
                          env={**os.environ, **world.env, "COLUMNS": "400"})  # one line per message


def _retry_undos(world: World, ids: list[str], note: str) -> list[subprocess.CompletedProcess[str]]:
    """``choreo ops retry-undo <delivery> drone --wait 60`` for each delivery, side by side:
    each waits until its undo has run again."""
    with ThreadPoolExecutor(len(ids)) as operators:
        return list(operators.map(lambda d: _ops(world, "retry-undo", d, "drone", "--note", note, "--json",
                                                 "--wait", "60"), ids))


def _awaiting_gauge(port: int) -> float | None:
    name = "choreo_supervisor_undos_awaiting_operator "
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return next((float(line[len(name):]) for line in text.splitlines() if line.startswith(name)), None)


def _awaiting_operator(world: World) -> set[tuple[str, str]]:
    listed = _ops(world, "status", "--no-lag", "--json")
    assert listed.returncode == 0, listed.stderr
    return {(v["delivery_id"], v["step"]) for v in json.loads(listed.stdout)["awaiting_operator"]}


def test_an_undo_marked_done_by_hand_ends_compensation_failed_and_gives_the_drone_back(world: World) -> None:
    """The drone's undo is refused for good: the step ends compensation_failed and the drone
    stays held. The operator undoes it by hand and marks it so: the supervisor marks the step
    compensated, gives the drone back and logs it; the mark of a step in any other status is
    refused before anything is published."""
    with world.starting():
        world.start("package", AGENT_WAREHOUSE_PERMANENT_RATE="1.0")  # the package fails: the drone is undone
        world.start("drone", AGENT_DISPATCH_RELEASE_PERMANENT_RATE="1.0")  # ... and its undo is refused
        world.start("delivery")
        port = free_port()
        supervisor = world.supervisor(metrics_port=port)
    ids = world.publish(2)
    wait_for(lambda: all(world.state(d).get("drone.status") == "compensation_failed" for d in ids),
             timeout_s=60, what="compensation_failed")
    assert all(world.redis.hget(fleet.booking_key, d) for d in ids)  # held for good
    # the scan's records of the undos failed for good are known committed: nothing is left
    # in the deadline index, and nothing is written again (the log's records below)
    wait_for(lambda: indexed(world.redis) == 0, timeout_s=10, what="the failed undos' records known committed")
    wait_for(lambda: _awaiting_gauge(port) == 2, timeout_s=30, what="the gauge to alert on")
    # the state waits for the operator's mark as long as an unread failure waits (a day), not
    # the retention (an hour here)
    assert all(world.redis.ttl(delivery_key(d)) > 3600 for d in ids)
    assert _awaiting_operator(world) == {(d, "drone") for d in ids}  # listed by choreo ops status
    decisions = world.topic("compensation.operator")
    # marks written to the topic past the command's checks change nothing: a step that is not
    # compensation_failed (the supervisor's script refuses it), a field of the state that is
    # no step, a body naming another delivery than its envelope (dead-lettered unread)
    forged = Publisher("ops", redis_client=world.redis)
    for step, envelope_delivery in (("package", ids[0]), ("outcome", ids[0]), ("drone", ids[1])):
        event_id = str(uuid.uuid4())
        forged.publish_many([Publish(_by_hand(ids[0], step), event_id, decisions, envelope=Envelope.first(
            event_id, envelope_delivery, "UndoByOperator", "ops"))])
    forged.flush(30)
    wait_for(lambda: world.log(supervisor).count("compensation.operator_ignored") >= 2, timeout_s=20,
             what="the forged marks read")
    [letter] = wait_for(lambda: read_topic(dlq_topic(decisions)), timeout_s=20, what="the forged mark's letter")
    assert letter.header("dlq.reason") == "INVALID_PAYLOAD"
    assert letter.header("dlq.error") == "its body names another delivery than its envelope (36 characters)"
    assert world.state(ids[0])["package.status"] == "completed"  # with package.failed: nothing to undo
    assert all(world.state(d)["drone.status"] == "compensation_failed" for d in ids)
    assert all(world.redis.hget(fleet.booking_key, d) for d in ids)
    refused = _ops(world, "mark-compensated", ids[0], "package")  # completed with package.failed: nothing to mark
    assert refused.returncode == 1 and "only a compensation_failed step" in refused.stderr, refused.stderr
    unknown = _ops(world, "mark-compensated", ids[0], "nope\x1b[2J")
    assert unknown.returncode == 1 and "has no undo" in unknown.stderr, unknown.stderr
    assert len(read_topic(decisions)) == 3  # the forged ones: nothing published for a refusal
    for d in ids:
        done = _ops(world, "mark-compensated", d, "drone", "--note", "dispatch released by hand, ticket 7", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["status"] == "compensated" and result["undo_order"] == {"drone": "compensated"}
        assert 0 < world.redis.ttl(delivery_key(d)) <= 3600  # the retention again
    assert _awaiting_operator(world) == set()
    wait_for(lambda: _awaiting_gauge(port) == 0, timeout_s=30, what="the gauge back at 0")
    again = _ops(world, "mark-compensated", ids[0], "drone")  # compensated now: refused
    assert again.returncode == 1 and "is compensated" in again.stderr
    _drones_back(world, ids, "by_hand")
    for d in ids:
        state = world.state(d)
        assert state["drone.status"] == "compensated" and state["release_drone.status"] == "failed"
    log = wait_for(lambda: (r := world.by_delivery("compensation.log")) and
                   all(len(r.get(d, [])) >= 3 for d in ids) and r, what="compensation log")
    for d in ids:
        statuses = [Decoder(CompensationRecord, world.topic("compensation.log"), registry_client())(
            rec.value).status for rec in log[d]]
        assert statuses == ["COMPENSATING", "COMPENSATION_FAILED", "COMPENSATED"]
    assert len(read_topic(decisions)) == 3 + len(ids)
    lines = [line for line in world.log(supervisor).splitlines() if "compensation.marked_by_hand" in line]
    assert {d for d in ids if any(d in line for line in lines)} == set(ids)
    assert not any("ticket 7" in line for line in world.log(supervisor).splitlines())  # the note stays in Kafka


def test_an_undo_asked_again_once_fixed_runs_again_and_gives_the_drone_back(world: World) -> None:
    """The drone's undo was refused for good (dispatch refused every release): its step ended
    compensation_failed, the drone held. Asked again twice before dispatch is fixed, it fails
    again each time, listed again, with a failure record of its own (the first told the
    submitter, the others did not: the third is where an id could repeat). Dispatch is fixed (the drone scheduler
    runs again without the refusals) and the operator asks the undo again: it runs at a new
    attempt, the drone comes back by it, and the compensation log tells the story."""
    with world.starting():
        world.start("package", AGENT_WAREHOUSE_PERMANENT_RATE="1.0")  # the package fails: the drone is undone
        refusing = world.start("drone", AGENT_DISPATCH_RELEASE_PERMANENT_RATE="1.0")  # ... and its undo refused
        world.start("delivery")
        world.supervisor()
    ids = world.publish(2)
    wait_for(lambda: all(world.state(d).get("drone.status") == "compensation_failed" for d in ids),
             timeout_s=60, what="compensation_failed")
    for _ in range(2):
        for asked in _retry_undos(world, ids, "not fixed yet"):
            assert asked.returncode == 0, asked.stderr
            result = json.loads(asked.stdout)
            assert result["acted_on"] and result["status"] == "compensation_failed"
    assert _awaiting_operator(world) == {(d, "drone") for d in ids}
    failed_attempt = {d: int(world.state(d)["release_drone.attempt"]) for d in ids}
    refusing.kill()
    world.start("drone")
    assert _awaiting_operator(world) == {(d, "drone") for d in ids}
    for d, asked in zip(ids, _retry_undos(world, ids, "dispatch fixed")):
        assert asked.returncode == 0, asked.stderr
        result = json.loads(asked.stdout)
        assert result["acted_on"] and result["status"] == "compensated"
        state = world.state(d)
        assert state["release_drone.status"] == "completed"
        # a new attempt; a later one still if its 2 s deadline passed on a busy machine and the
        # supervisor requeued it (the compensation log below tells whether anything else ran)
        assert int(state["release_drone.attempt"]) > failed_attempt[d]
        assert 0 < world.redis.ttl(delivery_key(d)) <= 3600  # the retention again, not the day's wait
    _drones_back(world, ids, "release")
    assert _awaiting_operator(world) == set()
    wait_for(lambda: indexed(world.redis) == 0, timeout_s=20, what="nothing left in the deadline index")
    refused = _ops(world, "retry-undo", ids[0], "drone")  # compensated now: nothing to ask
    assert refused.returncode == 1 and "is compensated" in refused.stderr, refused.stderr
    log = wait_for(lambda: (r := world.by_delivery("compensation.log")) and
                   all(len(r.get(d, [])) >= 8 for d in ids) and r, what="compensation log")
    for d in ids:
        statuses = [Decoder(CompensationRecord, world.topic("compensation.log"), registry_client())(
            rec.value).status for rec in log[d]]
        assert statuses == ["COMPENSATING", "COMPENSATION_FAILED"] * 3 + ["COMPENSATING", "COMPENSATED"]
        # each its own event: a reader that skips an id it has seen misses none of them
        assert len({rec.header("event_id") for rec in log[d]}) == 8
        # each names its delivery, those the scan wrote too (rebuild-state files it by it)
        assert {rec.header("correlation_id") for rec in log[d]} == {d}
    released = world.by_delivery("drone.released")
    assert all(len(released[d]) == 1 for d in ids)


def test_two_supervisors_act_once_and_the_survivor_takes_over_after_kill_9(world: World) -> None:
    with world.starting():
        world.start("package")
        world.start("drone", AGENT_DISPATCH_TRANSIENT_RATE="1.0")
        world.start("delivery")
    supervisors = {p.proc.pid: p for p in (world.supervisor("a"), world.supervisor("b", members=2))
                   if p.proc}
    ids = world.publish(6)
    wait_for(lambda: sum(len(v) for v in world.retries("drone-scheduler").values()) >= 2,
             timeout_s=30, what="the first requeues")
    lead = holder(world.redis, world.name)
    assert lead is not None
    leader = supervisors[int(lead.owner.rsplit(":", 1)[1])]
    leader.kill()
    wait_for(lambda: (h := holder(world.redis, world.name)) is not None and h.token > lead.token,
             timeout_s=10, what="the other supervisor takes the lease")
    wait_for(lambda: all(world.state(d).get("package.status") == "compensated" for d in ids),
             timeout_s=60, what="every delivery failed and compensated")
    retries = world.retries("drone-scheduler")
    for d in ids:
        attempts = [int(r.header("attempt") or 0) for r in retries[d]]
        assert len(attempts) == len(set(attempts)), attempts  # no attempt requeued twice
        state = world.state(d)
        assert state["outcome"] == "failed" and state["drone.status"] == "failed"
    failed = world.by_delivery("delivery.failed")
    assert all(len({r.header("event_id") for r in failed[d]}) == 1 for d in ids)
    log = wait_for(lambda: (r := world.by_delivery("compensation.log")) and
                   all(len(r.get(d, [])) >= 2 for d in ids) and r, timeout_s=40, what="compensation log")
    for d in ids:
        assert len(log[d]) == 2  # one COMPENSATING, one COMPENSATED: never twice
    cancelled = world.by_delivery("package.cancelled")
    assert all(len({r.header("event_id") for r in cancelled[d]}) == 1 for d in ids)
    _drones_back(world, ids, "failed")  # held through dispatch's retries
    wait_for(lambda: indexed(world.redis) == 0, timeout_s=20,
             what="nothing left behind in the deadline index")
