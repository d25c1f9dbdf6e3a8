"""Ingestion on the real stack: HTTP (uvicorn on a free port), the Python API and the CLI,
talking to the real Kafka, Redis and registry. Downstream services are not running, so
accepted deliveries stay in flight, which is what the admission tests need.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from confluent_kafka import Consumer, TopicPartition

from choreo.config import settings
from choreo.envelope import derived_id
from choreo.state import StateTable, StepStatus, delivery_key
from choreo.redis_client import connect
from producers.admission import inflight_keys
from producers.client import DeliveryClient
from producers.errors import AdmissionRefused, StoreUnavailable
from producers.http_server import MAX_HEAD_BYTES
from producers.model import InvalidRequest
from producers.settings import IngestionSettings
from producers.submit import Submission, Submitter, idempotency_redis_key, owner_redis_key
from tests.factories import request_body
from tests.helpers import REPO, index_members, wait_for
from tests.ingestion import TOPIC, end_offsets, ingestion_settings, records_since, serving, top_up_to_backlog

pytestmark = pytest.mark.integration


def in_flight(cfg: IngestionSettings) -> str:
    """The in-flight set's key (the admission keeps it hash-tagged)."""
    return inflight_keys(cfg.inflight_key)[0]


@pytest.fixture(scope="module", autouse=True)
def topics(stack: None) -> None:
    from choreo import topology
    from consumers.workflow import WORKFLOW

    topology.create(WORKFLOW)


@pytest.fixture(scope="module")
def base_url(stack: None) -> Iterator[str]:
    with serving(ingestion_settings("module")) as url:
        yield url


@pytest.fixture()
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=40) as client:
        yield client


# -- the happy path -------------------------------------------------------------------------


def test_post_answers_202_after_the_event_is_durable(http: httpx.Client, unique: str,
                                                     redis_client: redis.Redis) -> None:
    start = end_offsets()
    deadline = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    body = request_body(owner_id=f"owner-{unique}", deadline=deadline.isoformat(),
                        reply_topic=f"replies.acme.{unique}")
    response = http.post("/deliveries", json=body)

    assert response.status_code == 202, response.text
    delivery_id = response.json()["delivery_id"]
    assert response.json() == {"delivery_id": delivery_id, "status": "accepted"}
    assert response.headers["location"] == f"/deliveries/{delivery_id}"

    # answered only after the broker confirmed: the record is already committed
    found = [(k, e, h) for k, e, h in records_since(start) if k == delivery_id]
    assert len(found) == 1
    _, event, headers = found[0]
    assert event.owner_id == f"owner-{unique}" and event.pickup.address == body["pickup"]["address"]
    assert event.deadline == deadline and event.reply_topic == body["reply_topic"]
    assert headers["event_id"] == derived_id(delivery_id, TOPIC)
    assert headers["correlation_id"] == delivery_id
    assert headers["producer"] == "ingestion" and headers["event_type"] == "DeliveryRequested"
    assert headers["traceparent"].startswith("00-") and len(headers["traceparent"]) == 55
    assert int(headers["deadline_ms"]) == int(deadline.timestamp() * 1000)

    # both steps were opened before the event was produced; if the package and drone services
    # happen to run (other suites start them), they may already have moved on
    steps = StateTable(redis_client).steps(delivery_id)
    assert {"package", "drone"} <= set(steps)
    assert all(s.status in {v.value for v in StepStatus} for s in steps.values())

    status = http.get(f"/deliveries/{delivery_id}")
    assert status.status_code == 200
    answer = status.json()
    assert answer["delivery_id"] == delivery_id
    assert answer["status"] in {"accepted", "in_progress", "shipped", "failed"}
    assert {"package", "drone"} <= set(answer["steps"])
    assert all(s["status"] in {v.value for v in StepStatus} for s in answer["steps"].values())


