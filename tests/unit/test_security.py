"""Pure logic of the security pieces: ACLs derived from the topology, token and password parsing."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from choreo.runner import dlq_topic
from choreo.topology import derive
from consumers.workflow import WORKFLOW
from infra.kafka import KafkaCluster, KafkaSecurity, KafkaTls
from infra.redis_server import acl_file_text
from registry.api import Endpoint
from registry.auth import BasicAuth, parse_users
from infra.security import OPS, Acl, Secrets, derive_policy
from producers.ingestion import OwnerTokens, parse_tokens

TOKEN = "t0ken-" + "a" * 30


def ops_of(user: str, resource: str = "topic") -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for acl in derive_policy(WORKFLOW).of(user):
        if acl.resource == resource:
            found.setdefault(acl.operation, set()).add(acl.name)
    return found


def test_each_service_reads_exactly_its_inputs_and_writes_its_outputs_dlqs_and_recovery() -> None:
    topo = derive(WORKFLOW)
    for service in WORKFLOW.services:
        topics = ops_of(service.name)
        reads = set(service.topics)
        if service.name == "supervisor":  # it also fetches step sources to requeue them
            reads |= {t for s in WORKFLOW.steps for t in s.triggers}
            reads |= {f"retry.{s.service}.{t}" for s in WORKFLOW.steps for t in s.triggers}
        assert topics["READ"] == reads, service.name
        writes = {t for t, producers in topo.producers.items() if service.name in producers}
        writes |= {dlq_topic(h.topic) for h in service.handlers.values()} | {"recovery"}
        if service.name in ("delivery", "supervisor"):  # they publish the deciding events
            writes |= {"replies."}  # prefixed: the outcome copies (choreo.outcomes)
        assert topics["WRITE"] == writes, service.name
        assert ops_of(service.name, "transactional_id") == {"WRITE": {f"{service.name}-"}}
        assert service.name in ops_of(service.name, "group")["READ"]


def test_no_service_may_write_another_services_output_or_read_foreign_groups() -> None:
    assert "delivery.shipped" not in ops_of("package").get("WRITE", set())
    assert ops_of("ingestion")["WRITE"] == {"delivery.requested"}
    assert "package" not in ops_of("delivery", "group")["READ"]
    for acl in derive_policy(WORKFLOW).acls:
        assert acl.user != "admin"  # the super user needs no ACLs
        assert acl.operation not in ("ALL", "ALTER", "DELETE")


def test_ops_reads_every_topic_of_the_topology() -> None:
    assert ops_of(OPS)["READ"] >= set(derive(WORKFLOW).partitions)


def test_acl_table_is_markdown_with_one_row_per_rule() -> None:
    policy = derive_policy(WORKFLOW)
    lines = policy.table().splitlines()
    assert len(lines) == len(set(policy.acls)) + 2
    assert "| User:package | WRITE | transactional_id | `package-*` |" in lines


def test_acl_binding_maps_kinds_and_patterns() -> None:
    binding: Any = Acl("package", "transactional_id", "package-", "WRITE", "prefixed").binding()
    assert binding.principal == "User:package" and binding.host == "*"
    assert binding.restype.name == "TRANSACTIONAL_ID"
    assert binding.resource_pattern_type.name == "PREFIXED"


def test_secrets_are_generated_private_and_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = Secrets(tmp_path / "secrets")
    first = secrets.password("drone-scheduler")
    assert secrets.password("drone-scheduler") == first and len(first) >= 32
    path = secrets.file("kafka", "drone-scheduler")
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "secrets").stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("CHOREO_KAFKA_PASSWORD_DRONE_SCHEDULER", "from-env")
    assert secrets.password("drone-scheduler") == "from-env"
    assert secrets.password_file("drone-scheduler").read_text() == "from-env"


def test_kafka_default_mode_is_unchanged_and_secured_mode_is_complete(tmp_path: Path) -> None:
    plain = KafkaCluster(data_dir=tmp_path, libs=tmp_path)._properties(0)
    assert "PLAINTEXT://127.0.0.1:9092" in plain and "authorizer" not in plain and "sasl" not in plain
    secured = KafkaCluster(data_dir=tmp_path, libs=tmp_path, base_port=29092,
                           security=KafkaSecurity(admin_password="p4ss"))._properties(0)
    for line in ("listeners=SASL_PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093",
                 "inter.broker.listener.name=SASL_PLAINTEXT",
                 "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                 "allow.everyone.if.no.acl.found=false", "super.users=User:admin",
                 "sasl.enabled.mechanisms=SCRAM-SHA-256"):
        assert line in secured.splitlines()
    with pytest.raises(ValueError):
        KafkaSecurity(admin_password='bad"quote')


def test_kafka_with_tls_puts_every_listener_on_sasl_ssl(tmp_path: Path) -> None:
    tls = KafkaTls(ca_file=tmp_path / "ca.pem", keystore_file=tmp_path / "server.keystore.pem")
    security = KafkaSecurity(admin_password="p4ss", tls=tls)
    props = KafkaCluster(data_dir=tmp_path, libs=tmp_path, base_port=29092,
                         security=security)._properties(0).splitlines()
    for line in ("listeners=SASL_SSL://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093",
                 "inter.broker.listener.name=SASL_SSL",
                 "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SASL_SSL",
                 "ssl.keystore.type=PEM", f"ssl.keystore.location={tls.keystore_file}",
                 "ssl.truststore.type=PEM", f"ssl.truststore.location={tls.ca_file}"):
        assert line in props
    assert not any("PLAINTEXT" in line for line in props)
    assert security.client_config()["security.protocol"] == "SASL_SSL"
    assert security.client_config()["ssl.ca.location"] == str(tls.ca_file)


def test_the_http_servers_speak_https_when_both_files_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from choreo.config import settings
    from choreo.http_serving import tls_options

    for name in ("CHOREO_HTTP_TLS_CERT_FILE", "CHOREO_HTTP_TLS_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings.cache_clear()
    try:
        assert tls_options() == {}  # the default: plain HTTP, as before
        monkeypatch.setenv("CHOREO_HTTP_TLS_CERT_FILE", "/tls/server.pem")
        settings.cache_clear()
        with pytest.raises(ValueError, match="both"):  # never plain HTTP by a half setting
            tls_options()
        monkeypatch.setenv("CHOREO_HTTP_TLS_KEY_FILE", "/tls/server.key")
        settings.cache_clear()
        assert tls_options() == {"ssl_certfile": "/tls/server.pem", "ssl_keyfile": "/tls/server.key"}
    finally:
        monkeypatch.undo()
        settings.cache_clear()


def test_owner_tokens_parse_both_formats_and_refuse_bad_entries() -> None:
    assert parse_tokens(f"{TOKEN}=alice, {TOKEN}b=bob") == {TOKEN: "alice", f"{TOKEN}b": "bob"}
    assert parse_tokens(f'{{"{TOKEN}": "alice"}}') == {TOKEN: "alice"}
    for bad in ("short=alice", f"{TOKEN}=", f"{TOKEN}=bad owner", "no-separator-here-long-enough"):
        with pytest.raises(ValueError) as caught:
            parse_tokens(bad)
        assert TOKEN not in str(caught.value)


def test_owner_tokens_map_bearer_tokens_to_owners() -> None:
    tokens = OwnerTokens({TOKEN: "alice", TOKEN + "2": "bob"})
    assert tokens.bearer(f"Bearer {TOKEN}") == "alice"
    assert tokens.bearer(f"bearer {TOKEN}2") == "bob"
    for header in (None, "", TOKEN, f"Basic {TOKEN}", "Bearer ", f"Bearer {TOKEN}x"):
        assert tokens.bearer(header) is None


def test_registry_basic_auth() -> None:
    auth = BasicAuth(parse_users("writer:s3cret\n# c\nreader:r"))
    good = "Basic " + base64.b64encode(b"writer:s3cret").decode()
    assert auth.check(good) == "writer"
    for header in (None, "Basic !!!", "Bearer x", "Basic " + base64.b64encode(b"writer:no").decode(),
                   "Basic " + base64.b64encode(b"writer").decode()):
        assert auth.check(header) is None
    write = Endpoint("POST", ("subjects", "{subject}", "versions"), lambda c: None, access="write")
    read = Endpoint("GET", ("subjects",), lambda c: None)
    assert auth.required(write.access) and not auth.required(read.access)
    reads_too = BasicAuth({"u": "p"}, protect_reads=True)
    assert reads_too.required(read.access)
    with pytest.raises(ValueError):
        parse_users("no-password")


def test_redis_acl_file_disables_default_and_stores_digests() -> None:
    text = acl_file_text({"pipeline": "secret-pass"})
    assert text.splitlines()[0].startswith("user default off")
    assert "secret-pass" not in text and "-@dangerous" in text and "#" in text
    with pytest.raises(ValueError):
        acl_file_text({"default": "x"})
