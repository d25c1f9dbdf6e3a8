"""Bad input at scale, on the real stack: thousands of malformed inputs of a dozen kinds.

* Every pipeline topic gets garbage bytes, a wrong magic byte, an unknown schema id,
  truncated Avro, valid Avro of another schema, oversized records, tombstones, empty
  values, missing or undecodable headers, a time header no date holds, invalid payloads,
  good bodies under another delivery's envelope and a hop-limit storm; values too large to
  copy into a dead letter (over a megabyte as sent, and ten megabytes compressed in the
  batch); reports of no step. Each one
  must be dead-lettered by **every** service that consumes the topic, to ``<topic>.dlq``,
  with the expected ``dlq.reason`` and its source position (a letter without the value
  when the record is too large to copy).
* Failures that list one step ten thousand times are read, not dead-lettered.
* The HTTP endpoint gets a thousand broken requests; the registry a couple of hundred bad
  bodies: every one is refused with a clear 4xx and an error body, never a 5xx.
* Meanwhile good deliveries flow before, among and after the poison: every one ends
  (shipped) within its deadline, and no service process dies.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis
from confluent_kafka import Producer
from fastapi.testclient import TestClient

from choreo import contracts, topology
from choreo.config import settings
from choreo.envelope import Envelope, derived_id
from choreo.errors import DeadLetterReason as R
from choreo.events import Event
from choreo.runner import dlq_topic
from choreo.runtime_events import RUNTIME_EVENTS, StepReport
from choreo.serde import MAX_VALUE_BYTES, Encoder, registry_client
from choreo.state import StateTable, delivery_key
from consumers.drone_scheduler import fleet
from consumers.workflow import WORKFLOW
from producers.ingestion import create_app
from producers.settings import IngestionSettings
from schemas.models import (
    DeliveryFailed, DeliveryRequested, DeliveryShipped, DroneFailed, DroneReleased, DroneScheduled,
    PackageCancelled, PackageFailed, PackageReady,
)
from tests.factories import delivery_request, request_body
from tests.helpers import Record, read_topic, wait_for
from tests.pipeline import Pipeline, submit
from tests.raw_kafka import RawRecord, produce_raw

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODELS: dict[str, type[Event]] = {
    "delivery.requested": DeliveryRequested, "package.ready": PackageReady,
    "package.failed": PackageFailed, "drone.scheduled": DroneScheduled, "drone.failed": DroneFailed,
    "delivery.shipped": DeliveryShipped, "delivery.failed": DeliveryFailed,
    "package.cancelled": PackageCancelled, "drone.released": DroneReleased, "recovery": StepReport,
}
PER_KIND = 16  # records of each kind on each topic (oversized, huge: 2)
HUGE = {"huge", "huge_compressed"}  # too large to copy into a dead letter
NOW = datetime(2030, 1, 1, tzinfo=UTC)


def valid(topic: str, delivery_id: str) -> Event:
    """A valid event of the topic's type (only ever sent with a poisoned envelope)."""
    d = delivery_id
    return {
        "delivery.requested": lambda: delivery_request(d),
        "package.ready": lambda: PackageReady(delivery_id=d, package_id="p", package_size="SMALL",
                                              weight_kg=1.0, ready_at=NOW),
        "package.failed": lambda: PackageFailed(delivery_id=d, reason="X", failed_at=NOW),
        "drone.scheduled": lambda: DroneScheduled(delivery_id=d, drone_id="drone-00001", scheduled_at=NOW),
        "drone.failed": lambda: DroneFailed(delivery_id=d, reason="X", failed_at=NOW),
        "delivery.shipped": lambda: DeliveryShipped(delivery_id=d, package_id="p", drone_id="drone-00001",
                                                    shipped_at=NOW),
        "delivery.failed": lambda: DeliveryFailed(delivery_id=d, reason="X", failed_step="drone",
                                                  compensate=["package", "drone"], failed_at=NOW),
        "package.cancelled": lambda: PackageCancelled(delivery_id=d, cancelled_at=NOW),
        "drone.released": lambda: DroneReleased(delivery_id=d, released_at=NOW),
        "recovery": lambda: StepReport(delivery_id=d, step="drone", kind="FAILED", attempt=1,
                                       service="x", source_topic="delivery.requested",
                                       source_event_id="e", reported_at=NOW),
    }[topic]()