def test_get_reflects_the_state_table(http: httpx.Client, redis_client: redis.Redis) -> None:
    delivery_id = http.post("/deliveries", json=request_body()).json()["delivery_id"]
    redis_client.hset(delivery_key(delivery_id), "outcome", "shipped")  # as the delivery service does
    assert http.get(f"/deliveries/{delivery_id}").json()["status"] == "shipped"


def test_get_unknown_or_malformed_id(http: httpx.Client) -> None:
    unknown = http.get("/deliveries/7b0a3c1e-1d2f-4f6a-9b3c-000000000000")
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"
    malformed = http.get("/deliveries/not-a-uuid")
    assert malformed.status_code == 422 and malformed.json()["error"] == "invalid_delivery_id"
    assert http.get("/nowhere").status_code == 404
    assert http.delete("/deliveries/7b0a3c1e-1d2f-4f6a-9b3c-000000000000").status_code == 405


def test_health_readiness_metrics(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["redis"] is True
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "ingestion_accepted_total" in metrics.text
    assert "/deliveries" in http.get("/openapi.json").json()["paths"]


# -- bad inputs: the right 4xx, nothing published ---------------------------------------------


def chunks(total: int, size: int = 4096) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


def test_bad_inputs_get_clear_4xx_and_publish_nothing(http: httpx.Client, unique: str) -> None:
    owner = f"bad-{unique}"
    good = request_body(owner_id=owner)
    hostile = "Hostile Road 13"
    json_type = {"content-type": "application/json"}

    def body(**overrides: Any) -> dict[str, Any]:
        return {**good, **overrides}

    def without(name: str) -> dict[str, Any]:
        return {k: v for k, v in good.items() if k != name}

    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    cases: list[tuple[str, int, dict[str, Any]]] = [
        ("missing field", 422, {"json": without("weight_kg")}),
        ("wrong type", 422, {"json": body(weight_kg="heavy")}),
        ("number as string", 422, {"json": body(pickup={"lat": "52.5", "lon": 13.4, "address": "a"})}),
        ("lat out of range", 422, {"json": body(pickup={"lat": 90.5, "lon": 13.4, "address": "a"})}),
        ("negative weight", 422, {"json": body(weight_kg=-2)}),
        ("absurd weight", 422, {"json": body(weight_kg=1e9)}),
        ("bad enum", 422, {"json": body(package_size="XXL")}),
        ("deadline in the past", 422, {"json": body(deadline=past)}),
        ("absurd deadline", 422, {"json": body(deadline="9999-12-31T23:59:59Z")}),
        ("bad reply topic", 422, {"json": body(reply_topic="no spaces allowed")}),
        ("loop reply topic", 422, {"json": body(reply_topic="delivery.requested")}),
        ("unknown field", 422, {"json": body(admin=True)}),
        ("not an object", 422, {"json": [good]}),
        ("very long address", 422, {"json": body(dropoff={"lat": 1, "lon": 1, "address": hostile * 50})}),
        ("control chars", 422, {"json": body(dropoff={"lat": 1, "lon": 1, "address": hostile + "\u0000\x07"})}),
        ("terminal escapes", 422, {"json": body(dropoff={"lat": 1, "lon": 1, "address": "\x1b]0;" + hostile})}),
        ("bidi override", 422, {"json": body(dropoff={"lat": 1, "lon": 1, "address": hostile + "\u202e"})}),
        ("NaN", 422, {"content": json.dumps(good).replace("1.5", "NaN"), "headers": json_type}),
        ("malformed JSON", 400, {"content": b'{"owner_id": "x",', "headers": json_type}),
        ("empty body", 400, {"content": b"", "headers": json_type}),
        ("invalid UTF-8", 400, {"content": b'{"owner_id": "\xff\xfe"}', "headers": json_type}),
        ("huge nesting", 400, {"content": b'{"owner_id": ' + b"[" * 20000 + b"]" * 20000 + b"}",
                               "headers": json_type}),
        ("wrong content type", 415, {"content": json.dumps(good), "headers": {"content-type": "text/plain"}}),
        ("form post", 415, {"data": {"owner_id": owner}}),
        ("no content type", 415, {"content": json.dumps(good), "headers": {"content-type": ""}}),
        ("latin-1 JSON", 415, {"content": json.dumps(good),
                               "headers": {"content-type": "application/json; charset=latin-1"}}),
        ("oversized body", 413, {"content": json.dumps(body(pad="x" * 70_000)), "headers": json_type}),
        ("oversized chunked body", 413, {"content": chunks(200_000), "headers": json_type}),
        ("bad idempotency key", 400, {"json": good, "headers": {"idempotency-key": "has spaces"}}),
        ("long idempotency key", 400, {"json": good, "headers": {"idempotency-key": "k" * 300}}),
    ]
    start = end_offsets()
    for name, status, kwargs in cases:
        response = http.post("/deliveries", **kwargs)
        assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
        answer = response.json()
        assert answer["error"] and answer["message"], name
        assert "Traceback" not in response.text and hostile not in response.text, name
        if status == 422 and "errors" in answer:
            assert all({"field", "message", "type"} <= set(e) for e in answer["errors"]), name
    invalid = http.post("/deliveries", json=body(weight_kg=-2, pickup={"lat": 99, "lon": 0, "address": "a"}))
    assert {e["field"] for e in invalid.json()["errors"]} == {"weight_kg", "pickup.lat"}

    assert not [e for _, e, _ in records_since(start) if e.owner_id == owner], "a bad request was published"


# -- idempotency --------------------------------------------------------------------------------


def raw_exchange(base_url: str, pieces: list[bytes]) -> tuple[bytes, bool]:
    """Send ``pieces`` (one write each) on a fresh connection; the response's bytes, and
    whether the server closed the connection after it."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):  # refused part-way: read the answer
            pass
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data, True
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        sock.settimeout(5)
        try:
            closed = sock.recv(1) == b""
        except (TimeoutError, ConnectionResetError):
            closed = False
        return head + b"\r\n\r\n" + body, closed


def test_an_oversized_request_head_is_refused_with_431_and_the_connection_closed(
        base_url: str, unique: str) -> None:
    start = end_offsets()
    body = json.dumps(request_body(owner_id=f"head-{unique}")).encode()
    line = b"POST /deliveries HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    big = b"X-Junk: " + b"a" * (MAX_HEAD_BYTES + 100) + b"\r\n"  # one header past the bound
    many = [b"X-Junk-%d: %s\r\n" % (i, b"b" * 1000) for i in range(40)]  # many, in many writes
    ending = b"Content-Length: %d\r\n\r\n" % len(body) + body
    for pieces in ([line + big + ending], [line, *many, ending]):
        response, closed = raw_exchange(base_url, pieces)
        assert response.startswith(b"HTTP/1.1 431 "), response[:200]
        assert b'"error": "headers_too_large"' in response and closed
    assert not [k for k, e, _ in records_since(start) if e.owner_id == f"head-{unique}"]


def test_a_head_under_the_bound_with_a_large_body_in_the_same_write_is_served(
        base_url: str, unique: str) -> None:
    """Only the head counts: a body just under its own limit, arriving with the head in one
    write, is no reason for a 431."""
    body = json.dumps(request_body(owner_id=f"big-{unique}")).encode() + b" " * 60_000
    request = (b"POST /deliveries HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    response, _ = raw_exchange(base_url, [request])
    assert response.startswith(b"HTTP/1.1 202 "), response[:300]


def test_idempotent_retry_returns_the_same_delivery_and_publishes_once(http: httpx.Client,
                                                                       unique: str) -> None:
    start = end_offsets()
    body = request_body(owner_id=f"idem-{unique}")
    key = {"idempotency-key": f"order-{unique}"}
    first = http.post("/deliveries", json=body, headers=key)
    # the same request, written differently (key order, spacing): still the same request
    second = http.post("/deliveries", content=json.dumps(body, indent=2, sort_keys=True),
                       headers={**key, "content-type": "application/json"})
    assert first.status_code == second.status_code == 202
    delivery_id = first.json()["delivery_id"]
    assert second.json()["delivery_id"] == delivery_id
    assert second.headers["location"] == first.headers["location"]
    assert second.headers.get("idempotent-replayed") == "true"

    conflict = http.post("/deliveries", json={**body, "weight_kg": 9}, headers=key)
    assert conflict.status_code == 422 and conflict.json()["error"] == "idempotency_key_reused"

    other_owner = http.post("/deliveries", json={**body, "owner_id": f"other-{unique}"}, headers=key)
    assert other_owner.status_code == 202 and other_owner.json()["delivery_id"] != delivery_id

    published = [k for k, _, _ in records_since(start) if k == delivery_id]
    assert published == [delivery_id]


def test_concurrent_retries_with_one_key_accept_one_delivery(base_url: str, unique: str) -> None:
    body = request_body(owner_id=f"race-{unique}")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=40) as client:
            return await asyncio.gather(*(
                client.post("/deliveries", json=body, headers={"idempotency-key": unique})
                for _ in range(10)))

    start = end_offsets()
    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {202, 409} and 202 in codes, codes
    ids = {r.json()["delivery_id"] for r in responses}
    assert len(ids) == 1  # a 409 names the delivery in progress too
    assert len([k for k, _, _ in records_since(start) if k in ids]) == 1


def test_concurrent_requests_share_group_commits_and_each_is_published_once(
        base_url: str, unique: str, http: httpx.Client, redis_client: redis.Redis) -> None:
    """Requests that arrive together are admitted and published together (one admission
    script and one state-table call per group: ``producers.group``), yet each caller gets
    its own delivery, published exactly once with its own fields, and its steps opened."""
    owner = f"group-{unique}"
    bodies = [request_body(owner_id=owner, weight_kg=round(0.5 + i / 100, 2)) for i in range(120)]

    def groups() -> tuple[float, float]:
        text = http.get("/metrics").text
        return (metric_value(text, "ingestion_group_commit_requests_count"),
                metric_value(text, "ingestion_group_commit_requests_sum"))

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=40,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(client.post("/deliveries", json=b) for b in bodies))

    start, (count_before, sum_before) = end_offsets(), groups()
    responses = asyncio.run(burst())
    count_after, sum_after = groups()
    assert [r.status_code for r in responses] == [202] * len(bodies)
    ids = [r.json()["delivery_id"] for r in responses]
    assert len(set(ids)) == len(ids)
    assert sum_after - sum_before == len(bodies)  # every request went through a group
    assert count_after - count_before < len(bodies)  # and some groups carried several
    published = [(k, e) for k, e, _ in records_since(start) if e.owner_id == owner]
    assert sorted(k for k, _ in published) == sorted(ids)  # each once
    by_id, table = dict(published), StateTable(redis_client)
    for delivery_id, body in zip(ids, bodies):  # each answer names its own request's delivery
        assert by_id[delivery_id].weight_kg == body["weight_kg"]
        assert {"package", "drone"} <= set(table.steps(delivery_id))


def metric_value(text: str, name: str) -> float:
    """A Prometheus sample without labels from an exposition text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# -- admission control --------------------------------------------------------------------------


def test_in_flight_cap_refuses_the_flood_with_429(unique: str, redis_client: redis.Redis) -> None:
    cap, flood = 20, 80
    # no trim tick during the flood: nothing can finish anyway (no downstream services)
    cfg = ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=cap, INGESTION_LAG_INTERVAL_S=3600)
    start = end_offsets()
    with serving(cfg, cleanup=False) as url:
        async def flood_it() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=40) as client:
                return await asyncio.gather(*(
                    client.post("/deliveries", json=request_body(owner_id=f"flood-{unique}"))
                    for _ in range(flood)))

        responses = asyncio.run(flood_it())
        accepted = [r.json()["delivery_id"] for r in responses if r.status_code == 202]
        refused = [r for r in responses if r.status_code == 429]
        assert len(accepted) == cap and len(refused) == flood - cap
        for r in refused:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"] == "overloaded" and r.json()["reason"] == "in_flight"
        assert redis_client.zcard(in_flight(cfg)) == cap

        # every accepted one is in the topic, and only those
        published = [k for k, e, _ in records_since(start) if e.owner_id == f"flood-{unique}"]
        assert sorted(published) == sorted(accepted)

        with httpx.Client(base_url=url, timeout=40) as client:
            assert client.post("/deliveries", json=request_body()).status_code == 429
    redis_client.delete(*inflight_keys(cfg.inflight_key))


