"""What a submitter sees of its delivery over HTTP, on the real stack: the server-sent event
stream of its steps ending with the outcome, bounded per client and in time, and the status
once the state expired from Redis, answered from Kafka; both only to the delivery's owner."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from choreo import topology
from choreo.config import settings
from choreo.publisher import Publisher
from choreo.state import delivery_key
from choreo.redis_client import connect
from consumers.workflow import WORKFLOW
from producers.submit import owner_redis_key
from tests.factories import request_body
from tests.helpers import wait_for
from tests.ingestion import ingestion_settings, serving
from tests.pipeline import Pipeline

pytestmark = pytest.mark.integration

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"


def events(client: httpx.Client, delivery_id: str, token: str | None = None, timeout_s: float = 90.0,
           into: list[tuple[str, dict[str, Any]]] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The whole stream, as (event, data) pairs (added to ``into`` as they come), until the
    server ends it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    found: list[tuple[str, dict[str, Any]]] = [] if into is None else into
    with client.stream("GET", f"/deliveries/{delivery_id}/events", headers=headers,
                       timeout=httpx.Timeout(timeout_s)) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                found.append((name, json.loads(line[len("data: "):])))
    return found


@pytest.fixture(scope="module")
def owners() -> dict[str, str]:
    unique = uuid.uuid4().hex[:8]
    return {ALICE: f"alice-{unique}", BOB: f"bob-{unique}"}


@pytest.fixture(scope="module")
def api(stack: None, owners: dict[str, str]) -> Iterator[httpx.Client]:
    topology.create(WORKFLOW)
    tokens = ",".join(f"{token}={owner}" for token, owner in owners.items())
    cfg = ingestion_settings(uuid.uuid4().hex[:10], INGESTION_TOKENS=tokens, INGESTION_SSE_POLL_S=0.1)
    running = Pipeline().start()
    try:
        with serving(cfg) as url, httpx.Client(base_url=url, timeout=30) as client:
            yield client
    finally:
        running.kill()


def submit(client: httpx.Client, owner: str, token: str, **fields: Any) -> str:
    answer = client.post("/deliveries", json=request_body(owner_id=owner, **fields),
                         headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 202, answer.text
    return str(answer.json()["delivery_id"])


def test_the_stream_shows_the_steps_in_order_and_ends_with_the_outcome(
        api: httpx.Client, owners: dict[str, str]) -> None:
    delivery_id = submit(api, owners[ALICE], ALICE)
    got = events(api, delivery_id, ALICE)
    names = [name for name, _ in got]
    assert names[-1] == "outcome" and got[-1][1]["outcome"] == "shipped"
    live = names.count("step")
    assert live and names[:-1] == ["step"] * live + ["history"] * (len(names) - 1 - live), names
    steps = [(d["step"], d["status"]) for name, d in got if name == "step"]
    done = [step for step, status in steps if status == "completed"]
    if "history" in names:  # released between two polls: the steps not seen live are told from Kafka
        told = [(d["topic"], d["producer"]) for name, d in got if name == "history"]
        assert told[0][0] == "delivery.requested" and ("delivery.shipped", "delivery") in told, told
        assert set(done) <= {"package", "drone"}, got
    else:
        assert set(done) == {"package", "drone", "delivery"}, got
        assert done.index("delivery") > max(done.index("package"), done.index("drone"))  # the fan-in last
    times = [d["updated_ms"] for name, d in got if name == "step"]
    assert times == sorted(times)
    # another owner's delivery streams like an unknown one; no token, no stream
    assert api.get(f"/deliveries/{delivery_id}/events", headers={"Authorization": f"Bearer {BOB}"}).status_code == 404
    assert api.get(f"/deliveries/{delivery_id}/events").status_code == 401


def test_status_after_the_state_expired_is_told_from_kafka_to_its_owner_only(
        api: httpx.Client, owners: dict[str, str]) -> None:
    client = connect(settings().redis_url)
    # no drone carries it: it fails, its ready package is cancelled, and it ends compensated
    delivery_id = submit(api, owners[ALICE], ALICE, weight_kg=99.0)
    alice = {"Authorization": f"Bearer {ALICE}"}
    live = events(api, delivery_id, ALICE)  # the live stream ends once, when the undo is confirmed
    assert [name for name, _ in live].count("outcome") == 1
    assert live[-1] == ("outcome", {"delivery_id": delivery_id, "outcome": "compensated"})
    assert ("package", "compensated") in [(d["step"], d["status"]) for name, d in live if name == "step"]
    assert api.get(f"/deliveries/{delivery_id}", headers=alice).json()["status"] == "compensated"
    client.delete(owner_redis_key(delivery_id))  # its owner record expired: the request tells whose
    assert api.get(f"/deliveries/{delivery_id}", headers=alice).json()["outcome"] == "compensated"
    assert api.get(f"/deliveries/{delivery_id}", headers={"Authorization": f"Bearer {BOB}"}).status_code == 404
    client.delete(delivery_key(delivery_id))  # and its state did (the join's retention)
    answer = api.get(f"/deliveries/{delivery_id}", headers=alice)
    assert answer.status_code == 200, answer.text
    told = answer.json()
    assert told["source"] == "kafka" and told["status"] == "compensated" and told["outcome"] == "compensated"
    topics = [hop["topic"] for hop in told["history"]]
    assert topics[0] == "delivery.requested" and "delivery.failed" in topics and "compensation.log" in topics
    assert "address" not in answer.text and "Alexanderplatz" not in answer.text  # no request body
    assert api.get(f"/deliveries/{delivery_id}", headers={"Authorization": f"Bearer {BOB}"}).status_code == 404
    assert api.get(f"/deliveries/{uuid.uuid4()}", headers=alice).status_code == 404
    # the stream of an expired delivery tells the story from Kafka and ends with the outcome
    got = events(api, delivery_id, ALICE)
    assert got[-1] == ("outcome", {"delivery_id": delivery_id, "outcome": "compensated", "source": "kafka"})
    assert [d["topic"] for name, d in got if name == "history"] == topics


def test_one_owner_looking_up_unknown_ids_leaves_another_owner_its_kafka_lookups(
        api: httpx.Client, owners: dict[str, str]) -> None:
    """Each id nobody submitted is a scan of the request topic's window: a caller looping
    over them from many connections holds at most its own lookup slot, not every slot."""
    client = connect(settings().redis_url)
    expired = [submit(api, owners[BOB], BOB) for _ in range(3)]
    for delivery_id in expired:
        assert events(api, delivery_id, BOB)[-1][1]["outcome"] == "shipped"
        client.delete(owner_redis_key(delivery_id), delivery_key(delivery_id))  # Kafka tells
    bob = {"Authorization": f"Bearer {BOB}"}
    alice = {"Authorization": f"Bearer {ALICE}"}
    answered: list[int] = []
    stop = threading.Event()

    def loop_over_unknown_ids() -> None:
        while not stop.is_set():
            answered.append(api.get(f"/deliveries/{uuid.uuid4()}", headers=alice).status_code)

    callers = [threading.Thread(target=loop_over_unknown_ids) for _ in range(8)]
    for caller in callers:
        caller.start()
    try:
        wait_for(lambda: 404 in answered and 503 in answered, timeout_s=30, interval_s=0.05,
                 what="Alice's lookups answered and refused")
        # the first lookup of each is a scan; a decided delivery's answer is remembered
        told = [api.get(f"/deliveries/{delivery_id}", headers=bob) for delivery_id in expired for _ in range(3)]
    finally:
        stop.set()
        for caller in callers:
            caller.join(30)
    assert [answer.status_code for answer in told] == [200] * 9, [answer.text for answer in told]
    assert {answer.json()["source"] for answer in told} == {"kafka"}
    assert set(answered) == {404, 503}


def test_streams_are_bounded_per_client_and_in_time(stack: None) -> None:
    cfg = ingestion_settings(uuid.uuid4().hex[:10], INGESTION_SSE_PER_CLIENT=1, INGESTION_SSE_MAX_S=3,
                             INGESTION_SSE_POLL_S=0.1)
    publisher = Publisher("test-ingestion", WORKFLOW)
    delivery_id = str(uuid.uuid4())
    publisher.open_steps([(delivery_id, "delivery.requested")])  # pending; no event: it never moves
    try:
        with serving(cfg) as url, httpx.Client(base_url=url, timeout=30) as client:
            first: list[tuple[str, dict[str, Any]]] = []
            started = time.monotonic()
            reader = threading.Thread(target=lambda: events(client, delivery_id, into=first))
            reader.start()
            wait_for(lambda: first, timeout_s=10, interval_s=0.05, what="the first stream's events")
            second = client.get(f"/deliveries/{delivery_id}/events")
            assert second.status_code == 429 and second.headers["retry-after"]
            # a client is its address, not what a header says it is
            forged = client.get(f"/deliveries/{delivery_id}/events", headers={"X-Forwarded-For": "198.51.100.7"})
            assert forged.status_code == 429
            reader.join(15)
            assert 2.5 < time.monotonic() - started < 10  # ended by its time limit
            assert first[-1][0] == "timeout" and {d["status"] for n, d in first if n == "step"} == {"pending"}
            again = events(client, delivery_id)  # the slot was given back
            assert again[-1][0] == "timeout"
    finally:
        publisher.abandon_steps([(delivery_id, "delivery.requested")])
