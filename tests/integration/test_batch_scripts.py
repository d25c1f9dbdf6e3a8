"""One script call for many items (``choreo.batch``) on the real Redis: each item runs as if
alone, with its own KEYS and ARGV, and sees what the items before it wrote."""

from __future__ import annotations

import time
import uuid
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from prometheus_client import REGISTRY

from choreo import batch, effects, keys
from choreo.answers import dropped_by
from choreo.batch import BatchScript, run_together
from choreo.config import settings
from choreo.effects import EffectCall, OnceEffect, run_all
from choreo.envelope import Envelope
from choreo.pool import Pool
from choreo.record import Record
from choreo.release import AWAIT_RELEASE
from choreo.redis_client import TRANSIENT, ReplicationLag, connect, is_cluster
from choreo.service import Context
from choreo.state import (
    RESTORE_BUDGET, HashWrite, Restored, StateTable, StepStatus, deadline_index, delivery_key, index_member,
)
from choreo.supervision import Transitions

pytestmark = pytest.mark.integration

# answers with its own keys and args; false for an item without args
ECHO = """
if #ARGV == 0 then return false end
return table.concat(KEYS, ',') .. '|' .. table.concat(ARGV, ',')
"""
# counts its key up by ARGV[1], answering the new value
INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


def test_each_item_gets_its_own_keys_and_args_in_order(redis_client: redis.Redis, unique: str) -> None:
    echo = BatchScript(redis_client, "echo", ECHO)
    answers = echo.run([([f"{{{unique}}}:a"], ["1", "2"]), ([], ["x"]), ([f"{{{unique}}}:b", f"{{{unique}}}:c"], [])])
    assert answers == [f"{{{unique}}}:a|1,2".encode(), b"|x", None]


def test_items_past_a_chunk_go_in_several_calls_of_one_round_trip(
        redis_client: redis.Redis, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "CHUNK", 3)
    incr, echo = BatchScript(redis_client, "incr", INCR), BatchScript(redis_client, "echo", ECHO)
    counted, echoed = run_together(redis_client, [
        (incr, [([f"{{{unique}}}:n"], [1])] * 7),
        (echo, [([], [str(i)]) for i in range(4)]),
    ])
    assert counted == [1, 2, 3, 4, 5, 6, 7]  # in order, across three calls
    assert echoed == [b"|0", b"|1", b"|2", b"|3"]
    assert run_together(redis_client, [(incr, [])]) == [[]]


def test_a_step_transition_sees_the_records_an_earlier_item_wrote(
        redis_client: redis.Redis, unique: str) -> None:
    """Each item writes back its step records before the next reads them: a step completed
    twice in one batch is ``ok`` then ``replay``, as it would be in two calls."""
    state = StateTable(redis_client)
    delivery = f"batch-{unique}"
    state.open_many([(delivery, "package", 10**13, 1), (delivery, "drone", 10**13, 2)], 1)
    assert {name: (s.status, s.attempt) for name, s in state.steps(delivery).items()} == {
        "package": ("pending", 1), "drone": ("pending", 2)}
    verdicts = state.begin_many([(delivery, "package", 1, 2, 1000, "t|0|1"),
                                 (delivery, "package", 1, 3, 1000, "t|0|1")], budget=5)
    assert [v.value for v, _ in verdicts] == ["go", "go"]
    assert state.steps(delivery)["package"].tries == 2  # the second counted on the first
    assert state.complete_many([(delivery, "package", 1), (delivery, "package", 1)], 4) == ["ok", "replay"]
    assert state.steps(delivery)["package"].status == "completed"
    assert state.finish(delivery, "drone", 1, 5, StepStatus.FAILED, "late") == "stale"