def test_terminal_deliveries_free_their_places(unique: str, redis_client: redis.Redis) -> None:
    """The lazy trim reads the ``outcome`` the delivery service writes into the state hash.
    Synthetic deliveries (never published) so that running services cannot finish them."""
    cap = 20
    key = inflight_keys(f"test:inflight:{unique}")[0]
    ids = [str(uuid.uuid4()) for _ in range(cap)]
    now_ms = time.time() * 1000
    redis_client.zadd(key, {d: now_ms for d in ids})
    for d in ids:
        StateTable(redis_client).put(d, {"package.status": "pending"})
    for d in ids[:5]:
        redis_client.hset(delivery_key(d), "outcome", "shipped")
    cfg = ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=cap, INGESTION_LAG_INTERVAL_S=0.1)
    try:
        with serving(cfg) as url, httpx.Client(base_url=url, timeout=40) as client:
            wait_for(lambda: redis_client.zcard(key) <= cap - 5, 10, 0.1, "the trim")
            remaining = [str(redis_client.zscore(key, d) is not None) for d in ids]
            assert remaining == ["False"] * 5 + ["True"] * (cap - 5)
            codes = [client.post("/deliveries", json=request_body()).status_code for _ in range(8)]
            assert codes == [202] * 5 + [429] * 3
    finally:
        redis_client.delete(*(delivery_key(d) for d in ids))


