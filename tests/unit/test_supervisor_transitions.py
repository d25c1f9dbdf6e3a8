"""The supervisor's Lua transitions on a real Redis (a database of its own, flushed per test):
each rule of the scan, the fencing, the one retry budget and the compensation bookkeeping."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from choreo import keys
from choreo.dedupe import seen_field, sighting
from choreo.lease import Lease
from choreo.ops import status
from choreo.state import Begin, Source, StateTable, StepStatus, deadline_index, delivery_key, index_member
from choreo.supervision import (
    ASK_UNDO_AGAIN, COMPENSATION, FORWARD, MARK_COMPENSATED, MARK_COMPENSATING, Action, Policies, Scanner,
    AWAITING_MARGIN_S, CLOSED_BY_FAILURE, StepPolicy, SupervisorSettings, Transitions, UNRECORDED,
    Unrecorded, awaiting_operator_index, parse_marked,
)
from tests.helpers import indexed

pytestmark = pytest.mark.integration

DB = int(os.environ.get("SUP_TEST_REDIS_DB", "11"))
BUDGET = 6
DEADLINE = 1000
POLICIES = Policies(
    {
        "package": StepPolicy("package", FORWARD, BUDGET, DEADLINE, "package"),
        "drone": StepPolicy("drone", FORWARD, BUDGET, DEADLINE, "drone-scheduler"),
        "delivery": StepPolicy("delivery", FORWARD, BUDGET, DEADLINE, "delivery",
                               waits_for=("package", "drone")),
        "cancel_package": StepPolicy("cancel_package", COMPENSATION, BUDGET, DEADLINE, "package", "package"),
    },
    compensable=("package", "drone"), decider="delivery", unread_failure_s=86_400,
)
SETTINGS = SupervisorSettings(backoff_base_s=0.1, backoff_max_s=10, confirm_s=5)
UNDOABLE = ",".join(POLICIES.compensable)  # MARK_COMPENSATING's ARGV[6], as the supervisor gives it


@pytest.fixture()
def client(stack: None) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=6379, db=DB)
    client.flushdb()  # this database belongs to the supervisor tests
    yield client
    client.close()


@pytest.fixture()
def lease(client: redis.Redis) -> Lease:
    lease = Lease(client, "sup-unit", "me", 60_000)
    assert lease.acquire()
    return lease


def _scan(client: redis.Redis, lease: Lease, now: int) -> dict[tuple[str, str], Action]:
    assert lease.fence is not None
    result = Scanner(client, SETTINGS).scan(lease.fence, lease.shard_key, POLICIES, now)
    return {(a.delivery_id, a.step): a for a in result.actions}


def _fields(client: redis.Redis, delivery_id: str) -> dict[str, str]:
    return StateTable(client).fields(delivery_id)


def _new(client: redis.Redis, *steps: str, now: int = 1_000_000, shard: int | None = None) -> str:
    delivery_id = uuid.uuid4().hex
    while shard is not None and keys.shard_of(delivery_id) != shard:
        delivery_id = uuid.uuid4().hex
    table = StateTable(client)
    for step in steps:
        table.open(delivery_id, step, now + DEADLINE, now)
    return delivery_id


def _read_failure(client: redis.Redis, d: str, memo: str, now: int, failed_step: str, reason: str,
                  retention_s: int, *undo: str) -> str | None:
    """The supervisor's reading of ``d``'s failure (``MARK_COMPENSATING``, as ``on_delivery_failed``
    runs it): the steps to undo, newest first."""
    return MARK_COMPENSATING.run(client, d, memo, [delivery_key(d), deadline_index(d)],
                                 [now, d, failed_step, reason, retention_s, UNDOABLE, *undo], 60)


def test_pending_step_is_extended_without_a_new_token(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "drone")
    actions = _scan(client, lease, 1_002_000)
    action = actions[(d, "drone")]
    assert action.kind == "extend" and action.data["backoff"] == 100
    f = _fields(client, d)
    assert f["drone.attempt"] == "1" and f["drone.status"] == "pending"
    assert f["drone.tries"] == "1"  # a whole period with no try counts against the budget
    assert int(f["drone.complete_by"]) == 1_002_000 + 100 + DEADLINE
    assert client.zscore(deadline_index(d), index_member(d, "drone")) == 1_002_000 + 100 + DEADLINE
    assert _scan(client, lease, 1_002_000) == {}  # nothing due twice


def test_failed_step_is_claimed_then_requeued_after_back_off(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "drone")
    table = StateTable(client)
    assert table.begin(d, "drone", 1, 1_000_100, DEADLINE, BUDGET, "t|t|2|41").value == "go"
    table.finish(d, "drone", 1, 1_000_200, StepStatus.FAILED, "boom")
    claim = _scan(client, lease, 1_000_300)[(d, "drone")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2 and claim.data["was"] == "failed"
    f = _fields(client, d)
    assert f["drone.attempt"] == "2" and f["drone.status"] == "pending" and f["drone.failures"] == "2"
    # the old attempt is stale from the claim on
    assert table.finish(d, "drone", 1, 1_000_350, StepStatus.COMPLETED) == "stale"
    assert _scan(client, lease, 1_000_350) == {}  # still backing off
    requeue = _scan(client, lease, 1_000_400)[(d, "drone")]
    assert requeue.kind == "requeue" and requeue.data["source"] == "t|t|2|41"
    assert requeue.data["attempt"] == 2 and requeue.data["complete_by"] == 1_000_400 + DEADLINE
    assert table.begin(d, "drone", 2, 1_000_500, DEADLINE, BUDGET, "r|r|0|7").value == "go"


def test_a_step_opened_at_a_requeued_attempt_is_claimed_past_it(client: redis.Redis, lease: Lease) -> None:
    """A rebuild restores a requeued step whose retry (attempt 2) nobody has read yet at that
    attempt: when the retry is read past the deadline, the supervisor claims attempt 3. Opened
    at attempt 1 (as before), it claimed attempt 2 again and sent the retry a second time."""
    d = uuid.uuid4().hex
    table = StateTable(client)
    table.open(d, "drone", 1_000_000 + DEADLINE, 1_000_000, attempt=2)
    assert _fields(client, d)["drone.attempt"] == "2"
    assert table.begin(d, "drone", 1, 1_000_100, DEADLINE, BUDGET, "t|t|2|41") == Begin.STALE
    # the retry itself, read after the step's deadline
    assert table.begin(d, "drone", 2, 1_002_000, DEADLINE, BUDGET, "r|r|0|7") == Begin.EXPIRED
    claim = _scan(client, lease, 1_002_100)[(d, "drone")]
    assert claim.kind == "claim" and claim.data["attempt"] == 3


def test_a_fan_in_waiting_for_an_open_upstream_step_keeps_its_token(
        client: redis.Redis, lease: Lease) -> None:
    """The fan-in kept its step open on the first half; the drone step that owes the second
    half is still pending (its service is down). Requeueing the fan-in would take a new token
    and make the drone's half (attempt 1) stale on arrival: it waits instead."""
    d = _new(client, "package", "drone", "delivery")
    table = StateTable(client)
    assert table.begin(d, "package", 1, 1_000_010, DEADLINE, BUDGET, "q|q|0|1").value == "go"
    assert table.finish(d, "package", 1, 1_000_020, StepStatus.COMPLETED) == "ok"
    assert table.begin(d, "delivery", 1, 1_000_030, DEADLINE, BUDGET, "p|p|0|5").value == "go"
    actions = _scan(client, lease, 1_002_000)
    wait = actions[(d, "delivery")]
    assert wait.kind == "wait" and wait.data["on"] == "drone" and wait.data["attempt"] == 1
    assert actions[(d, "drone")].kind == "extend"
    f = _fields(client, d)
    assert f["delivery.attempt"] == "1" and f["delivery.status"] == "processing"
    assert f["delivery.tries"] == "1" and "delivery.requeue" not in f  # no try counted, no claim
    assert int(f["delivery.complete_by"]) >= 1_002_000 + DEADLINE
    # still waiting while the drone step is extended again and again
    later = int(f["delivery.complete_by"])
    assert _scan(client, lease, later)[(d, "delivery")].kind == "wait"
    # the drone service is back: its half (attempt 1) is not stale for the fan-in
    now = later + 10
    assert table.begin(d, "drone", 1, now, DEADLINE, BUDGET, "q|q|0|1").value == "go"
    assert table.finish(d, "drone", 1, now + 10, StepStatus.COMPLETED) == "ok"
    assert table.begin(d, "delivery", 1, now + 20, DEADLINE, BUDGET, "s|s|0|9").value == "go"
    assert table.finish(d, "delivery", 1, now + 30, StepStatus.COMPLETED) == "ok"


