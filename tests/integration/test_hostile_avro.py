"""Hostile writer schemas on the real stack: the registry refuses them, and a service that
meets one anyway (held by a registry without our checks, or registered under another
subject) dead-letters its records and goes on.

Each test runs a registry process of its own on a private store topic (the code under test,
started as the stack starts its own), so records can be put into that store directly, the
way a Confluent registry without these checks would have written them; the probe service
(``tests/services/probe.py``) is pointed at it.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import fastavro
import httpx
import pytest
from confluent_kafka import Producer

from choreo.config import settings
from choreo.envelope import Envelope
from choreo.ops.rebuild import Rebuilder
from choreo.redis_client import connect
from choreo.serde import Encoder, registry_client
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryRequested
from tests.factories import delivery_request
from tests.helpers import Record, ServiceProcess, free_port, read_topic, wait_for
from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)
from tests.integration.test_runtime import probe_topic, services  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

CT = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
V1 = DeliveryRequested.avro_schema()
NULLS = {"name": "x", "type": {"type": "array", "items": "null"}, "default": []}
DEAD_LETTER_WITHIN_S = 45.0  # the probe's start and group join included


def v2(*fields: dict[str, Any]) -> str:
    """The contract with ``fields`` added after its own: each has a default, so the v2 is
    BACKWARD-compatible with it."""
    schema = json.loads(V1)
    schema["fields"] += list(fields)
    return json.dumps(schema)


def varint(n: int) -> bytes:
    """An Avro long, which is how an array block declares its count."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    return out.getvalue()


class Probe:
    """The probe service on ``topic``, with its events encoded through the registry at ``url``."""

    def __init__(self, topic: str, url: str, running: list[ServiceProcess]) -> None:
        self.topic = topic
        self.url = url
        self.running = running
        self.encoder = Encoder(DeliveryRequested, topic, registry_client(url))
        self.producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})

    def produce(self, value: bytes, event_id: str | None = None, delivery_id: str | None = None) -> str:
        event_id = event_id or str(uuid.uuid4())
        headers = Envelope.first(event_id, delivery_id or f"d-{event_id}", "DeliveryRequested",
                                 "hostile-test").to_headers()
        self.producer.produce(self.topic, key=event_id.encode(), value=value, headers=headers)
        assert self.producer.flush(10) == 0
        return event_id

    def produce_good(self) -> str:
        """A valid request, its envelope naming the delivery its body does."""
        request = delivery_request(weight_kg=1.0)
        return self.produce(self.encoder(request), delivery_id=request.delivery_id)

    def foreign(self, subject: str, doc: str) -> tuple[int, bytes]:
        """The contract registered under ``subject`` only (a doc apart, so a schema id of its
        own), and a record of the topic's own schema: its bytes under the foreign id would
        decode as a perfectly good event."""
        own = self.encoder(delivery_request(weight_kg=1.0))
        elsewhere = json.loads(V1)
        elsewhere["doc"] = doc
        with httpx.Client(base_url=self.url, timeout=30) as http:
            foreign_id: int = http.post(f"/subjects/{subject}/versions", json={"schema": json.dumps(elsewhere)},
                                        headers=CT).json()["id"]
        return foreign_id, own

    def start(self) -> float:
        self.running.append(ServiceProcess("tests.services.probe:service",
                                           env={"PROBE_TOPIC": self.topic, "SCHEMA_REGISTRY_URL": self.url}).start())
        return time.monotonic()

    def dead_letter_then_output(self, poison: str, good: str, started: float) -> Record:
        """``poison``'s dead letter, once ``good`` (produced after it) is processed too."""
        letters: list[Record] = wait_for(lambda: read_topic(f"{self.topic}.dlq"),
                                         timeout_s=DEAD_LETTER_WITHIN_S, what="the dead letter")
        assert [r.key for r in letters] == [poison.encode()]
        print(json.dumps({"dead_letter_after_s": round(time.monotonic() - started, 1),
                          "reason": letters[0].header("dlq.reason"), "error": letters[0].header("dlq.error")}))
        out = wait_for(lambda: read_topic(f"{self.topic}.out"), timeout_s=30, what="the good event's output")
        assert [r.envelope.causation_id for r in out if r.envelope] == [good]
        assert self.running[-1].alive()
        return letters[0]