def test_backlog_past_its_limit_refuses_with_429(unique: str) -> None:
    group = f"lagtest-{unique}"
    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers,
                         "group.id": group, "enable.auto.commit": False})

    def catch_up() -> None:  # the "consumer" is at the end of the topic: no backlog
        consumer.commit(offsets=[TopicPartition(TOPIC, p, o) for p, o in end_offsets().items()],
                        asynchronous=False)

    catch_up()
    limit = 5
    cfg = ingestion_settings(unique, INGESTION_MAX_BACKLOG=limit, INGESTION_LAG_GROUPS=group,
                             INGESTION_LAG_INTERVAL_S=0.1)
    try:
        with serving(cfg) as url, httpx.Client(base_url=url, timeout=40) as client:
            ready = client.get("/readyz").json()
            assert ready["groups"] == [group] and ready["checks"]["backlog_measured"]
            assert client.post("/deliveries", json=request_body()).status_code == 202
            # each accepted request adds to the group's lag; past the limit the door closes
            codes: list[int] = []
            refused = None
            deadline = time.monotonic() + 20
            while refused is None and time.monotonic() < deadline:
                response = client.post("/deliveries", json=request_body())
                codes.append(response.status_code)
                if response.status_code == 429:
                    refused = response
                time.sleep(0.02)
            assert refused is not None, codes
            assert refused.json()["reason"] == "backlog" and refused.json()["error"] == "overloaded"
            assert 1 <= int(refused.headers["retry-after"]) <= 30
            # the door may close early (a double count while a measurement runs), then takes
            # the places held back, up to the limit and never past it
            accepted = 1 + codes.count(202) + len(top_up_to_backlog(client, limit, request_body, 10))
            assert accepted <= limit, codes
            catch_up()
            wait_for(lambda: client.get("/readyz").json()["backlog"] < limit, 10, 0.1, "catch-up")
            assert client.post("/deliveries", json=request_body()).status_code == 202
    finally:
        consumer.close()


