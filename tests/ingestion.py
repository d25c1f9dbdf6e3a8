"""The ingestion HTTP endpoint served in-process for tests, as ``choreo serve`` serves it, and
what it wrote to ``delivery.requested``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from confluent_kafka import Consumer, TopicPartition

from choreo.config import settings
from choreo.envelope import header_value
from choreo.kafka import headers_if_readable
from choreo.serde import Decoder, registry_client
from choreo.redis_client import connect
from producers.admission import inflight_keys
from producers.http_server import server_config
from producers.ingestion import create_app
from producers.settings import IngestionSettings
from producers.submit import Submitter
from schemas.models import DeliveryRequested
from tests.helpers import free_port, wait_for

TOPIC = DeliveryRequested.topic


def ingestion_settings(unique: str, **overrides: Any) -> IngestionSettings:
    """Isolated from other tests: its own in-flight set; backlog and the owners' shares of
    the in-flight cap off unless asked for (most tests submit as one owner)."""
    values: dict[str, Any] = {"INGESTION_INFLIGHT_KEY": f"test:inflight:{unique}",
                              "INGESTION_MAX_BACKLOG": 0, "INGESTION_OWNER_SHARE": 1}
    values.update(overrides)
    return IngestionSettings(**values)


@contextmanager
def serving(cfg: IngestionSettings, cleanup: bool = True,
            submitter: Submitter | None = None) -> Iterator[str]:
    """The app under uvicorn on a free port, in a thread, served as ``choreo serve`` serves it
    (``producers.http_server``); yields its base URL."""
    port = free_port()
    server = uvicorn.Server(server_config(create_app(cfg, submitter), "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, 0.05, "uvicorn to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        if cleanup:
            connect(settings().redis_url).delete(*inflight_keys(cfg.inflight_key))


def top_up_to_backlog(client: httpx.Client, limit: int, body: Callable[[], dict[str, Any]],
                      timeout_s: float = 30.0) -> list[str]:
    """Ask one request at a time until the backlog is measured at ``limit``; the delivery ids
    the door let in. The door counts a record confirmed while a lag measurement runs twice
    until the next one, so it may close early: this takes the places that held back."""
    accepted: list[str] = []

    def measured_at_limit() -> bool:
        if client.get("/readyz").json()["measured_backlog"] >= limit:
            return True
        response = client.post("/deliveries", json=body())
        if response.status_code == 202:
            accepted.append(response.json()["delivery_id"])
        return False

    wait_for(measured_at_limit, timeout_s, 0.15, "the places a double count held back taken")
    return accepted


def end_offsets() -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers,
                         "group.id": "ingestion-test-reader"})
    try:
        parts = consumer.list_topics(TOPIC, timeout=10).topics[TOPIC].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=10)[1]
                for p in parts}
    finally:
        consumer.close()


def records_since(start: dict[int, int]) -> list[tuple[str, DeliveryRequested, dict[str, str]]]:
    """(key, event, headers) of every committed record written after ``start``."""
    ends = end_offsets()
    decode = Decoder(DeliveryRequested, TOPIC, registry_client())
    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers,
                         "group.id": "ingestion-test-reader", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    wanted = {p: (start.get(p, 0), end) for p, end in ends.items() if end > start.get(p, 0)}
    out: list[tuple[str, DeliveryRequested, dict[str, str]]] = []
    try:
        consumer.assign([TopicPartition(TOPIC, p, s) for p, (s, _) in wanted.items()])
        done: set[int] = set()
        deadline = time.monotonic() + 30
        while len(done) < len(wanted) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            raw = headers_if_readable(msg) or []
            headers = {h[0]: header_value(raw, h[0]) or "" for h in raw}
            key = msg.key()
            out.append((bytes(key).decode() if key else "", decode(msg.value()), headers))
            partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
            if offset + 1 >= wanted[partition][1]:
                done.add(partition)
        assert len(done) == len(wanted), "could not read the topic to its end"
        return out
    finally:
        consumer.close()
