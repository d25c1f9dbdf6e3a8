"""Admission control against the running pipeline: a downstream service stops, the endpoint
is flooded, and the door closes on the real consumer lag; nothing it accepted is lost, and it
opens again once the service is back and has caught up."""

from __future__ import annotations

import hashlib
import signal
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from confluent_kafka import KafkaError

from choreo.config import settings
from choreo.redis_client import is_cluster
from producers.client import DeliveryClient
from producers.errors import AdmissionRefused, StoreUnavailable
from producers.model import parse_request
from producers.submit import Submitter, _Item, idempotency_redis_key, owner_redis_key
from tests.factories import request_body
from tests.helpers import ServiceProcess, wait_for
from tests.ingestion import end_offsets, ingestion_settings, records_since, serving, top_up_to_backlog
from tests.pipeline import Pipeline, terminal_counts, wait_terminal

pytestmark = pytest.mark.integration

PACKAGE = "consumers.package:service"
BACKLOG_LIMIT = 60
FLOOD = 600


def backlog(client: httpx.Client) -> int:
    return int(client.get("/readyz").json()["backlog"])


def runs(codes: list[int]) -> str:
    """Status codes in order, as runs: ``202×95 429×505``."""
    out: list[list[int]] = []
    for code in codes:
        if out and out[-1][0] == code:
            out[-1][1] += 1
        else:
            out.append([code, 1])
    return " ".join(f"{code}×{n}" for code, n in out)


def _measured(api: DeliveryClient) -> DeliveryClient:
    """The client once its backlog is measured. Until then its door refuses nothing (a stale
    measurement never does, by design): an HTTP client meets only an instance that reports
    ready, and a new client's first measurement can fail while a fresh broker's group
    coordinator is still loading (seen in a clean clone's first test)."""
    wait_for(api.submitter.admission.fresh, 30, 0.1, "the client's first backlog measurement")
    return api