# -- the Python API -----------------------------------------------------------------------------


def test_python_client_submits_and_is_refused_past_the_cap(unique: str) -> None:
    start = end_offsets()
    cfg = ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=4, INGESTION_LAG_INTERVAL_S=3600)
    with DeliveryClient(cfg) as client:
        one = client.submit(request_body(owner_id=f"py-{unique}"))
        again = client.submit(request_body(owner_id=f"py-{unique}"), idempotency_key="k1")
        assert client.submit(request_body(owner_id=f"py-{unique}"), idempotency_key="k1") == again
        with pytest.raises(AdmissionRefused) as refused:
            client.submit_many([request_body(owner_id=f"py-{unique}") for _ in range(5)])
        assert refused.value.reason == "in_flight" and refused.value.retry_after_s >= 1
        assert len(refused.value.accepted) == 2  # 4 places: one, again, and two of the batch
    published = {k for k, e, _ in records_since(start) if e.owner_id == f"py-{unique}"}
    assert published == {one, again, *refused.value.accepted}
    connect(settings().redis_url).delete(*inflight_keys(cfg.inflight_key))


def test_a_batch_is_admitted_in_order_and_refused_past_the_cap(unique: str,
                                                                redis_client: redis.Redis) -> None:
    """``submit_batch``: one admission script and one state-table round trip for all, and
    still each request's own answer: an invalid one does not stop the others, places go in
    order, and what is refused leaves nothing (no event, no place, no pending step)."""
    start = end_offsets()
    owner = f"batch-{unique}"
    cfg = ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=5, INGESTION_LAG_INTERVAL_S=3600)
    bodies: list[Any] = [request_body(owner_id=owner) for _ in range(8)]
    bodies[2] = {**request_body(owner_id=owner), "weight_kg": -1}
    with DeliveryClient(cfg) as client:
        results = client.start_many(bodies)
        kinds = [type(r).__name__ for r in results]
        assert kinds == ["Submission"] * 2 + ["InvalidRequest"] + ["Submission"] * 3 + ["AdmissionRefused"] * 2
        refusal = results[6]
        assert isinstance(refusal, AdmissionRefused) and refusal.reason == "in_flight"
        accepted = [client.confirm(r) for r in results if isinstance(r, Submission)]
    assert redis_client.zcard(in_flight(cfg)) == 5
    assert set(m.decode() for m in redis_client.zrange(in_flight(cfg), 0, -1)) == set(accepted)
    published = [k for k, e, _ in records_since(start) if e.owner_id == owner]
    assert sorted(published) == sorted(accepted)
    table = StateTable(redis_client)
    for delivery_id in accepted:  # the steps the event triggers were opened before it was produced
        assert {s.status for s in table.steps(delivery_id).values()} == {StepStatus.PENDING}
    redis_client.delete(*inflight_keys(cfg.inflight_key))


