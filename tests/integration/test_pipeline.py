"""The drone-delivery choreography end to end on the real stack, services as real processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from confluent_kafka import Producer

from choreo.config import settings
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from choreo import topology
from tests.factories import delivery_request
from tests.helpers import notified_or_released, read_topic, wait_for
from tests.pipeline import Pipeline, notifier_later, of, submit, terminal_counts, wait_terminal

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def topics(stack: None) -> None:
    topology.create(WORKFLOW)


@pytest.fixture()
def pipeline_env() -> dict[str, str]:
    return {}


@pytest.fixture()
def pipeline(pipeline_env: dict[str, str]) -> Iterator[Pipeline]:
    running = Pipeline(env=pipeline_env).start()
    yield running
    running.kill()


def test_a_thousand_deliveries_all_ship_exactly_once(pipeline: Pipeline,
                                                     redis_client: redis.Redis) -> None:
    ids = set(submit([delivery_request(weight_kg=1.0 + i % 20) for i in range(1000)]))
    counts = wait_terminal(ids, timeout_s=180)
    assert set(counts.values()) == {1}
    shipped = of(read_topic("delivery.shipped"), ids)
    assert len(shipped) == 1000
    assert len({r.header("event_id") for r in shipped}) == 1000
    assert fleet.double_bookings(redis_client) == []
    notified = wait_for(lambda: (n := notified_or_released(redis_client, sorted(ids))) and all(n) and n,
                        what="notifications")
    assert len(notified) == 1000
    assert pipeline.alive()


@pytest.mark.parametrize("pipeline_env", [{
    "AGENT_WAREHOUSE_PERMANENT_RATE": "0.2", "AGENT_DISPATCH_PERMANENT_RATE": "0.2",
}])
def test_permanent_failures_end_once_and_are_compensated(pipeline: Pipeline,
                                                         redis_client: redis.Redis) -> None:
    requests = [delivery_request(weight_kg=2.0) for _ in range(300)]
    requests += [delivery_request(weight_kg=99.0) for _ in range(10)]  # no drone fits 99 kg
    ids = set(submit(requests))
    counts = wait_terminal(ids, timeout_s=180)
    assert set(counts.values()) == {1}
    failed = {r.key.decode(): r for r in of(read_topic("delivery.failed"), ids) if r.key}
    assert len(failed) > 30  # ~36% should fail at 20% per step, plus the 10 unfittable ones
    ready = {r.key.decode() for r in of(read_topic("package.ready"), ids) if r.key}
    scheduled = {r.key.decode() for r in of(read_topic("drone.scheduled"), ids) if r.key}
    wait_for(lambda: {r.key.decode() for r in of(read_topic("package.cancelled"), set(failed)) if r.key}
             >= ready & set(failed), what="every prepared package of a failed delivery cancelled")
    wait_for(lambda: {r.key.decode() for r in of(read_topic("drone.released"), set(failed)) if r.key}
             >= scheduled & set(failed), what="every drone of a failed delivery released")
    assert fleet.double_bookings(redis_client) == []
    # failed deliveries' drones were released; shipped ones came back when the supervisor read
    # the shipment
    wait_for(lambda: not {k.decode() for k in redis_client.hkeys(fleet.booking_key)} & ids, timeout_s=60,
             what="every drone back in the fleet")


@pytest.mark.parametrize("pipeline_env", [{"AGENT_WAREHOUSE_LATENCY_MS": "0"}])
def test_fan_in_in_either_order_with_two_delivery_instances(pipeline_env: dict[str, str],
                                                            redis_client: redis.Redis) -> None:
    """Drone first for some deliveries, package first for others, two delivery instances."""
    slow_package = Pipeline(env={"AGENT_WAREHOUSE_LATENCY_MS": "20"}).start(["consumers.package:service"])
    slow_drone = Pipeline(env={"AGENT_DISPATCH_LATENCY_MS": "20"}).start(["consumers.drone_scheduler:service"])
    deliveries = Pipeline(instances=2).start(["consumers.delivery:service"])
    try:
        ids = set(submit([delivery_request() for _ in range(100)]))
        counts = wait_terminal(ids, timeout_s=120)
        assert set(counts.values()) == {1}
        assert len(of(read_topic("delivery.shipped"), ids)) == 100
    finally:
        for p in (slow_package, slow_drone, deliveries):
            p.kill()


def test_duplicated_step_events_do_not_ship_twice(pipeline: Pipeline) -> None:
    ids = set(submit([delivery_request() for _ in range(20)]))
    wait_terminal(ids)
    # replay every step result of these deliveries, byte for byte, headers included
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    for topic in ("package.ready", "drone.scheduled"):
        for record in of(read_topic(topic), ids):
            producer.produce(topic, key=record.key, value=record.value, headers=record.headers)
    producer.flush(10)
    sentinel = set(submit([delivery_request()]))  # ordered after the duplicates on its partition
    wait_terminal(sentinel)
    wait_for(lambda: len(of(read_topic("delivery.shipped"), sentinel)) == 1, what="sentinel")
    assert set(terminal_counts(ids).values()) == {1}


def test_notifier_started_later_catches_up_from_the_topic(redis_client: redis.Redis) -> None:
    with notifier_later(SERVICES_WITHOUT_NOTIFIER) as start_notifier:
        ids = set(submit([delivery_request() for _ in range(50)]))
        wait_terminal(ids)
        assert not any(notified_or_released(redis_client, sorted(ids)))
        start_notifier()
        wait_for(lambda: all(notified_or_released(redis_client, sorted(ids))), what="catch-up")


SERVICES_WITHOUT_NOTIFIER = ["consumers.package:service", "consumers.drone_scheduler:service",
                             "consumers.delivery:service"]
