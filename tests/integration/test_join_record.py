"""The join's record on the real Redis: it decides once, answers a replay of the deciding
input the same decision from the recorded results, and keeps no copy of them in the
delivery's remembered answers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import redis

from choreo.effects import memo_key, run_all
from choreo.envelope import Envelope
from choreo.join import Decision
from choreo.service import Context
from choreo.state import Begin, StateTable, StepStatus, delivery_key
from consumers.delivery import delivery as join
from schemas.models import DroneFailed, DroneScheduled, PackageReady

pytestmark = pytest.mark.integration

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def record(client: redis.Redis, delivery_id: str, event_id: str, part: str, ok: bool,
           event: PackageReady | DroneScheduled | DroneFailed) -> Decision:
    """One part's input read once (again, for a replay: the same event id)."""
    envelope = Envelope.first(event_id, delivery_id, type(event).__name__, "test")
    ctx = Context("delivery", envelope, "t", 0, 0, client, None)
    op = join.record(delivery_id, part, ok, event)
    [answer] = run_all(client, [ctx.effect(op.effect, op.keys, op.args)])
    return op.decode(answer)


def ready(delivery_id: str) -> PackageReady:
    return PackageReady(delivery_id=delivery_id, package_id=f"pkg-{delivery_id}", package_size="SMALL",
                        weight_kg=1.0, ready_at=NOW)


def scheduled(delivery_id: str) -> DroneScheduled:
    return DroneScheduled(delivery_id=delivery_id, drone_id="drone-7", scheduled_at=NOW)


def test_a_replay_of_the_deciding_input_gets_the_decision_again(redis_client: redis.Redis) -> None:
    delivery_id = f"join-{uuid.uuid4()}"
    package_event, drone_event = str(uuid.uuid4()), str(uuid.uuid4())
    assert record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id)).kind == "wait"
    assert record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id)).kind == "wait"

    decided = record(redis_client, delivery_id, drone_event, "drone", True, scheduled(delivery_id))
    assert decided.kind == "complete" and decided.joined is not None
    assert decided.joined.completed == ("drone", "package")
    assert decided.joined.of("drone", DroneScheduled).drone_id == "drone-7"

    # the batch that decided aborted: its replay must publish the same decision
    assert record(redis_client, delivery_id, drone_event, "drone", True, scheduled(delivery_id)) == decided
    # the complete handler refused the flight afterwards: a replay still decides as first
    redis_client.hset(delivery_key(delivery_id), "outcome", "failed")
    assert record(redis_client, delivery_id, drone_event, "drone", True, scheduled(delivery_id)) == decided
    # any other input, the first half's replay too, waits: the step is the decider's to complete
    assert record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id)).kind == "wait"
    assert record(redis_client, delivery_id, str(uuid.uuid4()), "drone", True,
                  scheduled(delivery_id)).kind == "wait"
    assert not redis_client.exists(memo_key(delivery_id)), "the join kept a copy of its answers"
    assert 0 < redis_client.ttl(delivery_key(delivery_id)) <= join.retention_s


def test_a_result_after_an_outcome_the_join_did_not_decide_is_late(redis_client: redis.Redis) -> None:
    """The supervisor failed the delivery (or a rebuild restored its outcome): a part that comes
    after is recorded and ignored, and may complete its step with no outputs."""
    delivery_id = f"join-{uuid.uuid4()}"
    redis_client.hset(delivery_key(delivery_id), "outcome", "failed")
    redis_client.expire(delivery_key(delivery_id), 60)
    late = record(redis_client, delivery_id, str(uuid.uuid4()), "drone", True, scheduled(delivery_id))
    assert late.kind == "late"
    assert redis_client.hexists(delivery_key(delivery_id), "fanin.drone")