def test_a_finish_opens_the_steps_its_outputs_start_only_when_they_are_published(
        redis_client: redis.Redis, unique: str) -> None:
    """One item finishes a step and opens the next ones of its delivery, unless the attempt is
    a late answer (its outputs are dropped); steps opened apart go in the same round trip."""
    state = StateTable(redis_client)
    now, later = 1_000, 10**13
    ok, late, other = (f"{name}-{unique}" for name in ("ok", "late", "other"))
    state.open_many([(ok, "package", later, 1), (late, "package", later, 2)], now)
    verdicts = state.complete_many(
        [(ok, "package", 1), (late, "package", 1)], now,
        opening=[[("delivery", later, 1)], [("delivery", later, 1)]],
        also_open=[(other, "drone", later, 1)])
    assert verdicts == ["ok", "stale"]
    assert state.steps(ok)["delivery"].status == StepStatus.PENDING
    assert "delivery" not in state.steps(late)  # a late answer's outputs start nothing
    assert state.steps(other)["drone"].status == StepStatus.PENDING
    assert redis_client.zscore(deadline_index(ok), index_member(ok, "delivery")) == later
    # a replay of the finish opens nothing twice and changes no opened step
    assert state.complete_many([(ok, "package", 1)], now + 5, opening=[[("delivery", later + 1, 1)]]) == ["replay"]
    assert state.steps(ok)["delivery"].complete_by == later


def test_a_finish_applies_its_attempts_writes_only_when_it_completes_the_step(
        redis_client: redis.Redis, unique: str) -> None:
    """A step's writes ride in its finish: applied with ``ok``, in the finish's own item, with
    the steps it opens; not again by a replay (what changed since stays); not at all for a late
    answer, whose outputs are dropped."""
    state = StateTable(redis_client)
    now, later = 1_000, 10**13
    ok, late = (f"{name}-{unique}" for name in ("ok", "late"))
    state.open_many([(ok, "package", later, 1), (late, "package", later, 2)], now)
    record_of = {d: keys.of_delivery("pkg", d) for d in (ok, late)}
    writes = [[HashWrite(record_of[d], 600, ("status", "ready", "weight_kg", 2.5))] for d in (ok, late)]
    assert state.complete_many([(ok, "package", 1), (late, "package", 1)], now,
                               opening=[[("delivery", later, 1)], []], writes=writes) == ["ok", "stale"]
    assert redis_client.hgetall(record_of[ok]) == {b"status": b"ready", b"weight_kg": b"2.5"}
    assert 0 < redis_client.ttl(record_of[ok]) <= 600
    assert state.steps(ok)["delivery"].status == StepStatus.PENDING  # opened after the writes' args
    assert not redis_client.exists(record_of[late])
    redis_client.hset(record_of[ok], "status", "cancelled")
    assert state.complete_many([(ok, "package", 1)], now + 5, writes=writes[:1]) == ["replay"]
    assert redis_client.hget(record_of[ok], "status") == b"cancelled"


def test_a_restored_delivery_holds_what_its_steps_transitions_would_have_written(
        redis_client: redis.Redis, unique: str) -> None:
    """The rebuild restores a delivery's steps in one item (``restore_many``): its table and
    its deadline index entries are those of the open, begin and finish each step went through,
    for a completed step, a failed one, one still open and one opened at a later attempt, and
    each delivery of a call gets its own."""
    state = StateTable(redis_client)
    now, due, source = 5_000, 10**13, "delivery.requested|0|7"
    shapes = [Restored("package", 1, due, source, (StepStatus.COMPLETED, "")),
              Restored("drone", 2, due + 1, source, (StepStatus.FAILED, "dispatch: refused")),
              Restored("delivery", 1, due + 2, "", None),
              Restored("customs", 3, due + 3, source, None)]
    restored, other, transitions = (f"{name}-{unique}" for name in ("restored", "other", "transitions"))
    state.restore_many([(restored, shapes), (other, shapes[:1])], now)
    state.open_many([(transitions, s.step, s.complete_by_ms, s.attempt) for s in shapes], now)
    ended = [(s, s.ended) for s in shapes if s.ended is not None]
    state.begin_many([(transitions, s.step, s.attempt, now, 30_000, s.source) for s, _ in ended], RESTORE_BUDGET)
    state.finish_many([(transitions, s.step, s.attempt, status, error) for s, (status, error) in ended], now)
    assert state.raw(restored) == state.raw(transitions)
    steps = state.steps(restored)
    assert [steps[s.step].status for s in shapes] == [
        StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.PENDING, StepStatus.PENDING]
    assert steps["customs"].attempt == 3 and steps["drone"].attempt == 2
    assert set(state.steps(other)) == {"package"} and state.steps(other)["package"].status == StepStatus.COMPLETED

    def due_by(delivery: str) -> dict[str, float]:
        entries = cast(list[tuple[bytes, float]], redis_client.zrange(deadline_index(delivery), 0, -1, withscores=True))
        return {member.split("|", 1)[1]: score for member, score in ((m.decode(), sc) for m, sc in entries)
                if member.startswith(delivery + "|")}

    assert due_by(restored) == due_by(transitions) == {"drone": now, "delivery": due + 2, "customs": due + 3}
    with pytest.raises(ValueError, match="restored twice"):  # its second begin would be a replay
        state.restore_many([(f"twice-{unique}", [shapes[0], shapes[0]])], now)


