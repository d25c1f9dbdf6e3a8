"""Releasing a finished delivery's Redis state (``choreo.release``) on the real stack: when it
goes, what it leaves, what it waits for and what it refuses afterwards."""

from __future__ import annotations

import uuid

import pytest
import redis
from confluent_kafka import Producer

from choreo import topology
from choreo.config import settings
from choreo.dedupe import seen_key
from choreo.answers import dropped_by
from choreo.effects import EffectCall, OnceEffect, memo_key
from choreo.envelope import Envelope
from choreo.release import Releaser, awaiting_key, released
from choreo.kafka import admin
from choreo.state import StateTable, deadline_index, delivery_key
from consumers.drone_scheduler import fleet
from consumers.package import packages
from consumers.workflow import WORKFLOW
from tests.factories import delivery_request
from tests.helpers import index_members, notifications, read_topic, wait_for
from tests.pipeline import NOTIFIER, SERVICES, Pipeline, notifier_later, of, submit, wait_terminal

pytestmark = pytest.mark.integration

WITHOUT_NOTIFIER = [ref for ref in SERVICES if ref != NOTIFIER]
SUPERVISOR = "choreo.supervisor:service"


@pytest.fixture(scope="module", autouse=True)
def topics(stack: None) -> None:
    topology.create(WORKFLOW)


def bookings(client: redis.Redis) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(fleet.booking_key).items()}


def state_keys(client: redis.Redis, delivery_id: str) -> list[str]:
    return sorted(k.decode() for k in client.scan_iter(match=f"*}}{delivery_id}", count=1000))


# the records services declared to outlive a delivery, each with a TTL (the workflow has none)
KEPT = [r for s in WORKFLOW.services for r in s.records if not r.released_with_delivery]


def after_release(delivery_id: str) -> list[str]:
    """A released delivery's keys: its tombstone, and the records declared to outlive it."""
    return sorted([delivery_key(delivery_id), *(r.key(delivery_id) for r in KEPT)])


def test_a_shipped_delivery_leaves_only_a_tombstone(pipeline: Pipeline, redis_client: redis.Redis) -> None:
    """... and any record a service declared to outlive it, each expiring (the package's and
    the notifier's records go with it)."""
    ids = set(submit([delivery_request() for _ in range(100)]))
    assert set(wait_terminal(ids).values()) == {1}
    wait_for(lambda: released(redis_client, ids) == ids, timeout_s=60, what="every delivery released")
    for d in ids:
        assert state_keys(redis_client, d) == after_release(d), d
        assert all(0 < redis_client.ttl(r.key(d)) <= r.ttl_s for r in KEPT)
        tomb = {k.decode(): v.decode() for k, v in redis_client.hgetall(delivery_key(d)).items()}
        assert set(tomb) == {"done", "outcome"} and tomb["outcome"] == "shipped"
        assert 0 < redis_client.ttl(delivery_key(d)) <= settings().dedupe_ttl_s
        assert (redis_client.memory_usage(delivery_key(d)) or 0) <= 160  # 136 measured
    members = {m.decode() for m in index_members(redis_client)}
    assert not {m for m in members if m.split("|")[0] in ids}
    assert pipeline.alive()


def test_a_copy_of_a_released_delivery_starts_nothing_again(pipeline: Pipeline,
                                                            redis_client: redis.Redis) -> None:
    ids = set(submit([delivery_request() for _ in range(20)]))
    wait_terminal(ids)
    wait_for(lambda: released(redis_client, ids) == ids, timeout_s=60, what="released")
    # every event of theirs again, byte for byte, as a redrive or an upstream retry would
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    copied = ("delivery.requested", "package.ready", "drone.scheduled", "delivery.shipped")
    for topic in copied:
        for record in of(read_topic(topic), ids):
            producer.produce(topic, key=record.key, value=record.value, headers=record.headers)
    producer.flush(10)
    sentinel = set(submit([delivery_request()]))  # after the copies on its partitions
    wait_terminal(sentinel)
    wait_for(lambda: released(redis_client, sentinel) == sentinel, timeout_s=60, what="sentinel")
    for topic in copied:  # the original and the copy: nothing was produced again
        assert len(of(read_topic(topic), ids)) == 2 * len(ids), topic
    assert not of(read_topic("delivery.failed"), ids)
    for d in ids:  # refused before anything was written: no dedupe entry, no effect, no booking
        assert state_keys(redis_client, d) == after_release(d), d
    assert not set(redis_client.hvals(fleet.booking_key)) & {d.encode() for d in ids}


