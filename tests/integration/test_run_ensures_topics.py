"""``choreo run`` creates the topics its service declares: a new subscriber, not in the
workflow's list, that emits to a brand-new topic runs with no manual step, and what it
creates has the partition count of the topics it reads (not the default)."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest

from choreo import topology
from choreo.kafka import admin, ensure_topics
from choreo.publisher import Publisher
from schemas.models import DeliveryShipped
from tests.helpers import ServiceProcess, read_topic, wait_for

pytestmark = pytest.mark.integration

UPSTREAM_PARTITIONS = 3  # not topology.DEFAULT_PARTITIONS: the count must come from the input


def _partitions(topic: str) -> int | None:
    """The topic's partition count on the broker; ``None`` while it does not exist."""
    meta = admin().list_topics(timeout=10).topics.get(topic)
    return None if meta is None else len(meta.partitions)


def test_a_new_subscriber_emitting_to_a_new_topic_needs_no_manual_step(stack: None, unique: str) -> None:
    source, target = f"t.shipped.{unique}", f"t.echo.{unique}"
    assert UPSTREAM_PARTITIONS != topology.DEFAULT_PARTITIONS
    ensure_topics({source: UPSTREAM_PARTITIONS})  # the upstream exists; the subscriber's topics do not
    assert _partitions(target) is None and _partitions(f"{source}.dlq") is None
    publisher = Publisher("test")
    shipped = [DeliveryShipped(delivery_id=f"d-{unique}-{i}", package_id=f"p{i}", drone_id=f"drone-{i}",
                               shipped_at=datetime.now(UTC)) for i in range(20)]
    for event in shipped:
        publisher.publish(event, str(uuid.uuid4()), topic=source)
    publisher.flush(30)

    proc = ServiceProcess("tests.services.echo:service", env={"ECHO_SOURCE": source, "ECHO_TARGET": target},
                          instance=unique).start()
    try:
        wait_for(lambda: _partitions(target) is not None, timeout_s=30, what=f"{target} to be created")
        out = wait_for(lambda: len(r := read_topic(target)) >= 20 and r, timeout_s=60, what="20 outputs")
        assert proc.alive()
    finally:
        proc.stop()
    assert {r.key for r in out} == {e.delivery_id.encode() for e in shipped}
    assert len(out) == 20
    assert _partitions(target) == UPSTREAM_PARTITIONS
    assert _partitions(f"{source}.dlq") == UPSTREAM_PARTITIONS


def test_a_service_whose_broker_does_not_answer_says_so_soon_and_exits(unique: str) -> None:
    """Not a 30 s wait ending in a traceback: one line naming the broker, within the connect
    timeout, and an exit a supervisor (``choreo up``) restarts with back-off."""
    service = ServiceProcess("consumers.notifier:service", instance=f"nobroker-{unique}", env={
        "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "CHOREO_KAFKA_CONNECT_TIMEOUT_S": "2"}).start()
    assert service.proc is not None
    started = time.monotonic()
    assert service.proc.wait(60) == 1
    assert time.monotonic() - started < 20
    said = service.log_file.read_text(errors="replace")
    assert "error: Kafka at 127.0.0.1:1 did not answer within 2 s" in said
    assert "Traceback" not in said