def test_a_failed_part_decides_failure_once_every_part_is_in(redis_client: redis.Redis) -> None:
    delivery_id = f"join-{uuid.uuid4()}"
    no_drone = DroneFailed(delivery_id=delivery_id, reason="NO_DRONE_FITS", detail="too heavy", failed_at=NOW)
    drone_event, package_event = str(uuid.uuid4()), str(uuid.uuid4())
    assert record(redis_client, delivery_id, drone_event, "drone", False, no_drone).kind == "wait"
    failed = record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id))
    assert failed.kind == "fail" and failed.failed is not None
    assert (failed.failed.part, failed.failed.completed) == ("drone", ("package",))
    assert redis_client.hget(delivery_key(delivery_id), "outcome") == b"failed"
    assert record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id)) == failed
    # its state waits for the supervisor to read the failure (which shortens it to the retention)
    assert join.retention_s < redis_client.ttl(delivery_key(delivery_id)) <= join.unread_failure_s


def test_a_refusal_after_success_keeps_the_state_until_the_failure_is_read(redis_client: redis.Redis) -> None:
    delivery_id = f"join-{uuid.uuid4()}"
    record(redis_client, delivery_id, str(uuid.uuid4()), "package", True, ready(delivery_id))
    assert record(redis_client, delivery_id, str(uuid.uuid4()), "drone", True, scheduled(delivery_id)).kind == "complete"
    assert 0 < redis_client.ttl(delivery_key(delivery_id)) <= join.retention_s
    envelope = Envelope.first(str(uuid.uuid4()), delivery_id, "DroneScheduled", "test")
    op = join.refuse(delivery_id)
    run_all(redis_client, [Context("delivery", envelope, "t", 0, 0, redis_client, None).effect(op.effect, op.keys, op.args)])
    assert redis_client.hget(delivery_key(delivery_id), "outcome") == b"failed"
    assert join.retention_s < redis_client.ttl(delivery_key(delivery_id)) <= join.unread_failure_s


def test_the_record_rides_in_the_begin_of_an_input_that_runs_only(redis_client: redis.Redis) -> None:
    """One script item begins the half's step and records it: the decision comes back with the
    verdict; an input that will not run (past the step's deadline) records nothing."""
    delivery_id = f"join-{uuid.uuid4()}"
    state = StateTable(redis_client)
    now = 1_000

    def begin(event_id: str, part: str, event: PackageReady | DroneScheduled, attempt: int = 1
              ) -> tuple[Begin, Decision | None]:
        envelope = Envelope.first(event_id, delivery_id, type(event).__name__, "test")
        op = join.record(delivery_id, part, True, event)
        call = Context("delivery", envelope, "t", 0, 0, redis_client, None).effect(op.effect, op.keys, op.args)
        [(verdict, _)], [answer] = state.begin_riding(
            [(delivery_id, "delivery", attempt, now, 60_000, f"{part}.t|0|1")], 5, {"delivery"},
            riders=[call.rider()])
        return verdict, None if answer is None else op.decode(answer)

    state.open(delivery_id, "delivery", now - 1, now, attempt=2)  # past its deadline: expired
    verdict, decided = begin(str(uuid.uuid4()), "package", ready(delivery_id), attempt=2)
    assert verdict is Begin.EXPIRED and decided is None
    assert not redis_client.hexists(delivery_key(delivery_id), "fanin.package")
    state.put(delivery_id, {"delivery.complete_by": now + 60_000})
    verdict, decided = begin(str(uuid.uuid4()), "package", ready(delivery_id), attempt=2)
    assert verdict is Begin.GO and decided is not None and decided.kind == "wait"
    drone_event = str(uuid.uuid4())
    verdict, decided = begin(drone_event, "drone", scheduled(delivery_id), attempt=2)
    assert verdict is Begin.GO and decided is not None and decided.kind == "complete"
    state.finish(delivery_id, "delivery", 2, now + 5, StepStatus.COMPLETED)
    # the deciding batch aborted after the finish: its replay is told the decision again
    verdict, again = begin(drone_event, "drone", scheduled(delivery_id), attempt=2)
    assert verdict is Begin.REPLAY and again == decided