def test_release_waits_for_every_reader_of_the_terminal(redis_client: redis.Redis) -> None:
    with notifier_later(WITHOUT_NOTIFIER) as start_notifier:
        ids = set(submit([delivery_request() for _ in range(30)]))
        wait_terminal(ids)
        # the supervisor has recorded them; the notifier's group has not read them yet
        wait_for(lambda: sum(redis_client.zcard(awaiting_key("delivery.shipped", p)) for p in range(6))
                 >= len(ids), what="terminals recorded")
        with pytest.raises(AssertionError, match="timed out"):  # several release periods
            wait_for(lambda: released(redis_client, ids), timeout_s=4)
        assert all(redis_client.exists(seen_key(d)) for d in ids)
        # the flight is over: the supervisor's record of the shipment gave the drone back,
        # while the release still waits for a reader that has nothing to do with drones
        wait_for(lambda: not set(bookings(redis_client)) & ids, timeout_s=10, what="the drones back")
        returned = {fields[b"delivery"].decode() for _, fields in fleet.history(redis_client)
                    if fields[b"action"] == b"return"}
        assert returned >= ids
        # a finished delivery's step table, at its largest, fits Redis's compact encoding (a
        # step record past the stack's hash-max-listpack-value turns it into a hash table)
        assert {redis_client.object("encoding", delivery_key(d)) for d in ids} == {b"listpack"}
        # the notifier's records, read with the supervisor, which would release them, paused
        with start_notifier.paused(SUPERVISOR):
            start_notifier()
            told = wait_for(lambda: all(n := notifications(redis_client, sorted(ids))) and n, what="notified")
        assert all(drone and drone.startswith(b"drone-") for drone in told)
        wait_for(lambda: released(redis_client, ids) == ids, timeout_s=60, what="released after it")
        # the release took each record with the delivery's state
        assert not any(notifications(redis_client, sorted(ids)))


def test_a_delivery_with_a_dead_letter_keeps_its_state(redis_client: redis.Redis) -> None:
    with notifier_later(WITHOUT_NOTIFIER) as start_notifier:
        ids = set(submit([delivery_request() for _ in range(10)]))
        poisoned = sorted(ids)[0]
        # an undecodable event of that delivery, read by the notifier before the delivery ends
        headers = Envelope(str(uuid.uuid4()), poisoned, event_type="DeliveryShipped").to_headers()
        producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
        producer.produce("delivery.shipped", key=poisoned.encode(), value=b"\x00garbage", headers=headers)
        producer.flush(10)
        wait_terminal(ids)
        start_notifier()
        wait_for(lambda: released(redis_client, ids) == ids - {poisoned}, timeout_s=60,
                 what="the others released")
        assert redis_client.hget(delivery_key(poisoned), "dead_letters") is not None
        assert redis_client.exists(seen_key(poisoned))  # what a redrive needs is still there


def test_the_release_script_keeps_an_open_step_and_is_idempotent(redis_client: redis.Redis) -> None:
    state = StateTable(redis_client)
    releaser = Releaser(redis_client, admin(), "delivery.shipped", [], ["package"], WORKFLOW.released_keys, 60)
    done, open_, gone = (f"rel-{uuid.uuid4()}" for _ in range(3))
    for d in (done, open_):
        state.open(d, "package", 10**13, 1)
        redis_client.hset(memo_key(d), "package:x", "1")
        redis_client.hset(seen_key(d), "package:y", "1")
        redis_client.hset(packages.key(d), "status", "ready")
    StateTable(redis_client).put(done, {"package.status": "completed", "outcome": "shipped"})
    assert releaser.release([done, open_, gone], 5) == ["released", "kept:open_step", "gone"]
    StateTable(redis_client).put(open_, {"package.status": "completed"})  # still no outcome
    assert releaser.release([open_], 5) == ["kept:no_outcome"]
    StateTable(redis_client).put(open_, {"package.status": "processing"})
    assert releaser.release([done], 6) == ["done"]
    assert state_keys(redis_client, done) == [delivery_key(done)]
    assert redis_client.hgetall(delivery_key(done)) == {b"done": b"5", b"outcome": b"shipped"}
    assert redis_client.ttl(delivery_key(done)) <= 60
    assert sorted(state_keys(redis_client, open_)) == sorted(
        [delivery_key(open_), memo_key(open_), seen_key(open_), packages.key(open_)])
    assert f"{done}|package".encode() not in index_members(redis_client)
    assert not redis_client.exists(delivery_key(gone))  # no tombstone for what was never there
    redis_client.zrem(deadline_index(open_), f"{open_}|package")
    redis_client.delete(*state_keys(redis_client, open_), delivery_key(done))