def test_a_fan_in_still_open_a_deadline_after_its_halves_is_claimed(
        client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "package", "drone", "delivery")
    table = StateTable(client)
    for step, at in (("package", 1_000_010), ("drone", 1_000_500)):
        table.begin(d, step, 1, at, DEADLINE, BUDGET, "q|q|0|1")
        table.finish(d, step, 1, at + 10, StepStatus.COMPLETED)
    table.begin(d, "delivery", 1, 1_000_600, DEADLINE, BUDGET, "s|s|0|9", joinable=True)
    # the drone's half came out less than a deadline ago: it is on its way
    wait = _scan(client, lease, 1_001_200)[(d, "delivery")]
    assert wait.kind == "wait" and wait.data["on"] == "drone"
    assert wait.data["complete_by"] == 1_000_510 + DEADLINE
    # a deadline after the last half, the fan-in itself is stuck: claimed as any step
    claim = _scan(client, lease, 1_001_600)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    # the claim gave the first half's trigger away: that trigger at attempt 1 is stale; the
    # other half, still queued from before the claim (its service was down), joins attempt 2
    assert table.begin_many([(d, "delivery", 1, 1_001_700, DEADLINE, "s|s|0|9")], BUDGET, {"delivery"}) \
        == [(Begin.STALE, 1)]
    assert table.begin_many([(d, "delivery", 1, 1_001_700, DEADLINE, "t|t|1|4")], BUDGET, {"delivery"}) \
        == [(Begin.GO, 2)]
    assert table.finish(d, "delivery", 2, 1_001_710, StepStatus.COMPLETED) == "ok"
    # its batch aborted after all: the replay of the input that joined answers as attempt 2 again
    # (its outputs are published), while a copy of the given-away first half stays stale
    assert table.begin_many([(d, "delivery", 1, 1_001_720, DEADLINE, "t|t|1|4")], BUDGET, {"delivery"}) \
        == [(Begin.REPLAY, 2)]
    assert table.finish(d, "delivery", 2, 1_001_730, StepStatus.COMPLETED) == "replay"
    assert table.begin_many([(d, "delivery", 1, 1_001_740, DEADLINE, "s|retry.s|0|3")], BUDGET, {"delivery"}) \
        == [(Begin.STALE, 1)]
    # a failed fan-in (its own error) is claimed at once, whatever its upstream does
    d2 = _new(client, "package", "drone", "delivery")
    table.begin(d2, "delivery", 1, 1_000_010, DEADLINE, BUDGET, "p|p|0|5")
    table.finish(d2, "delivery", 1, 1_000_020, StepStatus.FAILED, "flight timed out")
    assert _scan(client, lease, 1_000_030)[(d2, "delivery")].kind == "claim"


def _fan_in_after_both_upstreams(client: redis.Redis) -> tuple[str, StateTable]:
    """A delivery whose package and drone steps completed at 1_000_020, its fan-in open."""
    d = _new(client, "package", "drone", "delivery")
    table = StateTable(client)
    for step in ("package", "drone"):
        table.begin(d, step, 1, 1_000_010, DEADLINE, BUDGET, "q|q|0|1")
        table.finish(d, step, 1, 1_000_020, StepStatus.COMPLETED)
    return d, table


def _half(table: StateTable, d: str, attempt: int, now: int, source: str) -> tuple[Begin, int]:
    """One fan-in half read by the delivery service: its verdict and the attempt it runs as."""
    [verdict] = table.begin_many([(d, "delivery", attempt, now, DEADLINE, source)], BUDGET, {"delivery"})
    return verdict


def test_a_fan_in_half_seen_after_the_deadline_is_requeued_with_the_half_that_joined_later(
        client: redis.Redis, lease: Lease) -> None:
    """Found by a chaos run with the 20 s leader hand-back (72 deliveries never ended): the
    delivery service, far behind, read the package half after the fan-in's deadline
    (EXPIRED: consumed, not run). The supervisor claimed the step; the drone half then joined
    the claimed attempt and became the step's last input. The requeue sent that half alone,
    and the delivery waited for a package it had been given until its budget failed it."""
    d, table = _fan_in_after_both_upstreams(client)
    package_half, drone_half = "package.ready|0|311", "drone.scheduled|0|321"
    assert _half(table, d, 1, 1_003_000, package_half) == (Begin.EXPIRED, 1)
    claim = _scan(client, lease, 1_003_010)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    assert _half(table, d, 1, 1_003_020, drone_half) == (Begin.GO, 2)
    assert _fields(client, d)["delivery.source"] == f"{package_half};{drone_half}"
    requeue = _scan(client, lease, int(claim.data["backoff"]) + 1_003_010)[(d, "delivery")]
    # the drone half runs as attempt 2 already (it joined): only the package half is sent
    assert requeue.kind == "requeue" and requeue.data["joined"] == drone_half
    assert [s.text() if s else None for s in Source.parse_all(requeue.data["source"])] == [package_half]
    # once the requeued package half has run, it is not listed again
    assert _half(table, d, 2, 1_003_200, "package.ready|retry.p|0|1") == (Begin.GO, 2)
    assert _fields(client, d)["delivery.source"] == "package.ready|retry.p|0|1"