@dataclass(frozen=True)
class Poison:
    topic: str
    key: str
    kind: str
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]
    reasons: frozenset[str]  # the acceptable dlq.reason values


class Poisoner:
    def __init__(self, run: str) -> None:
        self.run = run
        self.rng = random.Random(run)
        self.encoders: dict[tuple[str, str], Encoder[Any]] = {}
        self.n = 0

    def encode(self, event: Event, topic: str) -> bytes:
        key = (type(event).__name__, topic)
        if key not in self.encoders:
            self.encoders[key] = Encoder(type(event), topic, registry_client())
        return self.encoders[key](event)

    def headers(self, key: str, hops: int = 0) -> list[tuple[str, str | bytes | None]]:
        env = Envelope.first(derived_id(key, "poison"), key, "Poison", "poison-test")
        return [(k, v if isinstance(v, bytes) else (v or "").encode())
                for k, v in replace(env, hops=hops).to_headers()]

    def make(self, topic: str, kind: str) -> Poison:
        self.n += 1
        key = f"poison-{self.run}-{self.n}"
        good = self.encode(valid(topic, key), topic)
        rng = self.rng
        hdr = self.headers(key)

        def one(v: bytes | None, *reasons: R, h: list[tuple[str, str | bytes | None]] = hdr) -> Poison:
            return Poison(topic, key, kind, v, h, frozenset(r.value for r in reasons))

        if kind == "garbage":
            return one(bytes([rng.randrange(1, 256)]) + rng.randbytes(rng.randrange(0, 300)), R.UNDECODABLE)
        if kind == "wrong_magic":
            return one(bytes([rng.randrange(1, 256)]) + good[1:], R.UNDECODABLE)
        if kind == "unknown_schema":
            return one(b"\x00" + rng.randrange(10**6, 2**31).to_bytes(4, "big") + good[5:], R.UNKNOWN_SCHEMA)
        if kind == "truncated":
            return one(good[: rng.randrange(6, max(7, len(good) - 2))], R.UNDECODABLE, R.INVALID_PAYLOAD)
        if kind == "wrong_schema":
            other = "drone.released" if topic != "drone.released" else "package.ready"
            return one(self.encode(valid(other, key), other), R.INCOMPATIBLE_SCHEMA)
        if kind == "oversized":
            return one(good[:5] + rng.randbytes(MAX_VALUE_BYTES + 1024), R.OVERSIZED)
        if kind == "huge":  # past the producer's 1,000,000 bytes a message, under the broker's batch
            return one(good[:5] + rng.randbytes(1_040_000), R.OVERSIZED)
        if kind == "huge_compressed":  # ten megabytes of zeros, a few kilobytes in the batch
            return one(good[:5] + bytes(10_000_000), R.OVERSIZED)
        if kind == "many_headers":  # a few bytes each, a megabyte on the wire: librdkafka reads none
            return one(b"\xff not avro", R.MISSING_HEADERS, h=[*hdr, *[("h", None)] * 340_000])
        if kind == "binary_header_name":  # a name no UTF-8 decoder reads (surrogate escapes: raw bytes)
            return one(good, R.MISSING_HEADERS, h=[*hdr, ("\udcff\udcfename", b"v")])
        if kind == "late_time":  # a production time no datetime holds (an outcome is dated by it)
            return one(good, R.MISSING_HEADERS,
                       h=[(k, b"9" * 17 if k == "produced_at_ms" else v) for k, v in hdr])
        if kind == "tombstone":
            return one(None, R.UNDECODABLE)
        if kind == "empty":
            return one(b"", R.UNDECODABLE)
        if kind == "no_headers":
            return one(good, R.MISSING_HEADERS, h=[])
        if kind == "bad_headers":  # an event id that is not UTF-8, an attempt that is not a number
            return one(good, R.MISSING_HEADERS,
                       h=[("event_id", b"\xff\xfe" + rng.randbytes(8)), ("correlation_id", key.encode()),
                          ("attempt", b"many")])
        if kind == "hop_storm":
            return one(good, R.HOP_LIMIT, h=self.headers(key, hops=rng.randrange(21, 10**6)))
        if kind == "other_delivery":  # a good body under another delivery's envelope
            return one(self.encode(valid(topic, f"{key}-other"), topic), R.INVALID_PAYLOAD)
        if kind == "no_step":  # a report naming a field of the delivery's state that is no step
            report = StepReport(delivery_id=key, step="outcome", kind="FAILED", attempt=1, service="x",
                                source_topic="delivery.requested", source_event_id="e", reported_at=NOW)
            return one(self.encode(report, topic), R.REJECTED)
        if kind == "invalid_payload":  # decodes with the right schema, fails the model's rules
            raw = json.loads(DeliveryRequested.avro_schema())
            assert raw["name"] == "DeliveryRequested"
            event = delivery_request(key).model_copy(update={"weight_kg": -5.0})
            return one(self.encode(event, topic), R.INVALID_PAYLOAD)
        raise AssertionError(kind)