def test_a_stopped_service_closes_the_door_and_nothing_accepted_is_lost(
        pipeline: Pipeline, unique: str) -> None:
    owner = f"flood-{unique}"
    cfg = ingestion_settings(unique, INGESTION_MAX_BACKLOG=BACKLOG_LIMIT, INGESTION_LAG_INTERVAL_S=0.2)
    start = end_offsets()
    with serving(cfg) as url, httpx.Client(base_url=url, timeout=40) as client:
        # the services have caught up with what earlier tests left in the topic (until then the
        # door is rightly shut), and one delivery goes all the way: every service is up
        wait_for(lambda: backlog(client) < BACKLOG_LIMIT // 4, 180, 0.5, "the services to catch up")
        opened = client.post("/deliveries", json=request_body(owner_id=owner))
        assert opened.status_code == 202, opened.text
        first = opened.json()["delivery_id"]
        wait_terminal({first}, timeout_s=120)
        package = next(p for p in pipeline.procs if p.ref == PACKAGE)
        # SIGTERM: it leaves its group, its offsets stay committed (-15: it was still starting)
        stopped = package.stop()
        assert stopped in (0, -signal.SIGTERM), f"the package service exited with {stopped}"

        accepted: list[str] = []
        codes: list[int] = []
        refusal: httpx.Response | None = None
        for _ in range(FLOOD):
            response = client.post("/deliveries", json=request_body(owner_id=owner))
            codes.append(response.status_code)
            if response.status_code == 202:
                accepted.append(response.json()["delivery_id"])
            else:
                refusal = refusal or response
        seen = f"{runs(codes)}; {client.get('/readyz').json()}"
        assert refusal is not None and refusal.status_code == 429, seen
        assert refusal.json()["error"] == "overloaded" and refusal.json()["reason"] == "backlog"
        assert 1 <= int(refusal.headers["retry-after"]) <= 30
        # the door closed at the limit, not a measurement later, and let no more in while
        # nothing drained. It counts a record published during a measurement twice (in the
        # measurement and since it), so it may close a few early, and open for as many once
        # the next measurement counts them once: whenever that measurement lands (a
        # measurement under load can outlast hundreds of refusals, and the flood may end
        # before it), the total stays within the limit
        assert 429 not in codes[:BACKLOG_LIMIT // 2], seen
        accepted += top_up_to_backlog(client, BACKLOG_LIMIT, lambda: request_body(owner_id=owner))
        assert BACKLOG_LIMIT // 2 <= len(accepted) <= BACKLOG_LIMIT, seen

        # the Python API meets the same door, with the same reason, once measured
        with DeliveryClient(cfg) as api, pytest.raises(AdmissionRefused) as refused:
            _measured(api).submit(request_body(owner_id=owner))
        assert refused.value.reason == "backlog" and refused.value.retry_after_s >= 1

        # a batch gets only the room left: one of 200 through a door twice as wide
        wider = ingestion_settings(unique, INGESTION_MAX_BACKLOG=2 * BACKLOG_LIMIT)
        with DeliveryClient(wider) as api, pytest.raises(AdmissionRefused) as refused:
            _measured(api).submit_many([request_body(owner_id=owner) for _ in range(200)])
        assert refused.value.reason == "backlog"
        batch = refused.value.accepted
        assert 1 <= len(batch) and len(accepted) + len(batch) <= 2 * BACKLOG_LIMIT, len(batch)
        accepted += batch

        # what the door refused was never published; what it accepted was, once each
        published = [key for key, event, _ in records_since(start) if event.owner_id == owner]
        assert sorted(published) == sorted([first, *accepted])

        pipeline.procs.append(ServiceProcess(PACKAGE, instance="restarted").start())
        counts = wait_terminal(set(accepted), timeout_s=180)
        assert sorted(counts) == sorted(accepted) and set(counts.values()) == {1}
        wait_for(lambda: backlog(client) < BACKLOG_LIMIT, 60, 0.2, "the backlog to drain")
        reopened = client.post("/deliveries", json=request_body(owner_id=owner))
        assert reopened.status_code == 202, reopened.text
    late = reopened.json()["delivery_id"]
    assert wait_terminal({late}, timeout_s=60)[late] == 1
    assert terminal_counts(set(accepted)) == counts  # and none of them ended a second time


def test_one_owner_cannot_take_the_whole_in_flight_cap(stack: None, unique: str) -> None:
    """One owner floods the door at once: it gets exactly its share of the cap, then 429
    ``owner_share``; another owner is still let in."""
    cap, share = 10, 0.5
    cfg = ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=cap, INGESTION_OWNER_SHARE=share)
    flooder, other = f"flood-{unique}", f"other-{unique}"
    with serving(cfg) as url, httpx.Client(base_url=url, timeout=40) as client:
        with ThreadPoolExecutor(16) as pool:
            flood = list(pool.map(lambda _: client.post("/deliveries", json=request_body(owner_id=flooder)),
                                  range(16)))
        codes = Counter(r.status_code for r in flood)
        assert codes == {202: int(cap * share), 429: 16 - int(cap * share)}, runs([r.status_code for r in flood])
        assert {r.json()["reason"] for r in flood if r.status_code == 429} == {"owner_share"}
        assert all(r.headers["Retry-After"] for r in flood if r.status_code == 429)
        others = [client.post("/deliveries", json=request_body(owner_id=other)) for _ in range(int(cap * share))]
        assert [r.status_code for r in others] == [202] * int(cap * share), [r.text for r in others]
        past_cap = client.post("/deliveries", json=request_body(owner_id=f"third-{unique}"))
        assert past_cap.status_code == 429 and past_cap.json()["reason"] == "in_flight"


def test_an_idempotency_claim_is_accepted_only_once_a_replica_holds_it(
        stack: None, unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``CHOREO_REDIS_WAIT_REPLICAS``, a request's idempotency claim and owner record
    are answered on only once a replica holds them: a failover that lost the claim would let
    a retry of the same key publish a second delivery. On the cluster lane every master has
    a replica and the request is accepted; a single node has none, and it is refused as a
    store failure (503), never accepted on a write only one node holds."""
    monkeypatch.setenv("CHOREO_REDIS_WAIT_REPLICAS", "1")
    monkeypatch.setenv("CHOREO_REDIS_WAIT_MS", "200")
    settings.cache_clear()
    submitter = Submitter(ingestion_settings(unique)).start()
    owner, key = f"owner-{unique}", f"key-{unique}"
    try:
        if is_cluster(submitter.redis):
            accepted = submitter.wait(submitter.submit(request_body(owner_id=owner), key, owner=owner))
            assert submitter.redis.get(owner_redis_key(accepted.delivery_id)) == owner.encode()
        else:
            for _ in range(2):  # a retry is refused the same way, not told "in progress"
                with pytest.raises(StoreUnavailable):
                    submitter.submit(request_body(owner_id=owner), key, owner=owner)
                assert not submitter.redis.exists(idempotency_redis_key(owner, key))  # not kept
    finally:
        submitter.close()
        settings.cache_clear()


def stale_claim(redis_client: redis.Redis, owner: str, key: str, body: dict[str, Any], delivery_id: str) -> str:
    """The claim an instance left when it crashed while publishing, a minute ago; its key."""
    rkey = idempotency_redis_key(owner, key)
    fingerprint = hashlib.sha256(parse_request(body).fingerprint().encode()).hexdigest()
    then = int(time.time() * 1000) - 60_000
    redis_client.hset(rkey, mapping={"d": delivery_id, "f": fingerprint, "r": then, "c": then, "ok": "0"})
    redis_client.expire(rkey, 600)
    redis_client.set(owner_redis_key(delivery_id), owner, ex=600)
    return rkey


def test_a_refused_take_over_keeps_the_claims_delivery_for_the_next_retry(stack: None, unique: str) -> None:
    """A request takes over the stale claim of an instance that crashed while publishing,
    and is then refused at the door. The crashed publish may have reached the broker, so the
    claim keeps its delivery id and owner record, and the next retry publishes that same
    delivery, never a second one for the same key."""
    owner, key, crashed = f"owner-{unique}", f"key-{unique}", f"crashed-{unique}"
    body = request_body(owner_id=owner)
    start = end_offsets()
    full = Submitter(ingestion_settings(unique, INGESTION_MAX_IN_FLIGHT=1)).start()
    try:
        rkey = stale_claim(full.redis, owner, key, body, crashed)
        full.wait(full.submit(request_body(owner_id=f"other-{unique}")))  # takes the only place
        with pytest.raises(AdmissionRefused):
            full.submit(body, key, owner=owner)
        assert full.redis.hget(rkey, "d") == crashed.encode()
        assert full.redis.get(owner_redis_key(crashed)) == owner.encode()
    finally:
        full.close()
    retry = Submitter(ingestion_settings(unique)).start()
    try:
        accepted = retry.wait(retry.submit(body, key, owner=owner))
        assert accepted.delivery_id == crashed and not accepted.replayed
        assert retry.redis.hget(rkey, "ok") == b"1"
    finally:
        retry.close()
    assert [event.delivery_id for _, event, _ in records_since(start)
            if event.owner_id == owner] == [crashed]  # one record for the key, of that delivery


def test_a_claim_whose_publish_was_reported_failed_keeps_its_delivery(stack: None, unique: str) -> None:
    """The broker's report of a failed publish (a timeout) does not prove the record was not
    written: the claim keeps its delivery id and owner record for the retry, taken over at
    once rather than after the publish timeout; a claim under which nothing was handed to the
    producer is freed."""
    owner = f"owner-{unique}"
    body = request_body(owner_id=owner)
    submitter = Submitter(ingestion_settings(unique)).start()
    try:
        reported = submitter._prepare(body, f"reported-{unique}", owner)
        refused = submitter._prepare(body, f"refused-{unique}", owner)
        assert isinstance(reported, _Item) and isinstance(refused, _Item)
        submitter._leave_nothing([refused])  # refused at the door: nothing was handed over
        assert not submitter.redis.exists(idempotency_redis_key(owner, f"refused-{unique}"))
        assert not submitter.redis.exists(owner_redis_key(refused.delivery_id))
        submitter._pending += 1  # as _publish counts it
        submitter._done(reported, "event", "trace", KafkaError(KafkaError._MSG_TIMED_OUT), Future(),
                        time.monotonic())
        rkey = idempotency_redis_key(owner, f"reported-{unique}")
        assert submitter.redis.hmget(rkey, "d", "c", "ok") == [reported.delivery_id.encode(), b"0", b"0"]
        assert submitter.redis.get(owner_redis_key(reported.delivery_id)) == owner.encode()
        retried = submitter.wait(submitter.submit(body, f"reported-{unique}", owner=owner))
        assert retried.delivery_id == reported.delivery_id and not retried.replayed
    finally:
        submitter.close()
