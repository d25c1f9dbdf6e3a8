"""Replay on the real stack: a time range into a new subscriber delivers exactly that range;
a replay into live services changes nothing visible."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pytest
import redis

from choreo.envelope import now_ms
from choreo.kafka import ensure_topics
from choreo.ops.replay import RangeSpec, committed_offsets, replay_into_service
from choreo.publisher import Publisher
from choreo.service import load_service
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from tests.factories import delivery_request
from tests.helpers import read_topic
from tests.pipeline import Pipeline, of, submit, wait_terminal
from tests.services.ops_subscriber import build

pytestmark = pytest.mark.integration


def _publish(topic: str, n: int) -> list[str]:
    publisher = Publisher("test")
    ids = [str(uuid.uuid4()) for _ in range(n)]
    for event_id in ids:
        publisher.publish(delivery_request(), event_id, topic=topic)
    publisher.flush(30)
    return ids


def test_time_range_into_a_new_subscriber_delivers_exactly_that_range(stack: None, unique: str) -> None:
    topic = f"t.ops.replay.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq"], partitions=3)
    before = _publish(topic, 20)
    time.sleep(0.05)
    since = now_ms()
    time.sleep(0.05)
    inside = _publish(topic, 30)
    time.sleep(0.05)
    until = now_ms()
    time.sleep(0.05)
    after = _publish(topic, 20)
    subscriber = build(topic)
    result = replay_into_service(subscriber, RangeSpec([topic], since, until), workflow=None)
    assert result.records == 30 and result.handled == 30 and result.duplicates == 0
    out = read_topic(f"{topic}.out")
    causes = Counter(r.envelope.causation_id for r in out if r.envelope)
    assert set(causes) == set(inside) and set(causes.values()) == {1}
    assert not set(causes) & (set(before) | set(after))
    # the subscriber's own (live) group was never touched: it has no committed offsets
    assert all(o < 0 for o in committed_offsets(subscriber.name, result.spans).values())
    # a second replay of the same range (another group) handles nothing again
    again = replay_into_service(build(topic), RangeSpec([topic], since, until))
    assert again.handled == 0 and again.duplicates == 30
    assert len(read_topic(f"{topic}.out")) == 30


OUTPUTS = ("package.ready", "package.failed", "drone.scheduled", "drone.failed", "delivery.shipped",
           "delivery.failed", "drone.released", "package.cancelled")


def _outputs(ids: set[str]) -> dict[str, int]:
    return {t: len(of(read_topic(t), ids)) for t in OUTPUTS}


def test_replay_into_live_services_changes_nothing_visible(pipeline: Pipeline,
                                                          redis_client: redis.Redis) -> None:
    since = now_ms() - 1000
    ids = set(submit([delivery_request(weight_kg=1.0 + i % 5) for i in range(20)]))
    assert set(wait_terminal(ids).values()) == {1}
    time.sleep(1.0)  # let the readers of delivery.shipped commit
    seen = _outputs(ids)
    assert seen["delivery.shipped"] + seen["delivery.failed"] == 20
    until = now_ms()
    totals = Counter[str]()
    for ref, topics in (("consumers.package:service", ["delivery.requested"]),
                        ("consumers.drone_scheduler:service", ["delivery.requested"]),
                        ("consumers.delivery:service", ["package.ready", "drone.scheduled"]),
                        ("consumers.notifier:service", ["delivery.shipped"])):
        result = replay_into_service(load_service(ref), RangeSpec(topics, since, until), workflow=WORKFLOW)
        assert result.handled == 0, f"{ref} handled {result.handled} events again"
        totals[ref] = result.duplicates + result.released  # released: choreo.release
    assert totals["consumers.package:service"] >= 20 and totals["consumers.delivery:service"] >= 20
    assert _outputs(ids) == seen
    assert fleet.double_bookings(redis_client) == []
    assert pipeline.alive()
