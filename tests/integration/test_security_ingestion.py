"""Owner tokens on the ingestion API, and no secrets or customer data in logs or dead letters.

The ingestion service runs as a real process (``producers.cli serve``, the way the stack
starts it) with ``INGESTION_TOKENS_FILE`` pointing at a 0600 file outside the repository and
debug logging on; its log file is then searched for every token and every customer field.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from choreo.config import settings
from choreo.envelope import Envelope
from choreo.kafka import ensure_topics
from choreo.serde import Encoder, registry_client
from infra.process import ManagedProcess, port_in_use
from infra.security import write_private
from infra.services import ingestion_process
from schemas.models import Location
from tests.factories import delivery_request, request_body
from tests.helpers import REPO, ServiceProcess, free_port, read_topic, wait_for

pytestmark = pytest.mark.integration

ALICE_TOKEN = "alice-" + uuid.uuid4().hex + uuid.uuid4().hex
BOB_TOKEN = "bob-" + uuid.uuid4().hex + uuid.uuid4().hex
ADDRESS = "Jane Customer, Secret Lane 7"


@dataclass
class Ingestion:
    url: str
    proc: ManagedProcess
    alice: str
    bob: str

    def log(self) -> str:
        return self.proc.log_file.read_text(errors="replace")


@pytest.fixture(scope="module")
def ingestion(stack: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ingestion]:
    from choreo import topology
    from consumers.workflow import WORKFLOW

    topology.create(WORKFLOW)
    data = tmp_path_factory.mktemp("ingestion-auth")
    unique = uuid.uuid4().hex[:8]
    alice, bob = f"alice-{unique}", f"bob-{unique}"
    tokens = data / "secrets" / "ingestion-tokens"
    write_private(tokens, f"# token=owner_id\n{ALICE_TOKEN}={alice}\n{BOB_TOKEN}={bob}\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cfg = settings().model_copy(update={"data_dir": data})
    proc = ingestion_process(url, cfg=cfg, env={
        "INGESTION_TOKENS_FILE": str(tokens), "INGESTION_MAX_BACKLOG": "0",
        "INGESTION_INFLIGHT_KEY": f"test:inflight:{unique}", "CHOREO_LOG_LEVEL": "DEBUG",
    })
    try:
        proc.start(60)
        yield Ingestion(url, proc, alice, bob)
    finally:
        proc.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def body_for(owner: str) -> dict[str, object]:
    return request_body(owner_id=owner, pickup={"lat": 52.5, "lon": 13.4, "address": ADDRESS})


def test_without_a_valid_token_every_delivery_call_is_401(ingestion: Ingestion) -> None:
    with httpx.Client(base_url=ingestion.url, timeout=30) as http:
        for headers in ({}, bearer("not-a-token-at-all-123456"), {"Authorization": f"Basic {ALICE_TOKEN}"},
                        {"Authorization": "Bearer"}):
            answer = http.post("/deliveries", json=body_for(ingestion.alice), headers=headers)
            assert answer.status_code == 401, answer.text
            assert answer.headers["www-authenticate"].startswith("Bearer")
            assert http.get(f"/deliveries/{uuid.uuid4()}", headers=headers).status_code == 401
        assert http.get("/healthz").status_code == 200  # probes stay open


def test_an_owner_submits_and_reads_only_its_own_deliveries(ingestion: Ingestion) -> None:
    with httpx.Client(base_url=ingestion.url, timeout=40) as http:
        mine = http.post("/deliveries", json=body_for(ingestion.alice), headers=bearer(ALICE_TOKEN))
        assert mine.status_code == 202, mine.text
        delivery_id = mine.json()["delivery_id"]
        assert http.get(f"/deliveries/{delivery_id}", headers=bearer(ALICE_TOKEN)).status_code == 200
        # another owner: exactly like an unknown delivery (no oracle for ids)
        theirs = http.get(f"/deliveries/{delivery_id}", headers=bearer(BOB_TOKEN))
        unknown = http.get(f"/deliveries/{uuid.uuid4()}", headers=bearer(BOB_TOKEN))
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"] == unknown.json()["error"]
        # a request on another owner's behalf is refused, and nothing is published
        forged = http.post("/deliveries", json=body_for(ingestion.alice), headers=bearer(BOB_TOKEN))
        assert forged.status_code == 403
        assert "delivery_id" not in forged.json()
        # idempotency keys are scoped by the authenticated owner as before
        key = {"Idempotency-Key": uuid.uuid4().hex}
        first = http.post("/deliveries", json=body_for(ingestion.bob), headers={**bearer(BOB_TOKEN), **key})
        again = http.post("/deliveries", json=body_for(ingestion.bob), headers={**bearer(BOB_TOKEN), **key})
        assert first.status_code == again.status_code == 202
        assert first.json()["delivery_id"] == again.json()["delivery_id"]


def test_tokens_and_customer_data_never_reach_the_logs(ingestion: Ingestion) -> None:
    with httpx.Client(base_url=ingestion.url, timeout=40) as http:
        http.post("/deliveries", json=body_for(ingestion.alice), headers=bearer(ALICE_TOKEN))
        http.post("/deliveries", json=body_for(ingestion.alice), headers=bearer(BOB_TOKEN))
        http.post("/deliveries", json=body_for(ingestion.alice), headers=bearer(ALICE_TOKEN + "x"))
        http.post("/deliveries", json={**body_for(ingestion.alice), "weight_kg": -1},
                  headers=bearer(ALICE_TOKEN))
    log = wait_for(lambda: (text := ingestion.log()) and "delivery accepted" in text and text,
                   30, 0.2, "the ingestion log")
    assert "request.unauthorized" in log and "request.forbidden" in log  # it did log the refusals
    for secret in (ALICE_TOKEN, BOB_TOKEN, ADDRESS, "Secret Lane", ingestion.alice, ingestion.bob):
        assert secret not in log, f"{secret[:6]}... leaked into the log"


def test_dead_letter_headers_and_service_logs_hold_no_customer_data(stack: None, tmp_path: Path) -> None:
    topic = f"t.sec.{uuid.uuid4().hex[:8]}"
    ensure_topics([topic, f"{topic}.dlq", f"retry.probe-{topic}.{topic}", "recovery"], partitions=1)
    owner = f"owner-{uuid.uuid4().hex[:8]}"
    secret_place = Location(lat=52.5, lon=13.4, address=ADDRESS)
    # valid Avro, invalid for the contract (negative weight): dead-lettered as INVALID_PAYLOAD
    invalid = delivery_request(owner_id=owner, pickup=secret_place, dropoff=secret_place).model_copy(
        update={"weight_kg": -5.0})
    rejected = delivery_request(owner_id=owner, pickup=secret_place, weight_kg=13)  # Rejected by the rule
    encoder = Encoder(type(invalid), topic, registry_client())
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    for event in (invalid, rejected):
        headers = Envelope.first(str(uuid.uuid4()), event.delivery_id, "DeliveryRequested", "test").to_headers()
        producer.produce(topic, key=event.delivery_id.encode(), value=encoder(event), headers=headers)
    producer.flush(10)
    service = ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic,
                                                               "CHOREO_LOG_LEVEL": "DEBUG"},
                             log_dir=tmp_path).start()
    try:
        letters = wait_for(lambda: len(r := read_topic(f"{topic}.dlq")) >= 2 and r, what="2 dead letters")
    finally:
        service.kill()
    reasons = {r.header("dlq.reason") for r in letters}
    assert reasons == {"INVALID_PAYLOAD", "REJECTED"}, reasons
    for record in letters:
        text = " ".join(f"{k}={v!r}" for k, v in record.headers)
        for secret in (ADDRESS, "Secret Lane", owner):
            assert secret not in text, f"{record.header('dlq.reason')} headers leak customer data"
    log = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
    assert "event.dead_lettered" in log
    assert ADDRESS not in log and owner not in log


def test_metrics_docs_and_readiness_figures_need_a_token(ingestion: Ingestion) -> None:
    with httpx.Client(base_url=ingestion.url, timeout=30) as http:
        for path in ("/metrics", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers=bearer("not-a-token-at-all-123456")).status_code == 401, path
            assert http.get(path, headers=bearer(ALICE_TOKEN)).status_code == 200, path
        # the probe still gets its answer, the figures only with a token
        bare = http.get("/readyz")
        assert bare.status_code == 200 and bare.json() == {"status": "ready"}
        full = http.get("/readyz", headers=bearer(ALICE_TOKEN)).json()
        assert full["status"] == "ready" and {"checks", "groups", "pending"} <= set(full)


def test_serve_refuses_a_public_address_without_tokens_unless_insecure(stack: None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGESTION_TOKENS")}
    port = free_port()
    argv = [sys.executable, "-m", "producers.cli", "serve", "--host", "0.0.0.0", "--port", str(port)]
    refused = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--insecure" in refused.stderr, refused.stderr
    assert not port_in_use("127.0.0.1", port)
    insecure = subprocess.Popen([*argv, "--insecure"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: port_in_use("127.0.0.1", port), 60, 0.2, "the --insecure server")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        insecure.terminate()
        _, stderr = insecure.communicate(timeout=40)
    assert "without owner tokens" in stderr
