"""Acceptance: a step added in the middle of the workflow with no edit to the runtime, the
supervisor, the ops tools, the chaos runner or the demo.

``tests/customs/`` holds all of it: its contracts, its service, and the workflow list with
one more line and the delivery join naming it. Every service runs as a real process on the
real topics, against a Redis database of this module's own.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from choreo import topology
from choreo.envelope import derived_id
from choreo.ops.rebuild import rebuild
from choreo.ops.records import BodyDecoder
from choreo.ops.trace import trace
from choreo.publisher import Publisher
from choreo.service import retry_topic
from choreo.state import StateTable, delivery_key
from tests.customs.service import clearances
from tests.customs.workflow import WORKFLOW
from tests.factories import delivery_request
from tests.helpers import Record, ServiceProcess, read_topic, start_group_at_end, wait_for

pytestmark = pytest.mark.integration

DB = 12
FLEET = 200
SUPERVISOR = "supervisor-customs"  # a group and lease of its own
REF = "tests.customs.workflow:WORKFLOW"


@dataclass
class Customs:
    redis: redis.Redis
    env: dict[str, str]
    procs: dict[str, ServiceProcess] = field(default_factory=dict)

    def start(self, **env: str) -> None:
        """Every service of the workflow, each in its own process."""
        for ref in WORKFLOW.service_refs:
            proc = ServiceProcess(ref, instance="customs-test", env={**self.env, **env}, workflow=REF)
            self.procs[ref] = proc.start()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.procs.clear()

    def publish(self, n: int) -> list[str]:
        publisher = Publisher("customs-test", workflow=WORKFLOW, redis_client=self.redis)
        ids = [str(uuid.uuid4()) for _ in range(n)]
        for delivery_id in ids:
            publisher.publish(delivery_request(delivery_id), str(uuid.uuid4()))
        publisher.flush(30)
        return ids


@pytest.fixture()
def customs(stack: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Customs]:
    client = redis.Redis(host="127.0.0.1", port=6379, db=DB)
    client.flushdb()  # this database belongs to this module
    monkeypatch.setenv("DRONE_FLEET_SIZE", str(FLEET))  # what a rebuild here grows the fleet to
    topology.create(WORKFLOW)
    # the groups join the shared topics where deployed ones would: at their end (once the
    # members a test before left are gone)
    wait_for(lambda: not _consuming(), timeout_s=60, what="the groups empty")
    for service in WORKFLOW.services:
        group = SUPERVISOR if service.name == "supervisor" else service.name
        for topic in service.topics:
            start_group_at_end(group, topic)
    world = Customs(client, {"REDIS_URL": f"redis://127.0.0.1:6379/{DB}", "DRONE_FLEET_SIZE": str(FLEET),
                             "SUPERVISOR_WORKFLOW": REF, "SUPERVISOR_NAME": SUPERVISOR})
    yield world
    world.stop()


def by_delivery(topic: str, ids: list[str]) -> dict[str, list[Record]]:
    found: dict[str, list[Record]] = defaultdict(list)
    for record in read_topic(topic):
        delivery = (record.key or b"").decode().split("|")[0]
        if delivery in ids:
            found[delivery].append(record)
    return found


def ended(ids: list[str]) -> dict[str, int]:
    counts = {d: 0 for d in ids}
    for topic in WORKFLOW.terminal_topics:
        for delivery, records in by_delivery(topic, ids).items():
            counts[delivery] += len(records)
    return counts


def wait_ended(ids: list[str], timeout_s: float = 120) -> dict[str, int]:
    return wait_for(lambda: all((c := ended(ids)).values()) and c, timeout_s=timeout_s, interval_s=1.0,
                    what=f"{len(ids)} deliveries to end")


def test_deliveries_ship_through_customs_once_and_trace_shows_it(customs: Customs) -> None:
    customs.start()
    ids = customs.publish(20)
    assert set(wait_ended(ids).values()) == {1}
    shipped = by_delivery("delivery.shipped", ids)
    cleared = by_delivery("customs.cleared", ids)
    assert set(shipped) == set(ids) and all(len(r) == 1 for r in shipped.values())
    assert set(cleared) == set(ids)
    # the join waited for customs: no delivery shipped before its clearance was published
    assert all(shipped[d][0].timestamp_ms >= max(r.timestamp_ms for r in cleared[d]) for d in ids)
    story = trace(ids[0], WORKFLOW, redis_client=customs.redis)
    topics = [hop.topic for hop in story.hops]
    assert "customs.cleared" in topics and topics.index("customs.cleared") < topics.index("delivery.shipped")
    clearance = customs.redis.hgetall(clearances.key(ids[0]))
    assert clearance == {b"declaration": derived_id(ids[0], "customs").encode(), b"status": b"cleared"}


def test_a_customs_step_past_its_deadline_is_requeued_and_ships_once(customs: Customs) -> None:
    customs.start(CUSTOMS_SLOW_FIRST_MS="8000")  # the first attempt outlives the 5 s deadline
    ids = customs.publish(2)
    assert set(wait_ended(ids, timeout_s=150).values()) == {1}
    assert set(by_delivery("delivery.shipped", ids)) == set(ids)
    requeued = by_delivery(retry_topic("customs", "delivery.requested"), ids)
    # the supervisor sent each one again, as a new attempt (again while the instance was still
    # asleep in its first: each claim makes the one before stale)
    assert set(requeued) == set(ids)
    assert all(int(r.header("attempt") or 0) >= 2 for recs in requeued.values() for r in recs)
    # what the late first attempt produced was dropped: one clearance each, the requeued attempt's
    assert {d: len(recs) for d, recs in by_delivery("customs.cleared", ids).items()} == {d: 1 for d in ids}


def test_a_refused_flight_undoes_three_steps_newest_first_one_after_another(customs: Customs) -> None:
    # customs answers last, so it is the newest completed step; every flight is refused
    customs.start(AGENT_CUSTOMS_LATENCY_MS="1500", AGENT_FLIGHT_PERMANENT_RATE="1.0")
    ids = customs.publish(3)
    assert set(wait_ended(ids).values()) == {1}
    decode = BodyDecoder()
    failed = {d: decode("delivery.failed", recs[0].value) for d, recs in by_delivery("delivery.failed", ids).items()}
    confirmations = {"customs": "customs.revoked", "drone": "drone.released", "package": "package.cancelled"}
    asked = {step: by_delivery(f"undo.{step}", ids) for step in confirmations}
    wait_for(lambda: all(len(by_delivery(topic, ids)) == len(ids) for topic in confirmations.values()),
             timeout_s=90, what="every undo confirmed")
    done = {step: by_delivery(topic, ids) for step, topic in confirmations.items()}
    asked = {step: by_delivery(f"undo.{step}", ids) for step in confirmations}
    for d in ids:
        order: list[Any] = failed[d]["compensate"]
        assert order[0] == "customs" and sorted(order) == ["customs", "drone", "package"]
        for earlier, later in zip(order, order[1:]):
            # the undo of a step is asked only once the undo of the step completed after it is done
            assert asked[later][d][0].timestamp_ms >= done[earlier][d][0].timestamp_ms, (d, earlier, later)
        # the supervisor marks a step compensated once it has read the confirmation
        wait_for(lambda: all(StateTable(customs.redis).fields(d)[f"{step}.status"] == "compensated"
                             for step in order), timeout_s=30, what=f"{d}'s steps compensated")
    assert customs.redis.hget(clearances.key(ids[0]), "status") == b"revoked"
    # Redis lost: the rebuild restores the order the undos are asked in, so a confirmation
    # read after it still asks for the next one
    customs.stop()
    wait_for(lambda: not _consuming(), timeout_s=60, what="the groups empty")
    customs.redis.flushdb()
    rebuild(WORKFLOW, since_ms=min(r.timestamp_ms for recs in by_delivery("delivery.requested", ids).values()
                                   for r in recs) - 5000, client=customs.redis)
    for d in ids:
        assert customs.redis.hget(delivery_key(d), "undo.order") == ",".join(failed[d]["compensate"]).encode()


def test_rebuild_after_flushall_restores_the_customs_state(customs: Customs) -> None:
    started = int(time.time() * 1000)
    customs.start()
    ids = customs.publish(10)
    assert set(wait_ended(ids).values()) == {1}
    customs.stop()
    wait_for(lambda: not _consuming(), timeout_s=60, what="the groups empty")
    customs.redis.flushdb()
    report = rebuild(WORKFLOW, since_ms=started - 5000, client=customs.redis)
    assert report.booking_conflicts == [] and report.service_records >= len(ids)
    for d in ids:
        assert customs.redis.hget(clearances.key(d), "declaration") == derived_id(d, "customs").encode()
        assert customs.redis.hget(delivery_key(d), "fanin.customs") is not None
    customs.start()
    more = customs.publish(5)
    assert set(wait_ended(more).values()) == {1}
    assert set(ended(ids).values()) == {1}  # the rebuilt deliveries did not end again


def _consuming() -> bool:
    from choreo.ops.rebuild import active_groups

    return bool(active_groups([s.name for s in WORKFLOW.services if s.name != "supervisor"] + [SUPERVISOR]))