def test_an_item_answering_an_error_fails_the_call(redis_client: redis.Redis) -> None:
    failing = BatchScript(redis_client, "failing", "if ARGV[1] == 'bad' then return redis.error_reply('no') end return 1")
    with pytest.raises(redis.ResponseError, match="no"):
        failing.run([([], ["good"]), ([], ["bad"])])


@pytest.mark.parametrize("three_calls", [False, True], ids=["as-the-store-allows", "in-three-calls"])
def test_effects_of_a_round_run_in_input_order_across_effects(
        redis_client: redis.Redis, unique: str, three_calls: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive calls of one effect share a script call, but a later effect never runs
    before an earlier one of another kind (a release, then a reserve of the same fleet). The
    counter lies in another slot than the deliveries: on one node each effect runs in one
    script with its memo, on a cluster in three calls (recall, body, remember), which
    ``three_calls`` takes on one node too."""
    if three_calls:
        monkeypatch.setattr(effects, "is_cluster", lambda client: True)
    count = OnceEffect("count", "return tostring(redis.call('INCRBY', KEYS[1], 1))")
    read = OnceEffect("read", "return tostring(redis.call('GET', KEYS[1]))")
    counter = f"{unique}:counter"
    calls = [EffectCall(effect, f"{unique}-{i}", f"{effect.name}:{i}", (counter,), (), 60)
             for i, effect in enumerate([count, count, read, count, read])]
    assert run_all(redis_client, calls) == ["1", "2", "2", "3", "3"]
    assert run_all(redis_client, calls) == ["1", "2", "2", "3", "3"]  # remembered, not run again


@pytest.mark.parametrize("three_calls", [False, True], ids=["as-the-store-allows", "in-three-calls"])
def test_an_effect_of_an_attempt_that_lost_its_step_is_not_run(
        redis_client: redis.Redis, unique: str, three_calls: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled attempt resuming after the supervisor gave its step to a newer attempt, or
    failed the delivery and undid the step, must take no drone: its effect answers ``STALE``
    and is not run. The step's current attempt runs it; an answer remembered before is
    replayed to anyone; an effect asked outside a step is not fenced. The pool lies in
    another slot than the delivery: in one script on one node, in three calls on a cluster
    (``three_calls`` takes them on one node too)."""
    if three_calls:
        monkeypatch.setattr(effects, "is_cluster", lambda client: True)
    fleet = Pool(f"fence-{unique}", seed=lambda: {"drone-a": 5.0, "drone-b": 5.0})
    fleet.grow(redis_client)
    table = StateTable(redis_client)
    d = f"{unique}-d"

    def reserve(event: str, attempt: int, step: str = "drone") -> str | None:
        op = fleet.reserve(d, 1.0)
        return EffectCall(op.effect, d, f"drone-scheduler:pool_reserve:{event}", op.keys, op.args, 60,
                          True, step, attempt).run(redis_client)

    table.put(d, {"drone.status": "processing", "drone.attempt": 2})  # the supervisor requeued it
    assert dropped_by(reserve("e1", 1)) == "stale"
    assert redis_client.zcard(fleet.free_key) == 2 and not redis_client.hlen(fleet.booking_key)
    assert reserve("e2", 2) == "drone-a"  # the step's own attempt
    assert dropped_by(reserve("e1", 1)) == "stale"  # still nothing remembered for the stale one
    table.put(d, {"drone.status": "compensated"})  # the delivery failed, the drone given back
    redis_client.eval("return redis.call('ZADD', KEYS[1], 5, 'drone-a') + redis.call('DEL', KEYS[2], KEYS[3])",
                      3, fleet.free_key, fleet.booking_key, fleet.held_key)
    assert dropped_by(reserve("e3", 2)) == "stale"  # the step is closed: not even its own attempt
    assert reserve("e2", 2) == "drone-a"  # the answer it was given is replayed, nothing booked
    assert not redis_client.hlen(fleet.booking_key)
    assert reserve("e4", 1, step="") == "drone-a"  # outside a step: not fenced
    assert redis_client.hget(fleet.booking_key, d) == b"drone-a"
    redis_client.delete(*fleet.keys, delivery_key(d), effects.memo_key(d))


@pytest.mark.parametrize("three_calls", [False, True], ids=["as-the-store-allows", "in-three-calls"])
def test_an_effect_that_remembers_itself_answers_a_replay_the_same_with_no_memo(
        redis_client: redis.Redis, unique: str, three_calls: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's field set once and the supervisor's record of a terminal are their own
    memos: a replay (the same event and effect) is answered as the first run was, with no
    copy in the delivery's ``fx:`` hash. The effects with a memo beside them (a pool's
    reservation, a record's put) keep it. On a cluster (taken here on one node by
    ``three_calls``) the terminal's record, on another slot, takes no third call."""
    if three_calls:
        monkeypatch.setattr(effects, "is_cluster", lambda client: True)
    fleet = Pool(f"self-{unique}", seed=lambda: {"drone-a": 5.0, "drone-b": 5.0})
    fleet.grow(redis_client)
    notes = Record(f"notes-{unique}", ttl_s=60)
    d = f"{unique}-d"
    awaiting = f"{unique}:release"

    def remembered() -> float:
        return REGISTRY.get_sample_value("choreo_redis_script_items_total", {"script": "effect_remember"}) or 0.0

    def round_(drone: str) -> list[str | None]:
        ops = [(fleet.reserve(d, 1.0), "reserve"), (notes.set_once(d, "drone", drone), "once"),
               (notes.put(d, drone=drone), "put")]
        return run_all(redis_client, [
            *(EffectCall(op.effect, d, f"svc:{name}:e1", op.keys, op.args, 60) for op, name in ops),
            EffectCall(AWAIT_RELEASE, d, "svc:await:e1", (awaiting,), (7, d), 60)])

    before = remembered()
    first = round_("drone-a")
    assert first == ["drone-a", "drone-a", "ok", "awaiting"]
    assert round_("drone-b") == first  # the replay: the same answers, nothing run twice
    assert redis_client.zcard(fleet.free_key) == 1 and redis_client.hget(notes.key(d), "drone") == b"drone-a"
    assert redis_client.zscore(awaiting, d) == 7
    assert set(redis_client.hkeys(effects.memo_key(d))) == {b"svc:reserve:e1", b"svc:put:e1"}
    on_another_slot = three_calls or is_cluster(redis_client)  # the reservation remembered in its own call
    assert remembered() - before == (1 if on_another_slot else 0)
    redis_client.delete(*fleet.keys, notes.key(d), awaiting, effects.memo_key(d))


@pytest.mark.parametrize("three_calls", [False, True], ids=["as-the-store-allows", "in-three-calls"])
def test_no_text_an_event_carries_reads_as_an_effect_not_run(
        redis_client: redis.Redis, unique: str, three_calls: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record's field is ``set_once``'s answer, and its value may come from an event: a
    shipment naming its drone ``"stale"`` (or the words with a NUL before them) is answered
    that drone, not taken for the runtime's refusal, which would drop the notifier's attempt
    at every requeue. The refusal itself still reads as one, on a cluster's path too."""
    if three_calls:
        monkeypatch.setattr(effects, "is_cluster", lambda client: True)
    notes = Record(f"words-{unique}", ttl_s=60)
    d = f"{unique}-d"
    for n, word in enumerate(("stale", "released", "\x00stale", "\x00released")):
        op = notes.set_once(d, f"drone{n}", word)
        answer = EffectCall(op.effect, d, f"svc:once:e{n}", op.keys, op.args, 60, True, "notify", 1).run(redis_client)
        assert answer == word and dropped_by(answer) == ""
    StateTable(redis_client).put(d, {"notify.status": "processing", "notify.attempt": 2})
    op = notes.set_once(d, "drone9", "drone-a")
    answer = EffectCall(op.effect, d, "svc:once:e9", op.keys, op.args, 60, True, "notify", 1).run(redis_client)
    assert dropped_by(answer) == "stale" and redis_client.hget(notes.key(d), "drone9") is None
    redis_client.delete(notes.key(d), delivery_key(d), effects.memo_key(d))


def test_each_effect_of_a_kind_for_one_event_gets_its_own_answer(redis_client: redis.Redis, unique: str) -> None:
    """A handler that asks the same effect twice for one event (a record updated twice) gets
    each call's answer, not the first one's again; a replay gets the same answers in order."""
    count = OnceEffect("count", "return tostring(redis.call('INCRBY', KEYS[1], 1))")
    envelope = Envelope.first(str(uuid.uuid4()), str(uuid.uuid4()), "Probe", "test")

    def handle() -> list[str | None]:
        ctx = Context("probe", envelope, "t", 0, 0, redis_client, None)
        return run_all(redis_client, [ctx.effect(count, [f"{unique}:n"]), ctx.effect(count, [f"{unique}:n"])])

    assert handle() == ["1", "2"]
    assert handle() == ["1", "2"]  # remembered, not run again


def test_a_user_kept_from_dangerous_commands_still_finds_the_cluster(redis_client: redis.Redis,
                                                                      unique: str) -> None:
    """The secured stack's users may not run ``INFO`` (``-@dangerous``): asked that way, a
    cluster looked like a single node, and every multi-key call failed with CROSSSLOT."""
    user, password = f"kept-{unique}", uuid.uuid4().hex
    nodes = ([node.redis_connection for node in redis_client.get_nodes()]  # type: ignore[attr-defined]
             if is_cluster(redis_client) else [redis_client])
    for node in nodes:
        node.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"],
                         categories=["+@all", "-@admin", "-@dangerous"])
    try:
        parts = urlsplit(settings().redis_url)
        client = connect(urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.netloc}")))
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command("INFO", "cluster", target_nodes="random") if is_cluster(client) \
                else client.info("cluster")
        assert is_cluster(client) == is_cluster(redis_client)
        table = StateTable(client)
        delivery_ids = [f"{unique}-{i}" for i in range(20)]  # many shards, so many slots
        table.open_many([(d, "package", 2**40, 1) for d in delivery_ids], 1)
        assert all(table.steps(d)["package"].status == StepStatus.PENDING for d in delivery_ids)
    finally:
        for node in nodes:
            node.acl_deluser(user)


def test_a_batch_waits_for_a_replica_of_each_master_it_wrote_to(
        redis_client: redis.Redis, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``CHOREO_REDIS_WAIT_REPLICAS``: on the cluster lane every master has a replica and the
    batch goes through; a single node has none, and the batch fails as transient after the
    wait, its write not to be trusted."""
    monkeypatch.setenv("CHOREO_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("CHOREO_REDIS_WAIT_MS", "200")
    settings.cache_clear()
    try:
        incr = BatchScript(redis_client, "incr", INCR)
        items = [([f"{{{unique}}}:w"], [1]), ([f"{{{unique}x}}:w"], [1])]  # two slots
        if is_cluster(redis_client):
            assert incr.run(items) == [1, 1]
        else:
            started = time.monotonic()
            with pytest.raises(ReplicationLag) as lag:
                incr.run(items)
            assert "0 of 1 replicas" in str(lag.value) and time.monotonic() - started >= 0.19
            assert isinstance(lag.value, TRANSIENT)  # the runner aborts and reads the batch again
    finally:
        settings.cache_clear()


def test_a_try_count_and_a_recovery_report_wait_for_a_replica(
        redis_client: redis.Redis, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writes outside a batch that a committed offset rests on wait too: a step's try
    count (lost, the step would get tries past its budget) and the supervisor's record of a
    report (lost, the step would wait for its deadline)."""
    state, transitions = StateTable(redis_client), Transitions(redis_client)
    delivery = f"waited-{unique}"
    state.open_many([(delivery, "package", 10**13, 1)], 1)
    monkeypatch.setenv("CHOREO_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("CHOREO_REDIS_WAIT_MS", "200")
    settings.cache_clear()
    try:
        writes = [lambda: state.try_again(delivery, "package", 1),
                  lambda: transitions.record_report(delivery, "package", 1, "FAILED", 2, "boom")]
        if is_cluster(redis_client):
            assert [write() for write in writes] == [1, "due"]
        else:
            for write in writes:
                with pytest.raises(ReplicationLag, match="0 of 1 replicas"):
                    write()
    finally:
        settings.cache_clear()
