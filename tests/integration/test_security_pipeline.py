"""The whole pipeline, end to end, on the secured stack: every process as its own principal.

``infra.security.up`` starts the SASL/SCRAM + ACL broker (SASL_SSL on 29092/29093), the ACL
Redis (TLS on 26379) and the registry with basic auth (HTTPS on 28081, itself running on that
broker as ``schema-registry``) in a private data dir, every server with the certificate of a
CA it made for the stack (``infra.tls``). The admin registers the contracts with the
documented command (``choreo schemas register`` with ``env/admin.env``); then every workflow
service and the ingestion API start as real processes, each with nothing but its own
principal's env file, the outcome webhooks too (``choreo.webhooks``, posting to a receiver in
this test). Deliveries are submitted over HTTPS with an owner token and read back as the admin
from the committed terminal topics. A service started with another service's
credentials must be refused by the broker's ACLs, so the setup cannot pass by being open.

The ports are fixed, so this takes the same locks as ``test_security_kafka.py`` (broker) and
``test_security_redis.py`` (Redis on 26379): concurrent runs take turns.
"""

from __future__ import annotations

import fcntl
import hmac
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import certifi
import httpx
import pytest
import redis
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from choreo.config import REPO_ROOT, settings
from choreo.dedupe import seen_key
from choreo.lease import lease_key
from choreo.state import delivery_key
from choreo.webhooks import H_ID, H_SIGNATURE, H_TIMESTAMP, sign
from consumers.workflow import WORKFLOW
from infra.process import ManagedProcess, port_in_use, stop_all
from infra.security import (
    ADMIN, SECURED_HOST, SECURED_KAFKA_PORT, SECURED_REDIS_PORT, SECURED_REGISTRY_PORT, Secrets,
    client_config, down, read_env_file, redis_url, registry_url, up,
)
from infra.services import PIPELINE, ServiceSpec, ingestion_process, service_process
from producers.submit import owner_redis_key
from registry.leader import lease_key as registry_lease_key
from tests.factories import request_body
from tests.helpers import wait_for
from tests.integration.test_security_kafka import produce

pytestmark = pytest.mark.integration

LOCKS = ("/tmp/choreo-kafka-secured.lock", "/tmp/choreo-redis-acl.lock")  # always in this order
PORTS = (SECURED_KAFKA_PORT, SECURED_KAFKA_PORT + 1, SECURED_REDIS_PORT, SECURED_REGISTRY_PORT)
DELIVERIES = 50
TERMINAL = ("delivery.shipped", "delivery.failed")
HOOKS = "webhooks"
# what the owner is told of a delivery that ended on a terminal topic: a failure with work to
# undo is compensating until its compensation ends (choreo.outcomes)
TOLD = {"delivery.shipped": {"shipped"}, "delivery.failed": {"failed", "compensating", "compensated"}}
OWNER_TOKEN = "owner-" + uuid.uuid4().hex + uuid.uuid4().hex
OTHER_TOKEN = "other-" + uuid.uuid4().hex + uuid.uuid4().hex
# some permanent failures so compensation (package.cancelled, drone.released) runs too
AGENTS = {"AGENT_WAREHOUSE_PERMANENT_RATE": "0.1", "AGENT_DISPATCH_PERMANENT_RATE": "0.1",
          "AGENT_WAREHOUSE_TRANSIENT_RATE": "0.05", "AGENT_DISPATCH_TRANSIENT_RATE": "0.05"}