KINDS = ["garbage", "wrong_magic", "unknown_schema", "truncated", "wrong_schema", "oversized", "huge",
         "huge_compressed", "many_headers", "binary_header_name", "tombstone", "empty", "no_headers", "bad_headers", "late_time", "hop_storm",
         "other_delivery"]


def floods(poisoner: Poisoner) -> list[Poison]:
    """Failures that list one step ten thousand times: more values than Lua unpacks, and more
    items than an event's list holds (``events.MAX_ITEMS``), written past the model's checks."""
    out = []
    for _ in range(PER_KIND):
        poisoner.n += 1
        key = f"poison-{poisoner.run}-{poisoner.n}"
        failure = DeliveryFailed.model_construct(delivery_id=key, reason="X", detail="", failed_step="drone",
                                                 compensate=["package"] * 10_000, failed_at=NOW)
        out.append(Poison("delivery.failed", key, "flood", poisoner.encode(failure, "delivery.failed"),
                          poisoner.headers(key), frozenset({R.INVALID_PAYLOAD})))
    return out


def consumers_of(topic: str) -> set[str]:
    return {s.name for s in WORKFLOW.services if topic in s.handlers}


@pytest.fixture(scope="module")
def pipeline(stack: None) -> Iterator[Pipeline]:
    topology.create(WORKFLOW)
    contracts.register(contracts.topic_models(WORKFLOW, RUNTIME_EVENTS))
    pipe = Pipeline().start()
    try:
        yield pipe
    finally:
        pipe.kill()


def poison_all(poisoner: Poisoner) -> list[Poison]:
    records: list[Poison] = []
    for topic in MODELS:
        for kind in KINDS:
            for _ in range(2 if kind == "oversized" or kind in HUGE or kind == "many_headers" else PER_KIND):
                records.append(poisoner.make(topic, kind))
        if topic == "delivery.requested":
            records += [poisoner.make(topic, "invalid_payload") for _ in range(PER_KIND)]
        if topic == "recovery":
            records += [poisoner.make(topic, "no_step") for _ in range(PER_KIND)]
        records += [poisoner.make(topic, "hop_storm") for _ in range(40)]  # the storm proper
    poisoner.rng.shuffle(records)
    return records