def test_a_fan_in_half_that_joined_the_claimed_attempt_is_not_sent_again(
        client: redis.Redis, lease: Lease) -> None:
    """Found by the same chaos runs: the drone half joined the claimed attempt and decided,
    and the requeue then sent that half again; its replay told the remembered decision once
    more, and ``delivery.failed`` was published twice (three deliveries)."""
    d, table = _fan_in_after_both_upstreams(client)
    package_half, drone_half = "package.ready|5|84", "drone.failed|5|7"
    assert _half(table, d, 1, 1_000_100, package_half) == (Begin.GO, 1)  # ran; waits for the drone
    claim = _scan(client, lease, 1_003_000)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    assert _half(table, d, 1, 1_003_010, drone_half) == (Begin.GO, 2)
    requeue = _scan(client, lease, int(claim.data["backoff"]) + 1_003_000)[(d, "delivery")]
    assert requeue.kind == "requeue" and requeue.data["source"] == ""
    assert requeue.data["joined"] == drone_half
    # the joined half never finished: the next claim gives it away with its attempt, so its
    # replay is stale and the requeue of attempt 3 sends it
    claim = _scan(client, lease, int(requeue.data["complete_by"]) + 1)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 3
    assert _half(table, d, 1, int(requeue.data["complete_by"]) + 2, drone_half) == (Begin.STALE, 1)
    requeue = _scan(client, lease, int(requeue.data["complete_by"]) + 1 + int(claim.data["backoff"]))[
        (d, "delivery")]
    assert requeue.kind == "requeue" and requeue.data["source"] == drone_half


def test_a_fan_in_failure_left_unpublished_by_a_killed_batch_is_requeued(
        client: redis.Redis, lease: Lease) -> None:
    """Found by the same chaos runs (16 deliveries never ended): the fan-in decided "failed"
    (its effect writes the outcome before the batch commits), the instance was killed before
    the commit, and the replay came past the deadline: EXPIRED, not run. The supervisor took
    the outcome for a published failure and dropped the step: no ``delivery.failed`` ever."""
    d, table = _fan_in_after_both_upstreams(client)
    package_half, drone_half = "package.ready|0|200", "drone.failed|0|9"
    assert _half(table, d, 1, 1_000_100, package_half) == (Begin.GO, 1)
    assert _half(table, d, 1, 1_000_110, drone_half) == (Begin.GO, 1)
    client.hset(delivery_key(d), "outcome", "failed")  # the decision; the batch is killed
    assert _half(table, d, 1, 1_003_000, drone_half) == (Begin.EXPIRED, 1)  # its replay
    claim = _scan(client, lease, 1_003_010)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    requeue = _scan(client, lease, 1_003_010 + int(claim.data["backoff"]))[(d, "delivery")]
    assert requeue.kind == "requeue" and requeue.data["source"] == drone_half
    # the requeued half tells the decision again and the step completes: then it is dropped
    assert _half(table, d, 2, 1_003_200, "drone.failed|retry.d|0|1") == (Begin.GO, 2)
    assert table.finish(d, "delivery", 2, 1_003_210, StepStatus.COMPLETED) == "ok"
    assert (d, "delivery") not in _scan(client, lease, 1_010_000)
    # a failure the supervisor decided ends the watch of every step, the decider's too
    d2, table = _fan_in_after_both_upstreams(client)
    assert _half(table, d2, 1, 1_000_100, package_half) == (Begin.GO, 1)
    client.hset(delivery_key(d2), mapping={"outcome": "failed", "fail.by": "supervisor",
                                           "fail.step": "drone", "fail.seen": "1"})
    drop = _scan(client, lease, 1_003_000)[(d2, "delivery")]
    assert drop.kind == "drop" and drop.data["why"] == "outcome failed"


def _read(table: StateTable, d: str, event_id: str, attempt: int, now: int,
          source: str) -> tuple[Begin, int]:
    """One fan-in half read by the delivery service as its runner reads it: one begin that
    deduplicates the event first, then gives the step's verdict and the attempt it runs as."""
    return _read_together(table, d, [(event_id, attempt, source)], now)[0]


def _read_together(table: StateTable, d: str, halves: list[tuple[str, int, str]],
                   now: int) -> list[tuple[Begin, int]]:
    """Several inputs read in one batch: one begin call, in order."""
    return table.begin_many(
        [(d, "delivery", attempt, now, DEADLINE, source) for _, attempt, source in halves], BUDGET, {"delivery"},
        # topic|partition|offset, as the runner keys it
        [sighting("delivery", d, event_id, "|".join(source.split("|")[-3:])) for event_id, _, source in halves],
        3600)


def test_a_begin_that_deduplicates_needs_a_window(client: redis.Redis) -> None:
    d = _new(client, "drone")
    with pytest.raises(ValueError, match="dedupe window"):
        StateTable(client).begin_many([(d, "drone", 1, 1_000_100, DEADLINE, "t|t|2|41")], BUDGET,
                                      sightings=[sighting("drone-scheduler", d, "e", "t|2|41")])
    assert _fields(client, d)["drone.status"] == "pending"  # nothing ran