BOOK = OnceEffect("probe_book", """
redis.call('SET', KEYS[1], ARGV[1])
return 'booked'
""")


def test_an_effect_that_finds_its_delivery_released_is_not_run(redis_client: redis.Redis) -> None:
    """An attempt that began before the release and resumes after it (a stalled instance)
    must not book anything for a finished delivery; its answer says so instead."""
    d = f"rel-{uuid.uuid4()}"
    target = f"probe:{{{d}}}"
    StateTable(redis_client).put(d, {"done": "1", "outcome": "shipped"})
    try:
        call = EffectCall(BOOK, d, "package:probe_book:e1", (target,), ("x",), 60, refuse_released=True)
        assert dropped_by(call.run(redis_client)) == "released"
        assert not redis_client.exists(target)
        # an answer remembered before the release is still replayed
        redis_client.hset(memo_key(d), "package:probe_book:e2", "earlier")
        again = EffectCall(BOOK, d, "package:probe_book:e2", (target,), ("x",), 60, refuse_released=True)
        assert again.run(redis_client) == "earlier"
        # a subscriber outside the workflow is not refused
        other = EffectCall(BOOK, d, "audit:probe_book:e1", (target,), ("x",), 60)
        assert other.run(redis_client) == "booked" and redis_client.get(target) == b"x"
    finally:
        redis_client.delete(delivery_key(d), memo_key(d), target)


def test_the_release_leaves_other_subscribers_entries(redis_client: redis.Redis) -> None:
    """Only the workflow services' dedupe entries and answers go with the delivery."""
    releaser = Releaser(redis_client, admin(), "delivery.shipped", [], ["notifier", "package"],
                        WORKFLOW.released_keys, 60)
    d = f"rel-{uuid.uuid4()}"
    StateTable(redis_client).put(d, {"package.status": "completed", "outcome": "shipped"})
    redis_client.hset(seen_key(d), mapping={"package:e1:1": "p|0|1", "audit:e9:1": "p|0|2"})
    redis_client.hset(memo_key(d), mapping={"notifier:notify:e2": "sent", "audit:count:e9": "1"})
    try:
        assert releaser.release([d], 7) == ["released"]
        assert redis_client.hgetall(seen_key(d)) == {b"audit:e9:1": b"p|0|2"}
        assert redis_client.hgetall(memo_key(d)) == {b"audit:count:e9": b"1"}
    finally:
        redis_client.delete(delivery_key(d), seen_key(d), memo_key(d))


def test_a_delivery_with_ten_thousand_dedupe_entries_is_released(redis_client: redis.Redis) -> None:
    """Copies of a shipment under new event ids each leave a dedupe entry of every reader:
    past about 8,000 the release's one ``HDEL`` failed in Lua (too many values to unpack),
    every period, and held back every later delivery of its partition."""
    releaser = Releaser(redis_client, admin(), "delivery.shipped", [], ["notifier", "supervisor"],
                        WORKFLOW.released_keys, 60)
    d = f"rel-{uuid.uuid4()}"
    StateTable(redis_client).put(d, {"outcome": "shipped"})
    redis_client.hset(seen_key(d), mapping={f"notifier:e{i}:1": "p|0|1" for i in range(10_000)})
    try:
        assert releaser.release([d], 8) == ["released"]
        assert not redis_client.exists(seen_key(d))
    finally:
        redis_client.delete(delivery_key(d), seen_key(d))