def test_the_registry_refuses_a_hostile_backward_compatible_v2(instances: Starter, unique: str) -> None:  # noqa: F811
    _, url = instances()
    subject = f"t.hostile.{unique}-value"
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post(f"/subjects/{subject}/versions", json={"schema": V1}, headers=CT).status_code == 200
        ordinary = v2({"name": "tags", "type": {"type": "array", "items": "string"}, "default": []})
        check = http.post(f"/compatibility/subjects/{subject}/versions/latest", json={"schema": ordinary}, headers=CT)
        assert check.json() == {"is_compatible": True}  # the same change, with items of a byte or more
        for path in (f"/subjects/{subject}/versions", f"/compatibility/subjects/{subject}/versions/latest"):
            answer = http.post(path, json={"schema": v2(NULLS)}, headers=CT)
            assert answer.status_code == 422, answer.text
            assert answer.json()["error_code"] == 42201
            assert "cannot be decoded in bounded work" in answer.json()["message"]
        assert http.get(f"/subjects/{subject}/versions").json() == [1]


def test_a_hostile_schema_held_by_an_unchecked_registry_is_dead_lettered_and_the_next_event_flows(
        instances: Starter, unique: str, probe_topic: str, services: list[ServiceProcess]) -> None:  # noqa: F811
    _, url = instances()
    probe = Probe(probe_topic, url, services)
    v1_bytes = probe.encoder(delivery_request(weight_kg=1.0))  # registers v1: version 1 of the subject
    subject = f"{probe_topic}-value"
    hostile_id = 1000  # the store is private: no other schema takes this id
    store = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all"})
    # a Confluent registry's record of a new version, the schema text in it
    store.produce(f"_schemas_test_{unique}",
                  key=json.dumps({"keytype": "SCHEMA", "subject": subject, "version": 2, "magic": 1}).encode(),
                  value=json.dumps({"subject": subject, "version": 2, "id": hostile_id, "schema": v2(NULLS),
                                    "deleted": False}).encode())
    assert store.flush(10) == 0
    with httpx.Client(base_url=url, timeout=30) as http:
        wait_for(lambda: http.get(f"/schemas/ids/{hostile_id}/subjects").json() == [subject],
                 timeout_s=30, what="the registry to read the hostile version")
    # the contract's own fields, then an array that declares 2^62 items of zero bytes each
    poison = probe.produce(b"\x00" + hostile_id.to_bytes(4, "big") + v1_bytes[5:] + varint(2**62))
    good = probe.produce_good()
    letter = probe.dead_letter_then_output(poison, good, probe.start())
    assert letter.header("dlq.reason") == "INCOMPATIBLE_SCHEMA"
    assert "cannot be decoded in bounded work" in (letter.header("dlq.error") or "")


def test_a_schema_id_of_another_subject_is_dead_lettered(
        instances: Starter, probe_topic: str, services: list[ServiceProcess]) -> None:  # noqa: F811
    _, url = instances()
    probe = Probe(probe_topic, url, services)
    foreign_id, v1_bytes = probe.foreign(f"{probe_topic}.elsewhere-value", "registered under another subject")
    poison = probe.produce(b"\x00" + foreign_id.to_bytes(4, "big") + v1_bytes[5:])
    good = probe.produce_good()
    letter = probe.dead_letter_then_output(poison, good, probe.start())
    assert letter.header("dlq.reason") == "INCOMPATIBLE_SCHEMA"
    assert letter.header("dlq.error") == f"schema id {foreign_id} is not registered under {probe_topic}-value"


@pytest.mark.parametrize("schema_id", [2**31, 2**32 - 1])
def test_a_schema_id_past_a_32_bit_integer_is_dead_lettered_and_the_next_event_flows(
        instances: Starter, probe_topic: str, services: list[ServiceProcess], schema_id: int) -> None:  # noqa: F811
    """Four bytes of 0xff where the schema id goes: the registry answers such a path id with
    a plain 404 (no such resource), not "schema not found". Taken for an unavailable
    registry, the record was retried for ever and its partition stood still."""
    _, url = instances()
    probe = Probe(probe_topic, url, services)
    v1_bytes = probe.encoder(delivery_request(weight_kg=1.0))
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get(f"/schemas/ids/{schema_id}").status_code == 404  # what the registry says of it
    poison = probe.produce(b"\x00" + schema_id.to_bytes(4, "big") + v1_bytes[5:])
    good = probe.produce_good()
    letter = probe.dead_letter_then_output(poison, good, probe.start())
    assert letter.header("dlq.reason") == "UNKNOWN_SCHEMA"
    assert letter.header("dlq.error") == f"schema id {schema_id} is no registry's"