def test_a_full_local_queue_refuses_the_rest_of_the_batch_and_leaves_nothing(
        unique: str, redis_client: redis.Redis) -> None:
    """Once the producer's local queue is full, no later request of the batch is produced
    (refusals stay the tail of a batch, so a caller resumes after the last one taken), and
    the refused ones keep no place and no pending step."""
    from consumers.workflow import WORKFLOW
    from choreo.publisher import Publisher

    start = end_offsets()
    steps_before = set(index_members(redis_client))
    owner = f"queue-{unique}"
    cfg = ingestion_settings(unique, INGESTION_LAG_INTERVAL_S=3600)
    # three records fit; a long linger keeps them queued while the batch is produced
    publisher = Publisher("ingestion", WORKFLOW, redis_client=redis_client,
                          producer_config={"queue.buffering.max.messages": 3, "linger.ms": 2000})
    submitter = Submitter(cfg, publisher=publisher).start()
    try:
        results = submitter.submit_batch([request_body(owner_id=owner) for _ in range(6)])
        assert [type(r).__name__ for r in results] == ["Submission"] * 3 + ["AdmissionRefused"] * 3
        refusal = results[3]
        assert isinstance(refusal, AdmissionRefused) and refusal.reason == "producer_queue"
        assert refusal.status == 503
        accepted = [submitter.wait(r).delivery_id for r in results if isinstance(r, Submission)]
        assert submitter.pending == 0
    finally:
        submitter.close()
    assert {m.decode() for m in redis_client.zrange(in_flight(cfg), 0, -1)} == set(accepted)
    published = [k for k, e, _ in records_since(start) if e.owner_id == owner]
    assert sorted(published) == sorted(accepted)
    # the steps opened for the batch and not withdrawn: package and drone, of the accepted only
    opened = {m.decode() for m in set(index_members(redis_client)) - steps_before}
    assert sorted(m.split("|")[0] for m in opened) == sorted(accepted * 2)
    redis_client.delete(*inflight_keys(cfg.inflight_key))


