"""The real broker: plain and transactional round trips, read with read_committed."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from choreo.kafka import ensure_topics

pytestmark = pytest.mark.integration


def _drain(bootstrap: str, topic: str, expect: int, timeout_s: float = 20.0) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"drain-{topic}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    # keep polling a little past `expect` so an unexpected extra record is seen too
    quiet_until = None
    while time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is None:
            if len(values) >= expect:
                quiet_until = quiet_until or time.monotonic() + 1.0
                if time.monotonic() > quiet_until:
                    break
            continue
        assert msg.error() is None, msg.error()
        values.append(msg.value())
    consumer.close()
    return values


def test_plain_produce_consume(bootstrap: str, unique: str) -> None:
    topic = f"t.roundtrip.{unique}"
    ensure_topics([topic], partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for i in range(100):
        producer.produce(topic, key=b"k", value=f"v{i}".encode())
    assert producer.flush(10) == 0
    assert _drain(bootstrap, topic, 100) == [f"v{i}".encode() for i in range(100)]


def test_committed_transaction_visible_aborted_invisible(bootstrap: str, unique: str) -> None:
    topic = f"t.txn.{unique}"
    ensure_topics([topic], partitions=1)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"txn-{unique}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"committed")
    producer.commit_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"aborted")
    producer.flush(10)  # the aborted record really reaches the log before the abort
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"after")
    producer.commit_transaction(30)
    assert _drain(bootstrap, topic, 2) == [b"committed", b"after"]


def test_new_topics_are_served_when_ensure_topics_returns(bootstrap: str, unique: str) -> None:
    """Every partition answers a watermark query at once, with no retry: metadata that names
    a leader is not enough (a test once got NOT_LEADER_FOR_PARTITION right after creation)."""
    topics = [f"t.served.{unique}.{i}" for i in range(4)]
    ensure_topics(topics, partitions=6)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"served-{unique}"})
    try:
        for topic in topics:
            for partition in range(6):
                assert consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10) == (0, 0)
    finally:
        consumer.close()