def produce(records: list[Poison]) -> None:
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "acks": "all",
                         "linger.ms": 5, "message.max.bytes": 20_000_000, "compression.type": "lz4"})
    failures: list[str] = []
    raw: list[RawRecord] = []
    for p in records:
        if not all(name.isascii() for name, _ in p.headers):  # past what the Python client writes
            raw.append((p.topic, p.key.encode(), p.value or b"", [
                (name.encode("utf-8", "surrogateescape"), v if isinstance(v, bytes) else (v or "").encode())
                for name, v in p.headers]))
            continue
        producer.produce(p.topic, key=p.key.encode(), value=p.value, headers=list(p.headers),
                         on_delivery=lambda err, _m: failures.append(str(err)) if err else None)
        producer.poll(0)
    assert producer.flush(60) == 0
    assert not failures, failures[:3]
    produce_raw(raw)


def dead_letters(run: str) -> dict[tuple[str, str], Record]:
    """(poison key, service) -> its dead letter, over every pipeline DLQ topic."""
    found: dict[tuple[str, str], Record] = {}
    prefix = f"poison-{run}-".encode()
    for topic in MODELS:
        for r in read_topic(dlq_topic(topic), timeout_s=30):
            if r.key is not None and r.key.startswith(prefix):
                found[(r.key.decode(), r.header("dlq.service") or "")] = r
    return found


def http_abuse(n_each: int) -> Counter[str]:
    """About a thousand broken requests of eleven kinds; every answer a clear 4xx."""
    cfg = IngestionSettings(INGESTION_INFLIGHT_KEY=f"test:inflight:{uuid.uuid4().hex[:8]}",
                            INGESTION_MAX_BACKLOG=0, INGESTION_TOKENS="")
    rng = random.Random(5)
    answers: Counter[str] = Counter()
    ok = {"content-type": "application/json"}
    kinds: list[tuple[str, int | tuple[int, ...], Any]] = [
        ("not_json", 400, lambda: dict(content=b"{" + rng.randbytes(20), headers=ok)),
        ("bad_utf8", 400, lambda: dict(content=b'{"owner_id": "\xff\xfe"}', headers=ok)),
        ("wrong_type", 415, lambda: dict(content=json.dumps(request_body()), headers={"content-type": "text/plain"})),
        ("too_large", 413, lambda: dict(content=b"[" + b"1," * 40_000 + b"1]", headers=ok)),
        ("invalid_field", 422, lambda: dict(content=json.dumps(request_body(weight_kg=-rng.random())), headers=ok)),
        ("unknown_field", 422, lambda: dict(content=json.dumps(request_body(admin=True)), headers=ok)),
        ("string_number", 422, lambda: dict(content=json.dumps(request_body(weight_kg="1.5")), headers=ok)),
        ("nan", (400, 422), lambda: dict(content=b'{"owner_id":"o","weight_kg":NaN}', headers=ok)),
        ("deep", (400, 422), lambda: dict(content=b"[" * 5000 + b"]" * 5000, headers=ok)),
        ("bad_key", 400, lambda: dict(content=json.dumps(request_body()),
                                      headers={**ok, "Idempotency-Key": "k" * 300})),
        ("hostile_text", 422, lambda: dict(content=json.dumps(request_body(
            pickup={"lat": 1, "lon": 1, "address": "a\u202eb\x00"})), headers=ok)),
    ]
    with TestClient(create_app(cfg), raise_server_exceptions=False) as client:
        for _ in range(n_each):
            for name, status, make in kinds:
                answer = client.post("/deliveries", **make())
                expected = status if isinstance(status, tuple) else (status,)
                assert answer.status_code in expected, (name, answer.status_code, answer.text[:200])
                body = answer.json()
                assert body["error"] and body["message"], (name, body)
                answers[name] += 1
            for path in ("/deliveries/not-a-uuid", f"/deliveries/{uuid.uuid4()}"):
                answer = client.get(path)
                assert answer.status_code in (404, 422) and answer.json()["error"], answer.text
                answers["bad_get"] += 1
    return answers