@contextmanager
def denying(upstream: str, schema_id: int) -> Iterator[str]:
    """The registry at ``upstream`` seen through per-subject read permissions, as Confluent's
    RBAC gives them: ``schema_id`` is registered only under subjects this login may not
    read, so every lookup of it is a 403; all else is the registry's own answer."""
    denied = f"/schemas/ids/{schema_id}"

    class Front(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == denied or self.path.startswith((denied + "/", denied + "?")):
                self._answer(403, json.dumps({"error_code": 40301,
                                              "message": "User is denied operation Read on this schema"}).encode())
                return
            length = int(self.headers.get("Content-Length") or 0)
            with httpx.Client(base_url=upstream, timeout=30) as http:
                answer = http.request(self.command, self.path, content=self.rfile.read(length),
                                      headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            self._answer(answer.status_code, answer.content)

        do_POST = do_GET

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Front)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_schema_id_the_registry_denies_this_consumer_is_dead_lettered_and_the_next_event_flows(
        instances: Starter, probe_topic: str, services: list[ServiceProcess]) -> None:  # noqa: F811
    """A registry with per-subject read permissions answers 403 for an id registered only
    under a subject the consumer may not read. Taken for an unavailable registry, the record
    was read again for ever and its partition stood still; the consumer now reads its own
    subject's versions, finds the id is none of them, and dead-letters the record."""
    _, url = instances()
    probe = Probe(probe_topic, url, services)
    secret_id, v1_bytes = probe.foreign(f"{probe_topic}.secret-value",
                                        "registered under a subject the consumers may not read")
    with denying(url, secret_id) as front:
        with httpx.Client(base_url=front, timeout=30) as http:  # what the consumer's login is told
            assert http.get(f"/schemas/ids/{secret_id}/subjects").status_code == 403
            assert http.get(f"/subjects/{probe_topic}-value/versions").json() == [1]
        probe.url = front
        poison = probe.produce(b"\x00" + secret_id.to_bytes(4, "big") + v1_bytes[5:])
        good = probe.produce_good()
        letter = probe.dead_letter_then_output(poison, good, probe.start())
    assert letter.header("dlq.reason") == "INCOMPATIBLE_SCHEMA"
    assert letter.header("dlq.error") == f"schema id {secret_id} is not registered under {probe_topic}-value"


def test_a_schema_id_the_registry_denies_the_ops_login_stops_no_rebuild(
        instances: Starter, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """``rebuild-state`` decodes every body of the side topics (``recovery``,
    ``compensation.log``), which every service principal may write. A record there naming an
    id the ops login is denied, read as the registry unavailable, would stop the rebuild
    after its wait: it is refused, as the services refuse it, when the topic's subject does
    not hold the id, and the topic's own records still read."""
    _, url = instances()
    topic = f"t.side.{unique}"
    probe = Probe(topic, url, [])
    secret_id, own = probe.foreign(f"{topic}.secret-value", "registered under a subject the ops login may not read")
    with denying(url, secret_id) as front:
        monkeypatch.setenv("SCHEMA_REGISTRY_URL", front)
        settings.cache_clear()
        try:
            rebuilder = Rebuilder(WORKFLOW, connect(settings().redis_url), registry_wait_s=10.0)
            started = time.monotonic()
            shown = rebuilder.decode(topic, b"\x00" + secret_id.to_bytes(4, "big") + own[5:])
            assert shown == (f"<refused: schema id {secret_id} (or a schema it references) is denied and not "
                             f"registered under {topic}-value>")
            assert time.monotonic() - started < 5.0  # refused, not waited out
            body = rebuilder.decode(topic, own)
            assert isinstance(body, dict) and body["weight_kg"] == 1.0
        finally:
            monkeypatch.undo()
            settings.cache_clear()
