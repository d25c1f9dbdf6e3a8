"""Kafka with SASL/SCRAM and ACLs (KRaft StandardAuthorizer), on a private secured broker.

The broker is the project's own ``KafkaCluster`` in secured mode, on 29092 (SASL_SSL) and
29093 (controller, SASL_SSL too), with a data dir of this module's own and a CA and broker
certificate made by ``infra.tls``; the shared stack is not touched. Users and ACLs come from ``infra.security.derive_policy(WORKFLOW)``: what the
services declare, nothing kept by hand. Each test is a real client as one principal.
"""

from __future__ import annotations

import fcntl
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from choreo.config import settings
from consumers.workflow import WORKFLOW
from infra.kafka import FORMAT_ARGS, KafkaCluster, KafkaSecurity, KafkaTls, java_binary
from infra.process import port_in_use
from infra.security import ADMIN, OPS, Secrets, apply, client_config, derive_policy, secured_topics
from infra.tls import ensure_certificates

pytestmark = pytest.mark.integration

BASE_PORT = 29092  # below the ephemeral range (32768+): a connect probe can never self-connect


@dataclass
class Secured:
    cluster: KafkaCluster
    secrets: Secrets

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap_servers

    def config(self, user: str, **extra: Any) -> dict[str, Any]:
        return {**client_config(user, self.bootstrap, self.secrets), "log_level": 0, **extra}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    with open("/tmp/choreo-kafka-secured.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # fixed ports: one secured broker at a time
        taken = [p for p in (BASE_PORT, BASE_PORT + 1) if port_in_use("127.0.0.1", p)]
        assert not taken, f"ports {taken} are taken; is another secured broker running?"
        data = tmp_path_factory.mktemp("secured-kafka")
        secrets = Secrets(data / "secrets")
        tls = ensure_certificates(secrets.tls.root)
        cluster = KafkaCluster(data_dir=data, libs=settings().kafka_libs, base_port=BASE_PORT,
                               heap="-Xms128m -Xmx512m",
                               security=KafkaSecurity(admin_password=secrets.password(ADMIN),
                                                      tls=KafkaTls(tls.ca_cert, tls.keystore)))
        try:
            cluster.start(timeout_s=90)
            secured_topics(WORKFLOW, cluster.client_config(), partitions=2)
            apply(AdminClient(cluster.client_config()), derive_policy(WORKFLOW), secrets)
            yield Secured(cluster, secrets)
        finally:
            cluster.stop()


def produce(config: dict[str, Any], topic: str, value: bytes = b"x", timeout_s: float = 20) -> KafkaError | None:
    """One record; what the delivery report said (None: written)."""
    settings_: dict[str, Any] = {**config, "message.timeout.ms": int(timeout_s * 1000)}
    if not config.get("enable.idempotence"):
        settings_["retries"] = 0  # the broker's own answer, not a time-out after retries
    producer = Producer(settings_)
    reports: list[KafkaError | None] = []
    producer.produce(topic, key=b"k", value=value, on_delivery=lambda err, _m: reports.append(err))
    producer.flush(timeout_s + 5)
    assert len(reports) == 1
    return reports[0]


def first_error(consumer: Consumer, timeout_s: float = 20) -> KafkaError | None:
    """Poll until an error (not EOF) arrives, or None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        err = msg.error() if msg is not None else None
        if err is not None and err.code() != KafkaError._PARTITION_EOF:
            return err
    return None


def test_the_broker_runs_the_standard_authorizer_with_no_default_allow(secured: Secured) -> None:
    props = (secured.cluster.node_dir(0) / "server.properties").read_text()
    assert "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer" in props
    assert "allow.everyone.if.no.acl.found=false" in props
    assert "super.users=User:admin\n" in props
    # the file holds the admin's password: only this user may read it, and so the secrets
    assert (secured.cluster.node_dir(0) / "server.properties").stat().st_mode & 0o777 == 0o600
    assert secured.secrets.file("kafka", ADMIN).stat().st_mode & 0o777 == 0o600
    assert (secured.secrets.root / "kafka").stat().st_mode & 0o777 == 0o700


def client_errors(config: dict[str, Any], timeout_s: float = 15,
                  until: int | None = KafkaError._AUTHENTICATION) -> list[KafkaError]:
    """Errors a client reports while trying to connect, until one of code ``until`` (None:
    the first error) or ``timeout_s``; it never gets metadata meanwhile."""
    errors: list[KafkaError] = []
    settings_: dict[str, Any] = {**config, "error_cb": errors.append}
    client = AdminClient(settings_)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(until is None or e.code() == until for e in errors):
        with pytest.raises(KafkaException):  # never any metadata
            client.list_topics(timeout=1)
        client.poll(0.2)  # serves error_cb
    return errors


def test_unauthenticated_and_wrong_password_are_refused(secured: Secured) -> None:
    wrong = client_errors({**secured.config("package"), "sasl.password": "not-the-password"})
    assert any(e.code() == KafkaError._AUTHENTICATION for e in wrong), wrong
    unknown = client_errors({**secured.config("package"), "sasl.username": "mallory"})
    assert any(e.code() == KafkaError._AUTHENTICATION for e in unknown), unknown
    # no SASL at all: the listener speaks SASL only, so a plain client never gets metadata
    plain = AdminClient({"bootstrap.servers": secured.bootstrap, "log_level": 0})
    with pytest.raises(KafkaException):
        plain.list_topics(timeout=5)
    # the right password works (the same code path, so the refusals above are about secrets)
    assert "delivery.requested" in AdminClient(secured.config("package")).list_topics(timeout=10).topics


def test_the_broker_speaks_tls_only(secured: Secured, tmp_path: Path) -> None:
    """Every listener is SASL_SSL with the local CA's certificate: a client that speaks SASL
    without TLS, or TLS without trusting that CA, never gets metadata; the key is private."""
    props = (secured.cluster.node_dir(0) / "server.properties").read_text()
    assert "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SASL_SSL\n" in props
    assert "PLAINTEXT" not in props
    assert secured.secrets.tls.keystore.stat().st_mode & 0o777 == 0o600
    assert secured.secrets.tls.root.stat().st_mode & 0o777 == 0o700
    config = secured.config("package")
    assert config["security.protocol"] == "SASL_SSL"
    no_tls = client_errors({**config, "security.protocol": "SASL_PLAINTEXT"}, timeout_s=8, until=None)
    assert no_tls, "a SASL_PLAINTEXT client met no error"
    with pytest.raises(KafkaException):
        AdminClient({**config, "security.protocol": "SASL_PLAINTEXT"}).list_topics(timeout=5)
    # a CA of its own (not the broker's): the certificate does not verify
    stranger = ensure_certificates(tmp_path / "other-ca")
    untrusting = client_errors({**config, "ssl.ca.location": str(stranger.ca_cert)}, timeout_s=8,
                               until=KafkaError._SSL)
    assert any(e.code() == KafkaError._SSL for e in untrusting), untrusting
    with pytest.raises(KafkaException):
        AdminClient({**config, "ssl.ca.location": str(stranger.ca_cert)}).list_topics(timeout=5)
    # the system's CAs do not know the local one either
    system = {k: v for k, v in config.items() if k != "ssl.ca.location"}
    with pytest.raises(KafkaException):
        AdminClient(system).list_topics(timeout=5)
    # the same client with the stack's CA is served
    assert "delivery.requested" in AdminClient(config).list_topics(timeout=10).topics


def test_a_service_cannot_write_another_services_topic(secured: Secured) -> None:
    err = produce(secured.config("package"), "delivery.shipped")
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    err = produce(secured.config("notifier"), "delivery.failed")
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # ingestion writes requests, nothing downstream, no recovery report (it runs no step)
    for topic in ("package.ready", "recovery"):
        err = produce(secured.config("ingestion", **{"enable.idempotence": True, "acks": "all"}), topic)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, topic
    # nobody but the supervisor writes retry topics (they re-enter a step)
    err = produce(secured.config("package"), "retry.package.delivery.requested")
    assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_a_service_cannot_read_what_it_does_not_consume(secured: Secured) -> None:
    consumer = Consumer(secured.config("package", **{"group.id": "package", "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe(["delivery.shipped"])
        err = first_error(consumer)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, err
    finally:
        consumer.close()
    # its own input, but in another service's consumer group
    consumer = Consumer(secured.config("package", **{"group.id": "delivery", "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe(["delivery.requested"])
        err = first_error(consumer)
        assert err is not None and err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED, err
    finally:
        consumer.close()


def test_a_service_cannot_use_another_services_transactional_id(secured: Secured) -> None:
    producer = Producer(secured.config("package", **{"transactional.id": "delivery-0"}))
    with pytest.raises(KafkaException) as caught:
        producer.init_transactions(20)
    assert caught.value.args[0].code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED


def test_each_service_does_its_own_job_exactly_once(secured: Secured) -> None:
    """ingestion writes a request; package consumes it in its group and, in one transaction,
    produces package.ready, a dead letter and a recovery report and commits its offsets."""
    delivery = str(uuid.uuid4())
    assert produce(secured.config("ingestion", **{"enable.idempotence": True, "acks": "all"}),
                   "delivery.requested", delivery.encode()) is None

    consumer = Consumer(secured.config("package", **{
        "group.id": "package", "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "isolation.level": "read_committed"}))
    producer = Producer(secured.config("package", **{"transactional.id": "package-0"}))
    try:
        producer.init_transactions(30)
        consumer.subscribe(["delivery.requested", "retry.package.delivery.requested"])
        found = None
        deadline = time.monotonic() + 30
        while found is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            if msg.value() == delivery.encode():
                found = msg
        assert found is not None, "package could not read its input"
        producer.begin_transaction()
        producer.produce("package.ready", key=delivery.encode(), value=b"ready")
        producer.produce("delivery.requested.dlq", key=delivery.encode(), value=b"dead letter")
        producer.produce("recovery", key=delivery.encode(), value=b"report")
        position = (found.topic() or "", found.partition() or 0)
        producer.send_offsets_to_transaction(
            [TopicPartition(*position, (found.offset() or 0) + 1)],
            consumer.consumer_group_metadata(), 30)
        producer.commit_transaction(30)
        committed = consumer.committed([TopicPartition(*position)], timeout=10)
        assert committed[0].offset == (found.offset() or 0) + 1
    finally:
        consumer.close()

    # the next step (delivery) reads it, read_committed, in its own group
    reader = Consumer(secured.config("delivery", **{
        "group.id": "delivery", "auto.offset.reset": "earliest", "enable.auto.commit": False,
        "isolation.level": "read_committed"}))
    try:
        reader.subscribe(["package.ready"])
        deadline = time.monotonic() + 30
        seen = False
        while not seen and time.monotonic() < deadline:
            msg = reader.poll(0.5)
            if msg is not None and msg.error() is None and msg.key() == delivery.encode():
                seen = msg.value() == b"ready"
        assert seen, "delivery could not read package.ready"
    finally:
        reader.close()


def test_supervisor_requeues_ops_redrives_and_only_the_admin_changes_acls(secured: Secured) -> None:
    assert produce(secured.config("supervisor", **{"enable.idempotence": True}),
                   "retry.package.delivery.requested") is None
    assert produce(secured.config(OPS), "delivery.requested") is None  # dlq redrive
    consumer = Consumer(secured.config(OPS, **{"group.id": "choreo-ops-reader-test",
                                               "auto.offset.reset": "earliest",
                                               "enable.partition.eof": True}))
    try:
        consumer.assign([TopicPartition("delivery.requested.dlq", 0, 0)])
        msg = consumer.poll(10)
        assert msg is not None
        err = msg.error()
        assert err is None or err.code() == KafkaError._PARTITION_EOF
    finally:
        consumer.close()
    # the admin alone may change ACLs
    from confluent_kafka.admin import AclBindingFilter, AclOperation, AclPermissionType, ResourcePatternType, ResourceType  # type: ignore[attr-defined]

    everything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None,  # type: ignore[arg-type]
                                  AclOperation.ANY, AclPermissionType.ANY)
    supervisor_admin = AdminClient(secured.config("supervisor"))
    with pytest.raises(KafkaException) as caught:
        supervisor_admin.delete_acls([everything], request_timeout=10)[everything].result()
    assert caught.value.args[0].code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED


def test_acls_on_the_broker_are_exactly_the_derived_policy(secured: Secured) -> None:
    from confluent_kafka.admin import AclBindingFilter, AclOperation, AclPermissionType, ResourcePatternType, ResourceType  # type: ignore[attr-defined]

    everything = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None,  # type: ignore[arg-type]
                                  AclOperation.ANY, AclPermissionType.ANY)
    admin = AdminClient(secured.cluster.client_config())
    on_broker = admin.describe_acls(everything, request_timeout=10).result()
    def key(b: Any) -> tuple[str, ...]:
        return (b.principal, b.restype.name, b.name, b.resource_pattern_type.name, b.operation.name)

    got = {key(b) for b in on_broker}
    want = {key(b) for b in derive_policy(WORKFLOW).bindings()}
    assert got == want


def test_a_topic_nobody_declared_is_reachable_by_no_service(secured: Secured, tmp_path: Path) -> None:
    admin = AdminClient(secured.cluster.client_config())
    from confluent_kafka.admin import NewTopic  # type: ignore[attr-defined]

    name = f"undeclared.{uuid.uuid4().hex[:6]}"
    admin.create_topics([NewTopic(name, 1, -1)])[name].result(30)
    for user in ("package", "delivery", "supervisor", OPS):
        err = produce(secured.config(user), name, timeout_s=10)
        assert err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, user
    # and services cannot create topics of their own
    package_admin = AdminClient(secured.config("package"))
    with pytest.raises(KafkaException) as caught:
        package_admin.create_topics([NewTopic("rogue.topic", 1, -1)])["rogue.topic"].result(20)
    assert caught.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED


def test_formatting_a_secured_node_puts_no_password_on_a_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """StorageTool bootstraps the admin's SCRAM credential: its arguments go through a
    private ``java @file``, so ``ps`` never shows the password, and the file is gone after."""
    password = "format-secret-" + uuid.uuid4().hex
    cluster = KafkaCluster(data_dir=tmp_path, libs=settings().kafka_libs, base_port=BASE_PORT,
                           security=KafkaSecurity(admin_password=password))
    argvs: list[list[str]] = []
    real_popen = subprocess.Popen

    def recording(args: list[str], *rest: Any, **kwargs: Any) -> Any:
        argvs.append(list(args))
        return real_popen(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording)
    cluster._format_all(java_binary())
    assert argvs and not any(password in arg for argv in argvs for arg in argv), argvs
    node = cluster.node_dir(0)
    assert (node / "data" / "meta.properties").exists()  # formatted, with the credential
    assert not (node / FORMAT_ARGS).exists()