def registry_abuse(n_each: int) -> Counter[str]:
    ct = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
    subject = f"poison-{uuid.uuid4().hex[:8]}-value"
    bodies: list[tuple[str, bytes]] = [
        ("not_json", b"{nope"), ("array", b"[1,2]"), ("empty_object", b"{}"),
        ("empty_schema", json.dumps({"schema": ""}).encode()),
        ("number_schema", json.dumps({"schema": 42}).encode()),
        ("incomplete_record", json.dumps({"schema": '{"type": "record"}'}).encode()),
        ("unknown_type", json.dumps({"schema": '{"type":"recordz","name":"x"}'}).encode()),
        ("bad_schema_type", json.dumps({"schema": '"string"', "schemaType": "COBOL"}).encode()),
        ("missing_reference", json.dumps({"schema": '{"type":"record","name":"r","fields":'
                                                    '[{"name":"a","type":"no.such.Type"}]}'}).encode()),
    ]
    answers: Counter[str] = Counter()
    with httpx.Client(base_url=settings().schema_registry_url, timeout=30) as http:
        for _ in range(n_each):
            for name, body in bodies:
                for path in (f"/subjects/{subject}/versions", f"/compatibility/subjects/{subject}/versions/latest"):
                    answer = http.post(path, content=body, headers=ct)
                    assert 400 <= answer.status_code < 500, (name, path, answer.status_code, answer.text[:200])
                    payload = answer.json()
                    assert payload["error_code"] and isinstance(payload["message"], str), payload
                    answers[name] += 1
    return answers


def test_poison_at_scale(pipeline: Pipeline, redis_client: redis.Redis) -> None:
    run = uuid.uuid4().hex[:8]
    started = time.monotonic()
    good_before = submit([delivery_request() for _ in range(20)])
    poisoner = Poisoner(run)
    records = poison_all(poisoner) + floods(poisoner)
    for p in records:
        if p.kind == "no_step":  # the field it names is there: read as a step record, it stopped the supervisor
            StateTable(redis_client).put(p.key, {"outcome": "shipped"})
    half = len(records) // 2
    produce(records[:half])
    good_among = submit([delivery_request() for _ in range(20)])
    produce(records[half:])
    good_after = submit([delivery_request() for _ in range(20)])
    http_answers = http_abuse(90)
    registry_answers = registry_abuse(10)

    # every poison record, dead-lettered by every service that reads its topic, with its reason
    expected = {(p.key, s): p for p in records for s in consumers_of(p.topic)}
    found = wait_for(lambda: at_least(dead_letters(run), len(expected)),
                     timeout_s=90, interval_s=3, what=f"{len(expected)} dead letters")
    wrong: list[str] = []
    for (key, service), p in expected.items():
        letter = found.get((key, service))
        if letter is None:
            wrong.append(f"{p.kind} on {p.topic}: not dead-lettered by {service}")
            continue
        if letter.header("dlq.reason") not in p.reasons:
            wrong.append(f"{p.kind} on {p.topic} by {service}: reason {letter.header('dlq.reason')}, "
                         f"expected {sorted(p.reasons)} ({letter.header('dlq.error')})")
        if letter.header("dlq.source.topic") != p.topic or not letter.header("dlq.source.offset"):
            wrong.append(f"{p.kind} on {p.topic}: no source position in the dead letter")
        if p.kind in HUGE:
            if letter.value is not None or "not copied" not in (letter.header("dlq.error") or ""):
                wrong.append(f"{p.kind} on {p.topic}: a letter of a record too large to copy says nothing of it")
        elif letter.value != p.value:
            wrong.append(f"{p.kind} on {p.topic}: the dead letter does not keep the original bytes")
    assert not wrong, f"{len(wrong)} problems, e.g. {wrong[:8]}"
    assert len(found) == len(expected)  # nothing else of this run was dead-lettered
    # nor acted on: a request's body under another delivery's envelope booked no drone
    assert not [k for k in redis_client.hkeys(fleet.booking_key) if k.startswith(f"poison-{run}-".encode())]

    # the good deliveries around them: all shipped, each within its delivery deadline
    good = set(good_before + good_among + good_after)
    terminal = wait_for(lambda: at_least(_terminal(good), len(good)),
                        timeout_s=90, interval_s=2, what="good deliveries to end")
    requested = {r.key.decode(): r for r in read_topic("delivery.requested") if r.key and r.key.decode() in good}
    late = {d: round((rec.timestamp_ms - _ts(requested[d])) / 1000, 1)
            for d, rec in terminal.items() if rec.timestamp_ms - _ts(requested[d]) > 60_000}
    assert all(r.topic == "delivery.shipped" for r in terminal.values()), \
        Counter(r.topic for r in terminal.values())
    assert not late, f"good deliveries past the 60 s delivery deadline: {late}"
    assert pipeline.alive(), "a service process died"

    redis_client.delete(*(delivery_key(p.key) for p in records if p.kind == "no_step"))
    kinds = Counter(p.kind for p in records)
    print(json.dumps({"poison_records": len(records), "dead_letters": len(found), "kinds": kinds,
                      "http": sum(http_answers.values()), "registry": sum(registry_answers.values()),
                      "good": len(good), "seconds": round(time.monotonic() - started, 1)}))