def test_an_attempt_past_the_one_after_the_steps_is_stale_and_not_remembered(client: redis.Redis,
                                                                              lease: Lease) -> None:
    """The supervisor raises a step's attempt by one before it requeues (one past it when
    Redis lost that claim): an input beyond was given by no one. Taken, a forged attempt of
    1000 would give the step away from its live attempt, to one the supervisor could requeue
    no more (1001 is past what consumers take). Not remembered, it makes no requeue at its
    attempt a copy; and it opens no step."""
    d = _new(client, "drone")
    table = StateTable(client)

    def read(attempt: int, now: int, position: str, step: str = "drone") -> tuple[Begin, int]:
        [verdict] = table.begin_many([(d, step, attempt, now, DEADLINE, f"t|{position}")], BUDGET, set(),
                                     [sighting("drone-scheduler", d, "e-1", position)], 3600)
        return verdict

    assert read(1, 1_000_100, "t|0|1") == (Begin.GO, 1)
    assert read(1000, 1_000_110, "t|1|2") == (Begin.STALE, 1000)
    assert read(3, 1_000_115, "t|1|3") == (Begin.STALE, 3)
    assert read(1000, 1_000_116, "t|1|4", step="release_drone") == (Begin.STALE, 1000)
    assert "release_drone.status" not in _fields(client, d)  # no step opened by it
    assert _fields(client, d)["drone.attempt"] == "1"
    seen = {k.decode() for k in client.hkeys(sighting("drone-scheduler", d, "e-1", "t|0|1").key)}
    assert len(seen) == 1 and all(k.endswith("1") for k in seen)  # the stale ones left no sighting
    assert table.finish(d, "drone", 1, 1_000_120, StepStatus.FAILED, "no drone") == "ok"
    claim = _scan(client, lease, 1_000_130)[(d, "drone")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    assert read(2, 1_000_140, "retry.t|0|2") == (Begin.GO, 2)  # one past a lost claim's would run too


def test_a_half_that_joined_makes_its_requeued_copy_a_duplicate(client: redis.Redis, lease: Lease) -> None:
    """Found by a chaos run (146 terminal events published twice). The package half was read
    after the fan-in's deadline and its batch aborted, so it stayed unread. The supervisor
    claimed the step and requeued that half (the same event, attempt 2). The half itself was
    then read again, joined attempt 2, and decided. Its requeued copy came next: a new
    attempt to the dedupe and a completed step to ``begin``, so its replay published the
    remembered decision a second time. The half that joins now claims its event at the
    attempt it joins, so the copy is a duplicate; a copy seen first makes the half stale."""
    d, table = _fan_in_after_both_upstreams(client)
    package, half, copy = str(uuid.uuid4()), "package.ready|0|311", "package.ready|retry.p|0|7"
    assert _read(table, d, package, 1, 1_003_000, half) == (Begin.EXPIRED, 1)
    claim = _scan(client, lease, 1_003_010)[(d, "delivery")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    requeue = _scan(client, lease, int(claim.data["backoff"]) + 1_003_010)[(d, "delivery")]
    assert requeue.kind == "requeue" and requeue.data["source"] == half
    assert _read(table, d, package, 1, 1_003_100, half) == (Begin.GO, 2)  # read again: joins
    assert table.finish(d, "delivery", 2, 1_003_110, StepStatus.COMPLETED) == "ok"
    assert _read(table, d, package, 2, 1_003_200, copy) == (Begin.DUPLICATE, 2)
    assert _read(table, d, package, 1, 1_003_210, half) == (Begin.REPLAY, 2)  # its own replay
    # the other order: the requeued copy is read first
    d, table = _fan_in_after_both_upstreams(client)
    assert _read(table, d, package, 1, 1_003_000, half) == (Begin.EXPIRED, 1)
    assert _scan(client, lease, 1_003_010)[(d, "delivery")].kind == "claim"
    assert _read(table, d, package, 2, 1_003_100, copy) == (Begin.GO, 2)
    assert _read(table, d, package, 1, 1_003_110, half) == (Begin.STALE, 1)
    assert _read(table, d, package, 2, 1_003_120, copy) == (Begin.GO, 2)  # its own replay
    # both in one batch, in either order: the first to claim the attempt runs, the other does not
    for first_copy in (False, True):
        d, table = _fan_in_after_both_upstreams(client)
        assert _read(table, d, package, 1, 1_003_000, half) == (Begin.EXPIRED, 1)
        assert _scan(client, lease, 1_003_010)[(d, "delivery")].kind == "claim"
        halves = [(package, 1, half), (package, 2, copy)]
        verdicts = _read_together(table, d, halves[::-1] if first_copy else halves, 1_003_100)
        assert verdicts == ([(Begin.GO, 2), (Begin.STALE, 1)] if first_copy
                            else [(Begin.GO, 2), (Begin.DUPLICATE, 2)])


def test_a_step_with_one_trigger_keeps_one_source(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "drone")
    table = StateTable(client)
    assert table.begin(d, "drone", 1, 1_003_000, DEADLINE, BUDGET, "a|a|0|1") == Begin.EXPIRED
    assert table.begin(d, "drone", 1, 1_003_010, DEADLINE, BUDGET, "b|b|0|2") == Begin.EXPIRED
    assert _fields(client, d)["drone.source"] == "b|b|0|2"


def test_another_event_for_a_completed_step_is_a_copy_and_stays_one(client: redis.Redis, lease: Lease) -> None:
    """A completed step's input read again is a replay (its batch aborted: its outputs are
    published from the remembered answers), also once its sighting is gone (expired,
    forgotten by a redrive, lost with Redis). Another event for that step (a copy under a new
    id) would run the handler with new memos and call out again under new call ids: it is a
    copy, read again or not, at any attempt the step takes."""
    d = _new(client, "package")
    table = StateTable(client)
    first, again, retry = "a|0|1", "a|0|2", "retry.a|0|3"

    def read(event_id: str, attempt: int, position: str, service: str = "package") -> tuple[Begin, int]:
        return table.begin_many([(d, "package", attempt, 1_000_100, DEADLINE, position)], BUDGET,
                                sightings=[sighting(service, d, event_id, position)], dedupe_ttl_s=60)[0]

    assert read("e-1", 1, first) == (Begin.GO, 1)
    assert read("e-1", 1, first, service="notifier") == (Begin.GO, 1)  # another service's sighting of it
    assert table.finish(d, "package", 1, 1_000_110, StepStatus.COMPLETED) == "ok"
    assert read("e-1", 1, first) == (Begin.REPLAY, 1)
    assert read("e-2", 1, again) == (Begin.COPY, 1)
    assert read("e-2", 1, again) == (Begin.COPY, 1)  # its batch read again
    assert read("e-2", 2, retry) == (Begin.COPY, 2)
    seen = sighting("package", d, "e-1", first).key
    assert not any(b"e-2" in k for k in client.hkeys(seen))  # the copy left no sighting
    # the package's own sighting gone: its input read again at its position, or redriven to a
    # new one (the notifier's sighting still names it at the source), replays
    client.hdel(seen, seen_field("package", "e-1", 1))
    assert read("e-1", 1, again) == (Begin.REPLAY, 1)
    client.hdel(seen, seen_field("package", "e-1", 1))
    assert read("e-1", 1, first) == (Begin.REPLAY, 1)
    # a dedupe hash past 64 entries is not read, so that no begin scans a hostile hash: the
    # copy replays
    client.hset(seen, mapping={f"drone-scheduler:x{i}:1": f"b|0|{i}" for i in range(64)})
    assert read("e-2", 1, again) == (Begin.REPLAY, 1)
    # and with no sighting left at all, anything replays, as the step's own input may be it
    client.delete(seen)
    assert read("e-2", 1, again) == (Begin.REPLAY, 1)
    assert _fields(client, d)["package.source"] == first


def test_another_event_for_a_step_that_runs_still_is_a_copy_at_its_attempt(
        client: redis.Redis, lease: Lease) -> None:
    """While a step's attempt runs, another event for it (a copy under a new id) would run
    beside it under new call ids: a copy too, read again or not. The step's own input read
    again runs, and so does its requeue at the next attempt; a copy of that is a copy. Read
    past the deadline, the copy would have become the input the supervisor requeues."""
    d = _new(client, "drone")
    table = StateTable(client)
    first, again, retry = "t|t|0|1", "t|t|0|2", "r|r|0|3"

    def read(event_id: str, attempt: int, position: str, now: int = 1_000_100) -> tuple[Begin, int]:
        return table.begin_many([(d, "drone", attempt, now, DEADLINE, position)], BUDGET,
                                sightings=[sighting("drone-scheduler", d, event_id, position)], dedupe_ttl_s=60)[0]

    assert read("e-1", 1, first) == (Begin.GO, 1)
    assert read("e-2", 1, again) == (Begin.COPY, 1)
    assert read("e-2", 1, again) == (Begin.COPY, 1)  # its batch read again
    assert read("x:e-1", 1, again) == (Begin.COPY, 1)  # an id that ends like the original's
    assert read("e-1", 1, first) == (Begin.GO, 1)  # the original's batch aborted: it runs again
    seen = sighting("drone-scheduler", d, "e-1", first).key
    assert not any(b"e-2" in k for k in client.hkeys(seen))  # the copy left no sighting
    assert _fields(client, d)["drone.source"] == first
    # past its deadline: claimed for attempt 2 and requeued; the requeue runs, a copy of it not
    claim = _scan(client, lease, 1_000_100 + DEADLINE + 1)[(d, "drone")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    requeue = _scan(client, lease, int(claim.data["backoff"]) + 1_000_100 + DEADLINE + 2)[(d, "drone")]
    assert requeue.kind == "requeue" and requeue.data["source"] == first
    now = int(requeue.data["complete_by"]) - DEADLINE
    assert read("e-1", 2, retry, now) == (Begin.GO, 2)
    assert read("e-2", 2, again, now) == (Begin.COPY, 2)
    assert _fields(client, d)["drone.source"] == retry
    # a replay (choreo.ops.replay) sights what it reads at its own positions: a copy it
    # reads after the original is a copy there too
    d = _new(client, "drone")
    table.begin_many([(d, "drone", 1, 1_000_100, DEADLINE, first)], BUDGET, dedupe_ttl_s=60,
                     sightings=[sighting("drone-scheduler", d, "e-1", "replay.drone.1:t|0|1")])
    assert read("e-2", 1, again) == (Begin.COPY, 1)
    # read past the deadline, both: the original is the input the supervisor will requeue
    d = _new(client, "drone")
    late = 1_000_000 + DEADLINE + 1
    assert read("e-1", 1, first, late) == (Begin.EXPIRED, 1)
    assert read("e-2", 1, again, late) == (Begin.COPY, 1)
    assert _fields(client, d)["drone.source"] == first


def test_back_off_grows_exponentially(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "package")
    now, backoffs = 1_002_000, []
    for _ in range(4):
        action = _scan(client, lease, now)[(d, "package")]
        backoffs.append(action.data["backoff"])
        now = int(action.data["complete_by"]) + 1
    assert backoffs == [100, 200, 400, 800]


def test_budget_spent_fails_the_delivery_once_with_compensations_newest_first(
        client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "package", "drone")
    table = StateTable(client)
    table.begin(d, "package", 1, 1_000_010, DEADLINE, BUDGET, "a|a|0|1")
    table.finish(d, "package", 1, 1_000_020, StepStatus.COMPLETED)
    table.begin(d, "drone", 1, 1_000_030, DEADLINE, BUDGET, "a|a|0|1")
    StateTable(client).put(d, {"drone.tries": BUDGET})
    table.finish(d, "drone", 1, 1_000_040, StepStatus.FAILED, "dispatch timed out")
    fail = _scan(client, lease, 1_000_050)[(d, "drone")]
    assert fail.kind == "fail" and fail.data["compensate"] == "package" and not fail.data["again"]
    # decided: it goes in time, as the join's failures do: waiting for the reading first
    assert 3600 < client.ttl(delivery_key(d)) <= 86_400
    assert "dispatch timed out" in fail.data["detail"]
    f = _fields(client, d)
    assert f["outcome"] == "failed" and f["fail.by"] == "supervisor" and f["drone.status"] == "failed"
    assert f["drone.attempt"] == "2"  # any in-flight attempt is stale now
    # not confirmed (our delivery.failed not seen yet): published again after confirm_s
    again = _scan(client, lease, 1_000_050 + 5_001)[(d, "drone")]
    assert again.kind == "fail" and again.data["again"] == 1
    # seen: marked compensating, and nothing left in the index
    raw = _read_failure(client, d, "t:1", 1_000_060, "drone", "DEADLINE_MISSED", 3600, "package")
    assert [m["step"] for m in parse_marked(raw).steps] == ["package"]
    assert parse_marked(raw).next == "package"
    assert parse_marked(raw).outcome == "failed"  # what the drone's give-back waits for
    assert parse_marked(raw).undone_with_holds(["package"]) == ["package"]  # it completed
    assert _fields(client, d)["package.status"] == "compensating"
    assert client.zscore(deadline_index(d), index_member(d, "drone")) is None
    assert 0 < client.ttl(delivery_key(d)) <= 3600  # read: the retention from now


def test_compensate_lists_completed_steps_in_reverse_order_and_abandoned_first(
        client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "package", "drone", "delivery")
    StateTable(client).put(d, {"package.status": "completed", "package.completed_at": 10,
                              "drone.status": "completed", "drone.completed_at": 20,
                              "delivery.status": "failed", "delivery.tries": BUDGET,
                              "delivery.source": "x|x|0|0"})
    client.zadd(deadline_index(d), {index_member(d, "delivery"): 0})
    client.zrem(deadline_index(d), index_member(d, "package"), index_member(d, "drone"))
    assert _scan(client, lease, 1_000_000)[(d, "delivery")].data["compensate"] == "drone,package"
    d2 = _new(client, "package", "drone")
    StateTable(client).put(d2, {"package.status": "completed", "package.completed_at": 10,
                                           "drone.status": "processing", "drone.tries": BUDGET,
                                           "drone.source": "x|x|0|0"})
    client.zrem(deadline_index(d2), index_member(d2, "package"))
    assert _scan(client, lease, 1_002_000)[(d2, "drone")].data["compensate"] == "drone,package"


def test_a_failed_delivery_closes_its_pending_steps_so_no_queued_trigger_begins_them(
        client: redis.Redis, lease: Lease) -> None:
    """A step with side effects still pending when the supervisor fails the delivery (never
    begun, its trigger queued; or claimed, its requeue on the way) is closed with a new
    token: neither trigger starts anything for a failed delivery later (a drone booked then
    was held for good). What an attempt given away did before it stalled is not undone."""
    d = _new(client, "package", "drone", "delivery")
    StateTable(client).put(d, {"package.status": "pending", "package.attempt": 2, "package.source": "x|x|0|0",
                               "delivery.status": "failed", "delivery.tries": BUDGET,
                               "delivery.source": "y|y|0|0"})
    client.zadd(deadline_index(d), {index_member(d, "delivery"): 0})
    fail = _scan(client, lease, 1_000_000)[(d, "delivery")]
    assert fail.kind == "fail" and fail.data["compensate"] == "" and fail.data["closed"] == "package,drone"
    f = _fields(client, d)
    assert (f["package.status"], f["package.attempt"]) == ("failed", "3")
    assert (f["drone.status"], f["drone.attempt"]) == ("failed", "2")
    assert client.zscore(deadline_index(d), index_member(d, "drone")) is None
    assert client.zscore(deadline_index(d), index_member(d, "package")) is None
    table = StateTable(client)
    assert table.begin(d, "drone", 1, 1_000_100, DEADLINE, BUDGET, "a|a|0|1") is Begin.STALE
    assert table.begin(d, "package", 2, 1_000_100, DEADLINE, BUDGET, "r|r|0|1") is Begin.STALE


def test_an_outcome_decided_elsewhere_wins(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "drone", "delivery")
    StateTable(client).put(d, {"outcome": "shipped", "delivery.status": "completed",
                                          "drone.status": "failed", "drone.tries": BUDGET})
    assert _scan(client, lease, 1_002_000)[(d, "drone")].kind == "drop"
    assert client.hget(delivery_key(d), "outcome") == b"shipped"
    assert indexed(client) == 0 or client.zscore(deadline_index(d), index_member(d, "delivery"))


def test_a_deposed_supervisor_changes_nothing(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "drone")
    before = _fields(client, d)
    transitions = Transitions(client)
    result = Scanner(client, SETTINGS).scan(f"{lease.fence}x", lease.shard_key, POLICIES, 1_002_000)
    assert result.stats.fenced and result.actions == []
    assert _fields(client, d) == before
    assert transitions.record_report(d, "drone", 1, "FAILED", 1_000_500, "e") == "due"


def test_compensation_past_its_budget_ends_compensation_failed(client: redis.Redis, lease: Lease) -> None:
    d = _new(client, "cancel_package")
    StateTable(client).put(d, {"outcome": "failed", "package.status": "compensating", "undo.order": "package",
                                          "cancel_package.status": "failed",
                                          "cancel_package.tries": BUDGET,
                                          "cancel_package.error": "warehouse refused"})
    action = _scan(client, lease, 1_002_000)[(d, "cancel_package")]
    assert action.kind == "comp_failed" and action.data["target"] == "package"
    assert action.data["before"] == "compensating" and "warehouse refused" in action.data["detail"]
    f = _fields(client, d)
    assert f["package.status"] == "compensation_failed" and f["cancel_package.status"] == "failed"
    # watched until the record the scan writes of it is known committed (the next test)
    assert indexed(client) == 1 and client.zscore(deadline_index(d), index_member(d, "cancel_package")) == 1_007_000
    # listed as waiting for an operator's decision, since the failure
    assert client.zscore(awaiting_operator_index(d), index_member(d, "package")) == 1_002_000
    # the compensation ended: its submitter is told failed, with the steps it was to undo
    assert (action.data["told"], action.data["undone"], f["outcome.told"]) == ("failed", "package", "failed")
    # its state waits for an operator's mark as an unread failure waits for its reading, and
    # a second failure event read meanwhile does not cut that wait to the retention
    assert 86_000 < client.ttl(delivery_key(d)) <= 86_400
    _read_failure(client, d, "t:f", 6, "drone", "AGAIN", 3600, "drone")
    assert 86_000 < client.ttl(delivery_key(d)) <= 86_400
    # a mark from any other status is refused; the mark by hand gives the retention back
    assert _mark(client, d, "t:m", "package", 7, "compensating", 3600) == "ignored:compensation_failed"
    assert client.zscore(awaiting_operator_index(d), index_member(d, "package")) == 1_002_000
    assert _mark(client, d, "t:n", "package", 8, "compensation_failed", 3600).startswith("compensated:")
    assert 0 < client.ttl(delivery_key(d)) <= 3600 and _fields(client, d)["package.status"] == "compensated"
    assert client.zcard(awaiting_operator_index(d)) == 0  # waits no more


def _failed_for_good(client: redis.Redis, lease: Lease) -> tuple[str, Action]:
    """A delivery whose undo of ``package`` the scan at 1,002,000 finds failed for good."""
    d = _new(client, "cancel_package")
    StateTable(client).put(d, {"outcome": "failed", "package.status": "compensating", "undo.order": "package",
                               "cancel_package.status": "failed", "cancel_package.tries": BUDGET,
                               "cancel_package.error": "warehouse refused"})
    action = _scan(client, lease, 1_002_000)[(d, "cancel_package")]
    assert action.kind == "comp_failed" and action.data["told"] == "failed"
    return d, action


def test_an_undo_failed_for_good_is_recorded_again_until_its_record_is_known_committed(
        client: redis.Redis, lease: Lease) -> None:
    """The scan's transaction that carries the COMPENSATION_FAILED record, and the outcome it
    tells, may abort after its Redis transition: the step stays watched and the record is
    written again, telling the same, until the supervisor knows it committed; an undo decided
    meanwhile is not written again, and an undo asked again is supervised as any."""
    d, first = _failed_for_good(client, lease)
    assert _scan(client, lease, 1_006_999) == {}  # confirm_s (5 s) not over
    again = _scan(client, lease, 1_007_000)[(d, "cancel_package")]
    assert again.kind == "comp_failed_again" and "warehouse refused" in again.data["detail"]
    same = ("target", "before", "attempt", "told", "undone")
    assert {k: again.data[k] for k in same} == {k: first.data[k] for k in same} == {
        "target": "package", "before": "compensating", "attempt": 1, "told": "failed", "undone": "package"}
    assert client.zscore(deadline_index(d), index_member(d, "cancel_package")) == 1_012_000
    transitions = Transitions(client)
    # (the attempt after the one that failed is not it)
    assert transitions.recorded_many([Unrecorded(d, "package", "cancel_package", 2),
                                      Unrecorded(d, "package", "cancel_package", 1)]) == [False, True]
    assert indexed(client) == 0 and UNRECORDED + "package" not in _fields(client, d)
    assert transitions.recorded_many([Unrecorded(d, "package", "cancel_package", 1)]) == [False]  # once
    assert _scan(client, lease, 1_013_000) == {}
    assert _fields(client, d)["package.status"] == "compensation_failed"  # still waits for an operator

    # marked compensated before its record was known written: never written again after it
    decided, _ = _failed_for_good(client, lease)
    assert _mark(client, decided, "t:m", "package", 8, "compensation_failed", 3600).startswith("compensated:")
    dropped = _scan(client, lease, 1_007_000)[(decided, "cancel_package")]
    assert dropped.kind == "drop" and indexed(client) == 0
    assert UNRECORDED + "package" not in _fields(client, decided)

    # asked again before it: the new attempt's failure is supervised as any (claimed, not
    # taken for the old record), and the old attempt's mark goes
    asked, _ = _failed_for_good(client, lease)
    keys_of = [delivery_key(asked), deadline_index(asked), awaiting_operator_index(asked)]
    assert ASK_UNDO_AGAIN.run(client, asked, "t:a", keys_of, ["package", "cancel_package", 1_003_000, DEADLINE,
                                                              index_member(asked, "cancel_package"), 3600], 60) \
        == "asked:3:"
    StateTable(client).put(asked, {"cancel_package.status": "failed", "cancel_package.source": "undo.package|0|9"})
    retried = _scan(client, lease, 1_004_000)[(asked, "cancel_package")]
    assert retried.kind == "claim" and retried.data["attempt"] == 4
    assert UNRECORDED + "package" not in _fields(client, asked)


def _mark(client: redis.Redis, d: str, memo: str, step: str, now: int, *rest: str | int) -> str | None:
    """``MARK_COMPENSATED`` as the supervisor runs it (``rest``: only-from status, retention)."""
    args = [step, now, *rest] + ["", 0][len(rest):] + [index_member(d, step)]
    return MARK_COMPENSATED.run(client, d, memo, [delivery_key(d), awaiting_operator_index(d)], args, 60)


def test_the_steps_awaiting_an_operator_are_listed_however_many_are_in_flight_until_their_state_goes(
        client: redis.Redis, lease: Lease) -> None:
    waiting = _new(client, "cancel_package")
    StateTable(client).put(waiting, {"outcome": "failed", "package.status": "compensating", "undo.order": "package",
                                     "cancel_package.status": "failed", "cancel_package.tries": BUDGET})
    undoing = _new(client, "cancel_package", now=1_001_500)  # an undo under way, due later
    StateTable(client).put(undoing, {"outcome": "failed", "package.status": "compensating"})
    in_flight = {_new(client, "drone", now=995_000 + i) for i in range(3)}  # the scan extends them
    assert _scan(client, lease, 1_002_000)[(waiting, "cancel_package")].kind == "comp_failed"
    view = status.deliveries(client, limit=2, now_ms=1_002_000, undo_steps={"cancel_package"})
    assert [(v.delivery_id, v.step, v.waiting_since_ms) for v in view.awaiting_operator] == [
        (waiting, "package", 1_002_000)]
    view = status.deliveries(client, now_ms=1_002_000, undo_steps={"cancel_package"})
    assert [(v.delivery_id, v.step, v.status) for v in view.compensating] == [(undoing, "cancel_package", "pending")]
    assert {v.delivery_id for v in view.in_flight} == in_flight
    # once its deadline passed, an undo is stuck (its service may be down), not compensating
    view = status.deliveries(client, now_ms=1_002_600, undo_steps={"cancel_package"})
    assert [(v.delivery_id, v.step) for v in view.stuck] == [(undoing, "cancel_package")] and not view.compensating
    # a listed step whose record says otherwise (decided by an older version, rebuilt) is
    # neither shown nor counted, and the count takes it out
    stale = index_member(undoing, "package")
    client.zadd(awaiting_operator_index(undoing), {stale: 1_002_500})
    assert status.deliveries(client, now_ms=1_003_000).awaiting_operator[0].delivery_id == waiting
    scanner = Scanner(client, SETTINGS)
    assert scanner.awaiting(1_003_000, 86_400) == 1
    assert client.zscore(awaiting_operator_index(undoing), stale) is None
    # kept while its state waits (a day, and a margin for the clocks), trimmed once it cannot
    day_and_margin = (86_400 + AWAITING_MARGIN_S) * 1000
    assert scanner.awaiting(1_002_000 + day_and_margin, 86_400) == 1
    assert scanner.awaiting(1_002_001 + day_and_margin, 86_400) == 0
    assert client.zcard(awaiting_operator_index(waiting)) == 0


def test_an_undo_asked_again_is_a_new_attempt_with_a_full_budget_from_compensation_failed_alone(
        client: redis.Redis) -> None:
    d = _new(client, "release_drone")
    client.zadd(awaiting_operator_index(d), {index_member(d, "drone"): 1_900_000})  # listed as awaiting an operator
    StateTable(client).put(d, {"outcome": "failed", "drone.status": "compensation_failed", "undo.order": "drone",
                               "undo.reason": "NO_PACKAGE: x", "drone.error": "release_drone failed after 10 tries",
                               "release_drone.status": "failed", "release_drone.attempt": 3,
                               "release_drone.tries": BUDGET, "release_drone.error": "release refused",
                               "release_drone.source": "undo.drone|0|7"})
    client.expire(delivery_key(d), 86_400)
    args = ["drone", "release_drone", 2_000_000, 30_000, index_member(d, "release_drone"), 3600]
    keys_of = [delivery_key(d), deadline_index(d), awaiting_operator_index(d)]
    answer = ASK_UNDO_AGAIN.run(client, d, "t:a", keys_of, args, 60)
    assert answer == "asked:4:NO_PACKAGE: x"
    f = _fields(client, d)
    assert f["drone.status"] == "compensating" and "drone.error" not in f
    assert (f["release_drone.status"], f["release_drone.attempt"], f["release_drone.tries"]) == ("pending", "4", "0")
    assert "release_drone.source" not in f and "release_drone.error" not in f  # not seen yet: the scan waits
    assert client.zscore(deadline_index(d), index_member(d, "release_drone")) == 2_030_000
    assert client.zcard(awaiting_operator_index(d)) == 0  # waits no more for an operator
    assert 0 < client.ttl(delivery_key(d)) <= 3600
    # asked twice (a second decision), or of a step in any other status: nothing
    assert ASK_UNDO_AGAIN.run(client, d, "t:b", keys_of, args, 60) \
        == "ignored:compensating"
    assert _fields(client, d)["release_drone.attempt"] == "4"


def test_undo_seen_before_the_request_still_ends_compensated(client: redis.Redis) -> None:
    d = _new(client, "package")
    StateTable(client).put(d, {"package.status": "completed"})
    assert _mark(client, d, "t:1", "package", 5) == "compensated:completed:1::\x1f\x1f"
    raw = _read_failure(client, d, "t:2", 6, "drone", "FAILED", 3600, "package")
    assert parse_marked(raw).steps == [] and parse_marked(raw).next == ""
    assert parse_marked(raw).told == "compensated"  # it ended before the failure was read
    assert _fields(client, d)["package.status"] == "compensated"
    # a replay of either is told the same answer
    assert _mark(client, d, "t:1", "package", 5) == "compensated:completed:1::\x1f\x1f"


def test_reading_a_failure_gives_its_waiting_state_the_retention(client: redis.Redis) -> None:
    """The join keeps a failed delivery's state until the failure is read (a supervisor down
    past the retention would find nothing to undo); read, it has the retention from now."""
    waiting, undecided = _new(client, "package"), _new(client, "package")
    StateTable(client).put(waiting, {"package.status": "completed", "outcome": "failed"})
    client.expire(delivery_key(waiting), 86_400)
    StateTable(client).put(undecided, {"package.status": "completed"})
    for d in (waiting, undecided):
        _read_failure(client, d, "t:0", 5, "package", "r", 60, "package")
    # one the reading failed itself (a failure written by hand) goes in time too
    assert all(0 < client.ttl(delivery_key(d)) <= 60 for d in (waiting, undecided))


def test_a_failure_closes_the_steps_with_an_undo_it_leaves_out_before_they_begin(client: redis.Redis) -> None:
    """A failure written by hand names the drone's step failed and lists the package alone
    while the drone's step has not begun: the reading closes it with a new token, so its
    queued trigger takes no drone that nothing would give back; a step without an undo (the
    join) is left as it is, and so is every step of a delivery that shipped."""
    d = _new(client, "package", "drone", "delivery")
    table = StateTable(client)
    table.put(d, {"package.status": "completed"})
    raw = _read_failure(client, d, "t:0", 5, "drone", "BY_HAND: x", 3600, "package")
    marked = parse_marked(raw)
    assert [m["step"] for m in marked.steps] == ["package"] and marked.closed == ("drone",)
    fields = _fields(client, d)
    assert (fields["drone.status"], fields["drone.attempt"], fields["drone.error"]) == \
        ("failed", "2", CLOSED_BY_FAILURE)
    assert fields["delivery.status"] == "pending"
    assert client.zscore(deadline_index(d), index_member(d, "drone")) is None
    assert client.zscore(deadline_index(d), index_member(d, "delivery")) is not None
    assert table.begin(d, "drone", 1, 1_000_100, DEADLINE, BUDGET, "r|r|0|1") == Begin.STALE
    # the same reading again (a replayed batch) is told the same
    assert parse_marked(_read_failure(client, d, "t:0", 9, "drone", "BY_HAND: x", 3600, "package")).closed == ("drone",)
    shipped = _new(client, "drone")
    table.put(shipped, {"outcome": "shipped"})
    raw = _read_failure(client, shipped, "t:0", 5, "delivery", "REDRIVEN: x", 3600)
    assert parse_marked(raw).closed == () and _fields(client, shipped)["drone.status"] == "pending"


def test_a_failure_closes_a_step_claimed_for_a_requeue_it_leaves_out(client: redis.Redis, lease: Lease) -> None:
    """Claimed by the scan (pending at a new token, re-published after its back-off), a step
    with an undo that the failure leaves out is closed all the same: its requeue never goes."""
    d = _new(client, "package", "drone")
    StateTable(client).put(d, {"package.status": "completed", "drone.status": "failed", "drone.source": "r|r|0|1"})
    claim = _scan(client, lease, 1_001_000)[(d, "drone")]
    assert claim.kind == "claim" and claim.data["attempt"] == 2
    marked = parse_marked(_read_failure(client, d, "t:0", 1_001_050, "delivery", "BY_HAND: x", 3600, "package"))
    assert [m["step"] for m in marked.steps] == ["package"] and marked.closed == ("drone",)
    fields = _fields(client, d)
    assert (fields["drone.status"], fields["drone.attempt"], fields["drone.error"]) == \
        ("failed", "3", CLOSED_BY_FAILURE)
    assert client.zscore(deadline_index(d), index_member(d, "drone")) is None
    assert (d, "drone") not in _scan(client, lease, 1_010_000)  # nothing requeued


def test_undos_are_asked_one_after_another_newest_completed_first(client: redis.Redis) -> None:
    d = _new(client, "package", "customs", "drone")
    StateTable(client).put(d, {"package.status": "completed", "customs.status": "completed",
                               "drone.status": "completed"})

    def undone(step: str, memo: str) -> str:
        answer = _mark(client, d, memo, step, 7) or ""
        following = answer.split(":")[3]
        told, order = answer.split("\x1f")[1:3]
        # only the last undo ends the compensation, and it says which steps it covered
        assert (told, order) == ("compensated" if step == "package" else "", "drone,customs,package")
        return following

    raw = _read_failure(client, d, "t:0", 5, "delivery", "FLIGHT_REFUSED: no", 3600, "drone", "customs", "package")
    assert [m["step"] for m in parse_marked(raw).steps] == ["drone", "customs", "package"]
    assert parse_marked(raw).next == "drone"  # only the newest: the others wait for it
    assert undone("drone", "t:1") == "customs"
    assert undone("customs", "t:2") == "package"
    assert undone("package", "t:3") == ""
    assert {_fields(client, d)[f"{s}.status"] for s in ("drone", "customs", "package")} == {"compensated"}
    assert _fields(client, d)["outcome.told"] == "compensated"
    assert client.hget(delivery_key(d), "undo.reason") == b"FLIGHT_REFUSED: no"


def test_an_undo_that_failed_for_good_stops_the_chain(client: redis.Redis) -> None:
    d = _new(client, "package", "drone")
    StateTable(client).put(d, {"package.status": "completed", "drone.status": "completed"})
    _read_failure(client, d, "t:0", 5, "delivery", "r", 3600, "drone", "package")
    StateTable(client).put(d, {"drone.status": "compensation_failed"})
    raw = _read_failure(client, d, "t:1", 6, "delivery", "r", 3600, "drone", "package")
    assert parse_marked(raw).next == ""  # package is never asked: the alert is raised on drone
    assert _fields(client, d)["package.status"] == "compensating"
    assert parse_marked(raw).told == "failed"  # an undo failed for good: the submitter is told so, once
    again = _read_failure(client, d, "t:2", 7, "delivery", "r", 3600, "drone", "package")
    assert parse_marked(again).told == ""


def test_reports_make_the_current_attempt_due_and_ignore_stale_ones(client: redis.Redis) -> None:
    d = _new(client, "drone")
    t = Transitions(client)
    StateTable(client).put(d, {"drone.attempt": 3})
    assert t.record_report(d, "drone", 2, "FAILED", 1_000_001, "old") == "stale"
    assert t.record_report(d, "drone", 3, "RETRIES_EXHAUSTED", 1_000_002, "spent") == "due"
    assert client.zscore(deadline_index(d), index_member(d, "drone")) == 1_000_002
    assert t.record_report("nobody", "drone", 1, "FAILED", 1, "") == "unknown"
    assert not client.exists(delivery_key("nobody"))


def test_scan_is_paged_and_capped(client: redis.Redis, lease: Lease) -> None:
    for _ in range(25):
        _new(client, "package", shard=3)
    assert lease.fence is not None
    capped = SupervisorSettings(page_size=10, max_per_scan=15, backoff_base_s=0.1)
    first = Scanner(client, capped).scan(lease.fence, lease.shard_key, POLICIES, 1_002_000)
    assert first.stats.due == 15 and first.stats.capped and first.stats.page_sizes == [10, 10]
    rest = Scanner(client, capped).scan(lease.fence, lease.shard_key, POLICIES, 1_002_000)
    assert rest.stats.due == 10 and rest.stats.page_sizes == [10] and not rest.stats.capped
    assert json.dumps(sorted(a.kind for a in rest.actions)) == json.dumps(["extend"] * 10)


def test_scan_walks_every_shard(client: redis.Redis, lease: Lease) -> None:
    due = {_new(client, "package", shard=shard) for shard in range(keys.SHARDS)}
    actions = _scan(client, lease, 1_002_000)
    assert {d for d, _ in actions} == due
    assert {a.kind for a in actions.values()} == {"extend"}


def test_the_operators_status_view_reads_each_steps_record(client: redis.Redis) -> None:
    table = StateTable(client)
    waiting = _new(client, "package")  # due at 1_001_000
    stuck = _new(client, "drone", now=990_000)  # due at 991_000
    failed = _new(client, "drone")
    table.begin(failed, "drone", 1, 1_000_010, DEADLINE, BUDGET, "delivery.requested|0|1")
    table.finish(failed, "drone", 1, 1_000_020, StepStatus.FAILED, "no drone free")
    undoing = _new(client, "package")
    table.put(undoing, {"package.status": "compensating", "package.attempt": 2, "outcome": "failed"})
    view = status.deliveries(client, now_ms=1_000_500)
    assert [(v.delivery_id, v.status) for v in view.in_flight] == [(waiting, "pending")]
    assert [(v.delivery_id, v.overdue_ms) for v in view.stuck] == [(stuck, 9_500)]
    assert [(v.delivery_id, v.failures, v.error) for v in view.failed] == [(failed, 1, "no drone free")]
    assert [(v.delivery_id, v.attempt, v.outcome) for v in view.compensating] == [(undoing, 2, "failed")]
    assert view.in_flight_deliveries == 2


def test_an_answer_for_a_step_the_table_does_not_know_leaves_nothing(client: redis.Redis) -> None:
    """Redis lost mid-attempt: the attempt's late finish or try must not leave a record without
    a status, which the release and the rebuild would take for an open step."""
    table = StateTable(client)
    d = uuid.uuid4().hex
    assert table.finish(d, "drone", 1, 5, StepStatus.COMPLETED) == "ignored"
    assert table.try_again(d, "drone", 1) == 1
    assert not client.exists(delivery_key(d))


def test_values_staged_as_text_are_stored_as_numbers(client: redis.Redis) -> None:
    d = _new(client, "drone")
    StateTable(client).put(d, {"drone.attempt": "3", "drone.error": "42 drones short"})
    record = json.loads(client.hget(delivery_key(d), "drone") or b"[]")
    assert record[2] == 3 and record[10] == "42 drones short"
    assert Transitions(client).record_report(d, "drone", 2, "FAILED", 1_000_001, "") == "stale"