@dataclass
class Hooks:
    """The owner's webhook receiver: every POST it got (id, outcome, signature valid)."""

    secret: bytes
    posts: list[tuple[str, str, str, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self) -> ThreadingHTTPServer:
        hooks = self

        class Receiver(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                valid = hmac.compare_digest(self.headers.get(H_SIGNATURE, ""),
                                            sign(hooks.secret, self.headers.get(H_TIMESTAMP, ""), body))
                told = json.loads(body)
                with hooks.lock:
                    hooks.posts.append((self.headers.get(H_ID, ""), told["delivery_id"], told["outcome"], valid))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def by_delivery(self) -> dict[str, list[tuple[str, str, bool]]]:
        with self.lock:
            found: dict[str, list[tuple[str, str, bool]]] = {}
            for event_id, delivery, outcome, valid in self.posts:
                found.setdefault(delivery, []).append((event_id, outcome, valid))
            return found


@dataclass
class SecuredPipeline:
    data: Path
    envs: dict[str, Path]
    ingestion_url: str
    owner: str
    other: str
    processes: dict[str, ManagedProcess]
    hooks: Hooks
    accepted: list[str] = field(default_factory=list)

    @property
    def secrets(self) -> Secrets:
        return Secrets(self.data / "secrets")

    def env(self, user: str) -> dict[str, str]:
        return read_env_file(self.envs[user])

    def admin_config(self, **extra: Any) -> dict[str, Any]:
        bootstrap = self.env(ADMIN)["KAFKA_BOOTSTRAP_SERVERS"]
        return {**client_config(ADMIN, bootstrap, self.secrets), "log_level": 0, **extra}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cli(env: dict[str, str], *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``choreo ARGS`` as a separate process with ``env`` on top of ours (a principal's env file)."""
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=timeout_s, env={**os.environ, **env})


def wait_for_groups(admin: AdminClient, groups: list[str], timeout_s: float) -> None:
    """Until every service's group is stable with partitions assigned (so the run measures
    the pipeline, not group joins); the admin describes them, services cannot."""
    deadline = time.monotonic() + timeout_s
    last = "nothing described yet"
    while time.monotonic() < deadline:
        try:
            described = {g: f.result(timeout=10) for g, f in
                         admin.describe_consumer_groups(groups, request_timeout=10).items()}
        except KafkaException as exc:
            last = str(exc)
            time.sleep(0.5)
            continue
        if all(str(d.state).endswith("STABLE") and d.members and
               all(m.assignment.topic_partitions for m in d.members) for d in described.values()):
            return
        last = ", ".join(f"{g}: {d.state} {len(d.members)} members" for g, d in described.items())
        time.sleep(0.5)
    raise AssertionError(f"groups not stable after {timeout_s:.0f}s: {last}")


def start_pipeline(data: Path, envs: dict[str, Path], hook_url: str,
                   hook_secret: bytes) -> tuple[dict[str, ManagedProcess], str]:
    """Every workflow service, the outcome webhooks and the ingestion API, each as its own
    principal; only the service's own env file (plus the failure injection, and the webhooks'
    endpoints) goes into its environment."""
    cfg = settings().model_copy(update={"data_dir": data})
    procs: dict[str, ManagedProcess] = {}
    for name, ref in PIPELINE.items():
        env = {**read_env_file(envs[name]), **AGENTS}
        procs[name] = service_process(ServiceSpec(name, ref), env=env, cfg=cfg)
    secret_file = data / "webhook-owner.secret"
    secret_file.write_bytes(hook_secret)
    secret_file.chmod(0o600)
    endpoints = data / "webhooks.json"
    endpoints.write_text(json.dumps({"owner-secured": {"url": hook_url, "secret_file": str(secret_file),
                                                       "internal": True}}))  # a loopback receiver
    procs[HOOKS] = service_process(ServiceSpec(HOOKS, "choreo.webhooks:service"), cfg=cfg, env={
        **read_env_file(envs[HOOKS]), "WEBHOOKS_FILE": str(endpoints)})
    url = f"https://127.0.0.1:{free_port()}"  # ingestion.env names its certificate
    tokens = json.dumps({OWNER_TOKEN: "owner-secured", OTHER_TOKEN: "other-secured"})
    procs["ingestion"] = ingestion_process(url, cfg=cfg, env={**read_env_file(envs["ingestion"]),
                                                               "INGESTION_TOKENS": tokens})
    return procs, url


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredPipeline]:
    with ExitStack() as held:
        for path in LOCKS:  # fixed ports: one secured stack at a time
            lock = held.enter_context(open(path, "w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        taken = [p for p in PORTS if port_in_use(SECURED_HOST, p)]
        assert not taken, f"ports {taken} are taken; is another secured stack running?"
        data = tmp_path_factory.mktemp("secured-pipeline")
        procs: dict[str, ManagedProcess] = {}
        hooks = Hooks(uuid.uuid4().hex.encode())
        receiver = hooks.serve()
        held.callback(receiver.shutdown)
        # this process is a client too: its HTTPS calls trust the stack's CA the usual way
        env = held.enter_context(pytest.MonkeyPatch.context())
        env.setenv("SSL_CERT_FILE", str(Secrets(data / "secrets").tls.ca_cert))
        try:
            envs = up(data, 120, partitions=2, heap="-Xms128m -Xmx512m")
            registered = cli(read_env_file(envs[ADMIN]), "schemas", "register")
            assert registered.returncode == 0, registered.stderr[-2000:]
            procs, url = start_pipeline(data, envs, f"http://127.0.0.1:{receiver.server_port}/hook",
                                        hooks.secret)
            for proc in procs.values():
                proc.start(timeout_s=90)
            found = SecuredPipeline(data, envs, url, "owner-secured", "other-secured", procs, hooks)
            wait_for_groups(AdminClient(found.admin_config()), [*PIPELINE, HOOKS], 120)
            yield found
        finally:
            stop_all(procs.values(), timeout_s=20)
            down(data)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def submit_all(p: SecuredPipeline, count: int) -> list[str]:
    """``count`` deliveries over HTTP as the owner (429/503 are retried, as a client would)."""
    run = uuid.uuid4().hex[:8]

    def submit(n: int) -> str:
        with httpx.Client(base_url=p.ingestion_url, timeout=60) as http:
            for _ in range(30):
                answer = http.post("/deliveries", json=request_body(owner_id=p.owner),
                                   headers={**bearer(OWNER_TOKEN), "Idempotency-Key": f"{run}-{n}"})
                if answer.status_code == 202:
                    return str(answer.json()["delivery_id"])
                assert answer.status_code in (429, 503), answer.text
                time.sleep(float(answer.headers.get("Retry-After", "1")))
        raise AssertionError(f"delivery {n} was never accepted")

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(submit, range(count)))


def terminal_events(p: SecuredPipeline) -> dict[str, list[str]]:
    """Delivery id -> terminal topics, read as the admin with read_committed up to the end."""
    consumer = Consumer(p.admin_config(**{"group.id": f"test-reader-{uuid.uuid4().hex[:8]}",
                                          "enable.auto.commit": False,
                                          "isolation.level": "read_committed"}))
    try:
        ends: dict[tuple[str, int], int] = {}
        for topic in TERMINAL:
            for part in consumer.list_topics(topic, timeout=20).topics[topic].partitions:
                ends[(topic, part)] = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=20)[1]
        consumer.assign([TopicPartition(t, n, 0) for (t, n) in ends])
        seen: dict[str, list[str]] = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            key = msg.key() if msg is not None and msg.error() is None else None
            if msg is not None and key is not None:
                seen.setdefault(key.decode(), []).append(str(msg.topic()))
            positions = consumer.position([TopicPartition(t, n) for (t, n) in ends])
            if all(tp.offset >= ends[(tp.topic, tp.partition)] or ends[(tp.topic, tp.partition)] == 0
                   for tp in positions):
                return seen
        raise AssertionError("could not read the terminal topics to their end")
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def finished(pipeline: SecuredPipeline) -> dict[str, list[str]]:
    """Submit the deliveries and wait until each has ended (then a little longer, so a
    duplicate end would have time to show up)."""
    pipeline.accepted = submit_all(pipeline, DELIVERIES)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        seen = terminal_events(pipeline)
        if all(d in seen for d in pipeline.accepted):
            break
        time.sleep(2)
    time.sleep(5)
    return terminal_events(pipeline)


def test_the_registry_runs_on_the_broker_as_its_own_principal_and_refuses_anonymous_calls(
        pipeline: SecuredPipeline) -> None:
    env = pipeline.env("schema-registry")
    assert env["KAFKA_SASL_USERNAME"] == "schema-registry"
    assert "@" not in env["SCHEMA_REGISTRY_URL"]  # it serves; it has no login of its own
    body = {"schema": json.dumps({"type": "record", "name": "Probe", "fields": []})}
    plain = registry_url(None, pipeline.secrets)
    assert httpx.post(f"{plain}/subjects/probe-value/versions", json=body).status_code == 401
    assert httpx.get(f"{plain}/subjects").status_code == 401  # reads need a login too
    assert httpx.get(f"{plain}/_health").status_code == 200  # probes stay open
    # the store is on the secured broker, written by User:schema-registry (the only one with ACLs on it)
    topics = AdminClient(pipeline.admin_config()).list_topics(timeout=20).topics
    assert "_schemas" in topics


def test_the_registry_and_ingestion_speak_https_only(pipeline: SecuredPipeline) -> None:
    """Both serve the stack's certificate: plain HTTP to their ports gets no answer, and a
    client that trusts only the public CAs refuses the certificate."""
    registry = registry_url(None, pipeline.secrets)
    assert registry.startswith("https://") and pipeline.ingestion_url.startswith("https://")
    for user in pipeline.envs:
        assert pipeline.env(user)["SSL_CERT_FILE"] == str(pipeline.secrets.tls.ca_cert)
        if user != "schema-registry":
            assert pipeline.env(user)["SCHEMA_REGISTRY_URL"].startswith("https://"), user
    public = ssl.create_default_context(cafile=certifi.where())
    for base in (registry, pipeline.ingestion_url):
        assert httpx.get(f"{base}/_health" if base == registry else f"{base}/healthz").status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(base.replace("https://", "http://", 1) + "/", timeout=10)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{base}/", verify=public, timeout=10)


def test_services_only_read_the_registry_and_the_admin_alone_changes_it(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    """Every service published with a read-only login (no auto-registration): the contracts
    came from the admin's ``choreo schemas register``; a service may not register, delete
    or change compatibility or mode (403), the admin may."""
    subject = "delivery.requested-value"
    for user in [s.name for s in WORKFLOW.services] + ["ingestion", "ops"]:
        env = pipeline.env(user)
        assert env["SCHEMA_REGISTRY_AUTO_REGISTER"] == "false"
        url = env["SCHEMA_REGISTRY_URL"]
        assert subject in httpx.get(f"{url}/subjects").json()
        latest = httpx.get(f"{url}/subjects/{subject}/versions/latest").json()
        for method, path, payload in (
                ("POST", f"/subjects/{subject}/versions", {"schema": latest["schema"]}),
                ("POST", "/subjects/probe-value/versions", {"schema": latest["schema"]}),
                ("DELETE", f"/subjects/{subject}", None),
                ("DELETE", f"/subjects/{subject}/versions/1", None),
                ("PUT", "/config", {"compatibility": "NONE"}),
                ("PUT", f"/config/{subject}", {"compatibility": "NONE"}),
                ("PUT", "/mode", {"mode": "READONLY"})):
            answer = httpx.request(method, f"{url}{path}", json=payload)
            assert answer.status_code == 403, (user, method, path, answer.text)
    admin = pipeline.env(ADMIN)["SCHEMA_REGISTRY_URL"]
    assert httpx.put(f"{admin}/config/probe-value", json={"compatibility": "FULL"}).status_code == 200
    assert httpx.delete(f"{admin}/config/probe-value").status_code == 200
    versions = httpx.get(f"{admin}/subjects/{subject}/versions").json()
    assert versions == [1]  # nothing a service tried was written


def test_every_delivery_ends_exactly_once(finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    assert len(pipeline.accepted) == len(set(pipeline.accepted)) == DELIVERIES
    missing = [d for d in pipeline.accepted if d not in finished]
    assert not missing, f"{len(missing)} deliveries never ended, e.g. {missing[:3]}"
    twice = {d: t for d, t in finished.items() if len(t) != 1}
    assert not twice, f"deliveries ending more than once: {twice}"
    assert set(finished) == set(pipeline.accepted)  # a fresh stack: nothing else ended
    outcomes = Counter(t[0] for t in finished.values())
    assert outcomes["delivery.shipped"] > 0, outcomes
    print(f"outcomes: {dict(outcomes)}")


def test_the_supervisor_releases_shipped_deliveries_under_its_acls(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    """``choreo.release`` reads every reader group's commits (its DESCRIBE on their groups)."""
    client = redis.Redis.from_url(redis_url(pipeline.secrets, "ops"))
    shipped = [d for d, ends in finished.items() if ends == ["delivery.shipped"]]
    wait_for(lambda: all(client.hexists(delivery_key(d), "done") for d in shipped), timeout_s=60,
             what="every shipped delivery released")
    # the workflow's dedupe entries went with the state; the webhooks, beside the workflow, may
    # note theirs after the release (their own, with the dedupe TTL)
    left = {field.decode().split(":", 1)[0] for d in shipped for field in client.hkeys(seen_key(d))}
    assert left <= {HOOKS}, left


def test_the_owner_follows_each_delivery_and_nobody_else_sees_it(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    with httpx.Client(base_url=pipeline.ingestion_url, timeout=30) as http:
        for delivery in pipeline.accepted:
            answer = http.get(f"/deliveries/{delivery}", headers=bearer(OWNER_TOKEN))
            assert answer.status_code == 200, answer.text
            assert answer.json()["status"] in TOLD[finished[delivery][0]], answer.json()
        one = pipeline.accepted[0]
        assert http.get(f"/deliveries/{one}", headers=bearer(OTHER_TOKEN)).status_code == 404
        assert http.get(f"/deliveries/{one}").status_code == 401
        forged = http.post("/deliveries", json=request_body(owner_id=pipeline.owner),
                           headers=bearer(OTHER_TOKEN))
        assert forged.status_code == 403


def test_each_service_consumed_and_committed_in_its_own_group_with_only_its_own_credentials(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    admin = AdminClient(pipeline.admin_config())
    passwords = {u: pipeline.secrets.password(u) for u in [*pipeline.envs]}
    for service in WORKFLOW.services:
        proc = pipeline.processes[service.name]
        pid = proc.pid()
        assert pid is not None, f"{service.name} is not running; see {proc.log_file}"
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        assert environ["KAFKA_SASL_USERNAME"] == service.name
        assert Path(environ["KAFKA_SASL_PASSWORD_FILE"]).read_text().strip() == passwords[service.name]
        leaked = [u for u, pw in passwords.items() if u != service.name and pw in "\0".join(environ.values())]
        assert not leaked, f"{service.name} holds the password of {leaked}"
        described = admin.describe_consumer_groups([service.name])[service.name].result(timeout=20)
        assert described.members, f"group {service.name} has no members"
        # offsets are committed only inside the service's transaction (send_offsets_to_transaction),
        # which the broker allows only to a principal with READ on this group
        offsets = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(service.name)])[service.name].result(timeout=20)
        committed = sum(tp.offset for tp in offsets.topic_partitions if tp.offset > 0)
        assert committed > 0, f"{service.name} committed nothing"


def test_a_service_started_with_another_services_credentials_is_refused(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    impostor = cli({**pipeline.env("package"), "CHOREO_LOG_LEVEL": "DEBUG"},
                   "run", "consumers.notifier:service", "--instance", "impostor", timeout_s=120)
    assert impostor.returncode != 0
    output = impostor.stdout + impostor.stderr
    assert "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in output or "Transactional Id authorization failed" in output, \
        output[-2000:]
    # the real notifier is untouched by the attempt
    assert pipeline.processes["notifier"].running()


def test_the_webhooks_tell_the_owner_each_outcome_once_as_their_own_least_principal(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    """The webhooks run as ``webhooks`` with that principal's env file only; each delivery the
    owner submitted is POSTed once (one id), signed, with the outcome its events decided; the
    principal may read what tells an outcome and write nothing else but its dead letters."""
    shipped = {d for d, ends in finished.items() if ends == ["delivery.shipped"]}
    posted = wait_for(lambda: shipped <= set(p := pipeline.hooks.by_delivery()) and p, timeout_s=90,
                      what="a webhook for every shipped delivery")
    assert set(posted) <= set(pipeline.accepted)
    for delivery, posts in posted.items():
        assert len({event_id for event_id, _, _ in posts}) == 1, posts  # one outcome: receivers dedupe by id
        assert all(valid for _, _, valid in posts)
        assert {outcome for _, outcome, _ in posts} <= TOLD[finished[delivery][0]]
    pid = pipeline.processes[HOOKS].pid()
    assert pid is not None, f"the webhooks are not running; see {pipeline.processes[HOOKS].log_file}"
    environ = dict(item.split("=", 1) for item in
                   Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
    assert environ["KAFKA_SASL_USERNAME"] == HOOKS
    config = client_config(HOOKS, pipeline.env(HOOKS)["KAFKA_BOOTSTRAP_SERVERS"], pipeline.secrets)
    for topic in ("delivery.shipped", "delivery.requested", "replies.acme"):
        err = produce({**config, "log_level": 0}, topic, timeout_s=10)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, topic
    url = pipeline.env(HOOKS)["REDIS_URL"]
    assert url.startswith(f"rediss://{HOOKS}:"), url
    one = pipeline.accepted[0]
    for key in (owner_redis_key(one), f"pkg:{{{one}}}", lease_key("supervisor")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url).set(key, "x")


def test_each_process_is_its_own_redis_user_limited_to_its_keys(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    """The pipeline ran with one Redis user per principal; none reaches another's keys."""
    for service in WORKFLOW.services:
        url = pipeline.env(service.name)["REDIS_URL"]
        assert url.startswith(f"rediss://{service.name}:"), url  # TLS
    assert "@" not in pipeline.env(ADMIN)["REDIS_URL"]  # the Kafka admin has no Redis login
    package = redis.Redis.from_url(pipeline.env("package")["REDIS_URL"])
    one = pipeline.accepted[0]
    for key in (lease_key("supervisor"), f"notified:{{{one}}}", owner_redis_key(one), registry_lease_key("_schemas")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            package.set(key, "x")
    ops = redis.Redis.from_url(redis_url(pipeline.secrets, "ops"))
    assert ops.get(owner_redis_key(one)) == pipeline.owner.encode()  # untouched


def test_redis_speaks_tls_only(pipeline: SecuredPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process reached Redis over TLS (``rediss://`` with the stack's CA in the URL); the
    port answers nothing else, and a client that does not trust that CA refuses the server."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # only what the URL says is trusted
    url = pipeline.env("package")["REDIS_URL"]
    assert url.endswith(f"?ssl_ca_certs={pipeline.secrets.tls.ca_cert}")
    plain = url.replace("rediss://", "redis://", 1).split("?")[0]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=5).ping()
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis.from_url(url.split("?")[0], socket_timeout=5).ping()
    assert redis.Redis.from_url(url, socket_timeout=5).ping()


def leaked_into_logs(data: Path, secrets: dict[str, str]) -> list[str]:
    """``<secret name> -> <log file>`` for every secret found in any log under ``data``
    (services, ingestion, registry, broker, Redis)."""
    logs = [path for path in data.rglob("*.log") if path.is_file()]
    assert any(path.name.startswith("package") for path in logs) and any(
        path.name == "ingestion.log" for path in logs)
    found = []
    for path in logs:
        text = path.read_text(errors="replace")
        found += [f"{name} -> {path.relative_to(data)}" for name, secret in secrets.items() if secret in text]
    return found


def secrets_of(data: Path, kind: str) -> dict[str, str]:
    return {f"{kind}/{path.stem}": path.read_text().strip()
            for path in (data / "secrets" / kind).glob("*.password")}


def test_no_log_holds_a_kafka_or_redis_password_or_a_token(
        finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    secrets = {**secrets_of(pipeline.data, "kafka"), **secrets_of(pipeline.data, "redis"),
               **secrets_of(pipeline.data, "registry-peer"),
               "owner token": OWNER_TOKEN, "other token": OTHER_TOKEN}
    # a Kafka password per principal, a Redis one per principal but the admin, the peer secret
    assert len(secrets) == 2 * len(pipeline.envs) - 1 + 1 + 2
    assert not leaked_into_logs(pipeline.data, secrets)


def test_no_command_line_holds_a_secret(finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    """What ``ps`` shows of every process on the machine while the secured stack runs
    (broker, Redis, registry, services, ingestion): no password, peer secret or token."""
    secrets = {**secrets_of(pipeline.data, "kafka"), **secrets_of(pipeline.data, "redis"),
               **secrets_of(pipeline.data, "registry"), **secrets_of(pipeline.data, "registry-peer"),
               "owner token": OWNER_TOKEN, "other token": OTHER_TOKEN}
    assert all(pipeline.processes[name].running() for name in pipeline.processes)
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        found += [f"{name} in pid {cmdline.parent.name}" for name, secret in secrets.items() if secret in text]
    assert not found, found


def test_no_log_holds_a_registry_login(finished: dict[str, list[str]], pipeline: SecuredPipeline) -> None:
    secrets = secrets_of(pipeline.data, "registry")
    assert len(secrets) == len(pipeline.envs) - 1  # everyone but the registry itself
    assert not leaked_into_logs(pipeline.data, secrets)