def at_least(found: dict[Any, Any], n: int) -> dict[Any, Any] | None:
    return found if len(found) >= n else None


@dataclass
class _Timed:
    topic: str
    timestamp_ms: int


def _ts(record: Record) -> int:
    env = record.envelope
    return env.produced_at_ms if env is not None else 0


def _terminal(ids: set[str]) -> dict[str, _Timed]:
    found: dict[str, _Timed] = {}
    for topic in ("delivery.shipped", "delivery.failed"):
        for r in read_topic(topic):
            if r.key is not None and r.key.decode() in ids:
                env = r.envelope
                found.setdefault(r.key.decode(), _Timed(topic, env.produced_at_ms if env else 0))
    return found


def test_a_part_too_large_to_keep_fails_its_step_and_holds_nothing(pipeline: Pipeline) -> None:
    """Two halves of a fan-in, each under the size a consumer takes, whose decision would
    carry both, over that size: found only when it was published, the step would be completed
    and every reading of the batch would publish it again, the partition standing still. The
    join refuses to keep such a part (``join.MAX_PART_CHARS``), before any decision; an
    output too large is refused before its step completes
    (``test_runtime.py::test_poison_messages_are_dead_lettered_while_good_ones_flow``)."""
    run = uuid.uuid4().hex[:8]
    poisoner = Poisoner(run)
    delivery_id = f"poison-{run}-join"
    big = 524_200  # each half's value just under serde.MAX_VALUE_BYTES
    halves = [PackageReady(delivery_id=delivery_id, package_id="p" * big, package_size="SMALL", weight_kg=1.0,
                           ready_at=NOW),
              DroneScheduled(delivery_id=delivery_id, drone_id="d" * big, scheduled_at=NOW)]
    produce([Poison(h.topic, delivery_id, "big_half", poisoner.encode(h, h.topic),
                    [(k, v if isinstance(v, bytes) else (v or "").encode()) for k, v in Envelope.first(
                        str(uuid.uuid4()), delivery_id, type(h).__name__, "poison-test").to_headers()],
                    frozenset()) for h in halves])
    letters = wait_for(lambda: [r for (key, service), r in dead_letters(run).items()
                                if key == delivery_id and service == "delivery"],
                       timeout_s=90, interval_s=2, what="a half dead-lettered")
    assert [r.header("dlq.reason") for r in letters] == ["OVERSIZED"]
    assert "characters of JSON, over the 16384 a join keeps" in (letters[0].header("dlq.error") or "")
    after = submit([delivery_request() for _ in range(5)])
    ended = wait_for(lambda: at_least(_terminal(set(after)), len(after)), timeout_s=90, interval_s=2,
                     what="deliveries after it to end")
    assert {r.topic for r in ended.values()} == {"delivery.shipped"}
    assert pipeline.alive()