def test_submit_many_stops_at_an_invalid_request_and_says_what_it_accepted(unique: str) -> None:
    start = end_offsets()
    owner = f"many-{unique}"
    cfg = ingestion_settings(unique)
    bodies: list[Any] = [request_body(owner_id=owner) for _ in range(5)]
    bodies[3] = b'{"owner_id": '  # not even JSON
    with DeliveryClient(cfg) as client, pytest.raises(InvalidRequest) as invalid:
        client.submit_many(bodies)
    assert invalid.value.malformed and len(invalid.value.accepted) == 3
    published = [k for k, e, _ in records_since(start) if e.owner_id == owner]
    assert sorted(published) == sorted(invalid.value.accepted)  # the fifth was never sent
    connect(settings().redis_url).delete(*inflight_keys(cfg.inflight_key))


def test_a_batch_against_an_unreachable_store_refuses_every_request(unique: str) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    submitter = Submitter(ingestion_settings(unique), redis_client=dead)
    try:
        results = submitter.submit_batch([request_body(), request_body(), "[1, 2"])
        assert [type(r).__name__ for r in results] == ["StoreUnavailable"] * 2 + ["InvalidRequest"]
        assert submitter.pending == 0
    finally:
        submitter.close()


# -- the CLI ------------------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producers.cli", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=120, env={**os.environ, **env})


def test_cli_emit_file_skips_bad_lines_and_reports_them(tmp_path: Path, unique: str) -> None:
    owner = f"cli-{unique}"
    good = json.dumps(request_body(owner_id=owner))
    lines = [good, '{"owner_id": "broken', "", good,
             json.dumps(request_body(owner_id=owner, weight_kg=-1)), good]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    env = {"INGESTION_INFLIGHT_KEY": f"test:inflight:{unique}", "INGESTION_MAX_BACKLOG": "0"}
    start = end_offsets()

    strict = run_cli("emit", "--file", str(path), "--json", "--strict", env=env)
    assert strict.returncode == 1 and "Traceback" not in strict.stderr
    assert json.loads(strict.stdout.strip().splitlines()[-1])["accepted"] == 0

    result = run_cli("emit", "--file", str(path), "--json", "--verbose", env=env)
    assert result.returncode == 1, result.stderr  # some lines were rejected
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["accepted"] == 3 and summary["rejected"] == 2
    assert [e["line"] for e in summary["errors"]] == [2, 5]
    assert "malformed JSON" in summary["errors"][0]["error"]
    assert "weight_kg" in summary["errors"][1]["error"]
    # logs carry ids, never the customer's addresses
    assert "delivery accepted" in result.stderr
    assert request_body()["pickup"]["address"] not in result.stderr

    one = run_cli("emit", "--owner", owner, "--pickup", "52.52,13.40,Alexanderplatz 1",
                  "--dropoff", "52.50,13.37,Potsdamer Platz 2", "--size", "medium",
                  "--weight", "2.5", env=env)
    assert one.returncode == 0, one.stderr
    single_id = one.stdout.strip()

    bad_flags = run_cli("emit", "--owner", owner, "--pickup", "91,13.40,X", "--dropoff",
                        "52.50,13.37,Y", "--weight", "1", env=env)
    assert bad_flags.returncode == 1 and "pickup.lat" in bad_flags.stderr
    assert "Traceback" not in bad_flags.stderr

    published = [(k, e) for k, e, _ in records_since(start) if e.owner_id == owner]
    assert sorted(k for k, _ in published) == sorted([*summary["delivery_ids"], single_id])
    assert {e.package_size for k, e in published if k == single_id} == {"MEDIUM"}
    connect(settings().redis_url).delete(*inflight_keys(env["INGESTION_INFLIGHT_KEY"]))


