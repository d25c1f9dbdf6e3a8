"""The registry's write endpoints behind HTTP basic authentication (reads configurable).

Real registry processes (own port, own store topic) on the shared stack, started with
``SCHEMA_REGISTRY_AUTH_USERS`` / ``..._FILE``; confluent-kafka's own ``SchemaRegistryClient``
authenticates with ``basic.auth.user.info`` or credentials in the URL, unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from infra.security import write_private
from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

CT = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
SCHEMA = json.dumps({"type": "record", "name": "Sec", "namespace": "test",
                     "fields": [{"name": "id", "type": "string"}]})
SECRET = "writer-secret-0123456789"


def test_a_write_without_credentials_is_401_and_with_them_succeeds(instances: Starter) -> None:
    _, url = instances("auth", SCHEMA_REGISTRY_AUTH_USERS=f"writer:{SECRET}")
    body = json.dumps({"schema": SCHEMA})
    refused = httpx.post(f"{url}/subjects/sec-value/versions", content=body, headers=CT)
    assert refused.status_code == 401
    assert refused.json() == {"error_code": 401, "message": "Unauthorized"}
    assert refused.headers["www-authenticate"].startswith("Basic")
    wrong = httpx.post(f"{url}/subjects/sec-value/versions", content=body, headers=CT,
                       auth=("writer", "not-it"))
    assert wrong.status_code == 401
    for method, path in (("DELETE", "/subjects/sec-value"), ("PUT", "/config"), ("PUT", "/mode")):
        assert httpx.request(method, f"{url}{path}", content=b"{}", headers=CT).status_code == 401
    ok = httpx.post(f"{url}/subjects/sec-value/versions", content=body, headers=CT,
                    auth=("writer", SECRET))
    assert ok.status_code == 200 and "id" in ok.json()
    # reads stay open by default (consumers need only schema ids)
    assert httpx.get(f"{url}/subjects").json() == ["sec-value"]
    assert httpx.get(f"{url}/schemas/ids/{ok.json()['id']}").status_code == 200
    assert httpx.post(f"{url}/subjects/sec-value", content=body, headers=CT).status_code == 200


def test_the_confluent_client_authenticates_unchanged(instances: Starter) -> None:
    _, url = instances("client", SCHEMA_REGISTRY_AUTH_USERS=f"writer:{SECRET}")
    anonymous = SchemaRegistryClient({"url": url})
    with pytest.raises(SchemaRegistryError) as caught:
        anonymous.register_schema("client-value", Schema(SCHEMA, "AVRO"))
    assert caught.value.http_status_code == 401
    with_info = SchemaRegistryClient({"url": url, "basic.auth.user.info": f"writer:{SECRET}"})
    schema_id = with_info.register_schema("client-value", Schema(SCHEMA, "AVRO"))
    in_url = SchemaRegistryClient({"url": url.replace("http://", f"http://writer:{SECRET}@")})
    assert in_url.register_schema("client-value", Schema(SCHEMA, "AVRO")) == schema_id
    assert anonymous.get_schema(schema_id).schema_str is not None  # reads are open


def test_reads_can_be_protected_too_and_users_come_from_a_file(instances: Starter, tmp_path: Path) -> None:
    users = tmp_path / "registry-users"
    write_private(users, f"# who may use the registry\nwriter:{SECRET}\nreader:reader-secret-987654\n")
    _, url = instances("reads", SCHEMA_REGISTRY_AUTH_USERS_FILE=str(users),
                       SCHEMA_REGISTRY_AUTH_READS="true")
    assert httpx.get(f"{url}/subjects").status_code == 401
    assert httpx.get(f"{url}/subjects", auth=("reader", "reader-secret-987654")).status_code == 200
    assert httpx.get(f"{url}/_health").status_code == 200  # probes stay open
    assert httpx.get(f"{url}/").status_code == 200
    client = SchemaRegistryClient({"url": url, "basic.auth.user.info": "reader:reader-secret-987654"})
    assert client.get_subjects() == []


def test_a_follower_forwards_the_callers_credentials_to_the_leader(instances: Starter) -> None:
    env = {"SCHEMA_REGISTRY_AUTH_USERS": f"writer:{SECRET}"}
    _, first = instances("lead", **env)
    _, second = instances("follow", **env)
    body = json.dumps({"schema": SCHEMA})
    for url in (first, second):  # one of them is not the leader: its write is forwarded
        assert httpx.post(f"{url}/subjects/fwd-value/versions", content=body, headers=CT,
                          timeout=30).status_code == 401
        ok = httpx.post(f"{url}/subjects/fwd-value/versions", content=body, headers=CT,
                        auth=("writer", SECRET), timeout=30)
        assert ok.status_code == 200, ok.text


def test_without_configuration_nothing_changes(instances: Starter) -> None:
    _, url = instances("open")
    ok = httpx.post(f"{url}/subjects/open-value/versions", content=json.dumps({"schema": SCHEMA}),
                    headers=CT)
    assert ok.status_code == 200
