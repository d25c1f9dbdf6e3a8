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
from choreo.state import delivery_key
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
    # any other input, the first half's replay too, comes late
    assert record(redis_client, delivery_id, package_event, "package", True, ready(delivery_id)).kind == "late"
    assert record(redis_client, delivery_id, str(uuid.uuid4()), "drone", True,
                  scheduled(delivery_id)).kind == "late"
    assert not redis_client.exists(memo_key(delivery_id)), "the join kept a copy of its answers"
    assert 0 < redis_client.ttl(delivery_key(delivery_id)) <= join.retention_s


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