def test_an_unreachable_state_store_is_a_503_not_a_500(unique: str) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    cfg = ingestion_settings(unique)
    submitter = Submitter(cfg, redis_client=dead)
    try:
        with serving(cfg, cleanup=False, submitter=submitter) as url, \
                httpx.Client(base_url=url, timeout=40) as client:
            response = client.post("/deliveries", json=request_body())
            assert response.status_code == 503 and response.json()["error"] == "publish_failed"
            # a generic answer: what failed inside (here Redis's ConnectionError) is logged only
            assert set(response.json()) == {"error", "message"}, response.text
            assert "Traceback" not in response.text and "Connection" not in response.text
            assert client.get("/readyz").status_code == 503
    finally:
        submitter.close()


def test_a_store_failure_while_admitting_leaves_no_claim_and_no_owner_record(
        unique: str, redis_client: redis.Redis) -> None:
    """Redis fails during admission (the script may even have run, its reply lost): the
    request is refused (503), and its idempotency claim and owner record are gone, so a
    retry with the same key is accepted at once rather than told to wait."""
    cfg = ingestion_settings(unique)
    submitter = Submitter(cfg).start()
    real_reserve, failures = submitter.admission.reserve, []

    def reserve_once_broken(delivery_ids: Any) -> Any:
        if not failures:
            failures.append(delivery_ids)
            real_reserve(delivery_ids)  # it ran; the reply is lost
            raise redis.ConnectionError("reply lost")
        return real_reserve(delivery_ids)

    submitter.admission.reserve = reserve_once_broken  # type: ignore[method-assign]
    body, key, owner = request_body(owner_id=f"owner-{unique}"), f"key-{unique}", f"owner-{unique}"
    try:
        with pytest.raises(StoreUnavailable):
            submitter.submit(body, key, owner=owner)
        [(refused_id, _)] = failures[0]
        assert not redis_client.exists(idempotency_redis_key(owner, key))  # its claim freed
        assert not redis_client.zscore(in_flight(cfg), refused_id)  # its place given back
        assert redis_client.get(owner_redis_key(refused_id)) is None  # no owner record
        accepted = submitter.wait(submitter.submit(body, key, owner=owner))
        # the key was free: not "in progress", a fresh start (a new delivery id)
        assert accepted.delivery_id != refused_id and not accepted.replayed
    finally:
        submitter.close()


def test_a_group_held_up_answers_504_with_the_delivery_to_look_up(unique: str) -> None:
    cfg = ingestion_settings(unique, INGESTION_PUBLISH_TIMEOUT_S=1)
    submitter = Submitter(cfg)
    real_commit = submitter._commit_group

    def slow_commit(items: Any) -> Any:
        time.sleep(2)  # Redis slow to answer, say
        return real_commit(items)

    submitter._commit_group = slow_commit  # type: ignore[method-assign]
    with serving(cfg, submitter=submitter.start()) as url, \
            httpx.Client(base_url=url, timeout=40) as client:
        response = client.post("/deliveries", json=request_body())
        assert response.status_code == 504 and response.json()["error"] == "confirmation_timeout"
        delivery_id = response.json()["delivery_id"]
        assert response.headers["location"] == f"/deliveries/{delivery_id}"
        # the group went on: the delivery was accepted after all, and is readable there
        wait_for(lambda: client.get(f"/deliveries/{delivery_id}").status_code == 200, 30, 0.2,
                 "the held-up delivery to be accepted")
    submitter.close()
