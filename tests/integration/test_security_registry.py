"""The registry's logins and roles (reads configurable), and whom it forwards writes to.

Real registry processes (own port, own store topic) on the shared stack, started with
``SCHEMA_REGISTRY_AUTH_USERS`` / ``..._FILE`` and ``SCHEMA_REGISTRY_AUTH_ROLES``;
confluent-kafka's own ``SchemaRegistryClient`` authenticates with ``basic.auth.user.info``
or credentials in the URL, unchanged. A lease planted in Redis by someone without the
instances' peer secret must never receive a caller's credentials.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from choreo.config import settings
from choreo.redis_client import connect
from infra.security import new_secret, write_private
from registry.leader import lease_key as registry_lease_key
from tests.helpers import free_port
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


def peer_secret(tmp_path: Path) -> str:
    path = tmp_path / "registry-peer.secret"
    write_private(path, new_secret())
    return str(path)


def test_a_follower_forwards_a_write_signed_with_the_peer_secret(instances: Starter, tmp_path: Path) -> None:
    env = {"SCHEMA_REGISTRY_AUTH_USERS": f"writer:{SECRET}", "SCHEMA_REGISTRY_PEER_SECRET_FILE": peer_secret(tmp_path)}
    _, first = instances("lead", **env)
    _, second = instances("follow", **env)
    body = json.dumps({"schema": SCHEMA})
    for url in (first, second):  # one of them is not the leader: its write is forwarded
        assert httpx.post(f"{url}/subjects/fwd-value/versions", content=body, headers=CT,
                          timeout=30).status_code == 401
        ok = httpx.post(f"{url}/subjects/fwd-value/versions", content=body, headers=CT,
                        auth=("writer", SECRET), timeout=30)
        assert ok.status_code == 200, ok.text


ROLES_USERS = f"admin:{SECRET}-a,deployer:{SECRET}-d,package:{SECRET}-p"


def test_roles_read_write_of_named_subjects_and_admin(instances: Starter) -> None:
    _, url = instances("roles", SCHEMA_REGISTRY_AUTH_USERS=ROLES_USERS,
                       SCHEMA_REGISTRY_AUTH_ROLES="admin admin; deployer write roles.*")
    body = json.dumps({"schema": SCHEMA})
    service, deployer, admin = ("package", f"{SECRET}-p"), ("deployer", f"{SECRET}-d"), ("admin", f"{SECRET}-a")

    def call(method: str, path: str, who: tuple[str, str], payload: str = "{}") -> httpx.Response:
        return httpx.request(method, f"{url}{path}", content=payload, headers=CT, auth=who, timeout=30)

    # a login without a role entry only reads: it may not register, delete or change config/mode
    refused = call("POST", "/subjects/roles.a-value/versions", service, body)
    assert refused.status_code == 403 and refused.json()["error_code"] == 40301, refused.text
    # the writer registers under the subjects it names, nowhere else, and deletes nothing
    registered = call("POST", "/subjects/roles.a-value/versions", deployer, body)
    assert registered.status_code == 200, registered.text
    assert call("POST", "/subjects/other-value/versions", deployer, body).status_code == 403
    for who in (service, deployer):
        for method, path, payload in (("DELETE", "/subjects/roles.a-value", ""),
                                      ("DELETE", "/subjects/roles.a-value/versions/1", ""),
                                      ("PUT", "/config", '{"compatibility": "NONE"}'),
                                      ("PUT", "/config/roles.a-value", '{"compatibility": "NONE"}'),
                                      ("DELETE", "/config/roles.a-value", ""),
                                      ("PUT", "/mode", '{"mode": "READONLY"}')):
            answer = call(method, path, who, payload)
            assert answer.status_code == 403, (who[0], method, path, answer.text)
    # the service still reads everything it needs: lookups by schema and by id
    assert call("POST", "/subjects/roles.a-value", service, body).json()["id"] == registered.json()["id"]
    assert httpx.get(f"{url}/schemas/ids/{registered.json()['id']}").status_code == 200
    # the admin changes config and deletes
    assert call("PUT", "/config/roles.a-value", admin, '{"compatibility": "NONE"}').status_code == 200
    assert call("DELETE", "/subjects/roles.a-value", admin, "").json() == [1]
    assert httpx.get(f"{url}/subjects").json() == []


class Recorder(BaseHTTPRequestHandler):
    """A fake leader: remembers every request's headers and answers 200."""

    seen: list[dict[str, str]] = []

    def _any(self) -> None:
        Recorder.seen.append({k.lower(): v for k, v in self.headers.items()})
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"id": 1}')

    do_POST = do_PUT = do_DELETE = do_GET = _any

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture()
def fake_leader() -> Iterator[str]:
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def plant_lease(url: str, fake: str) -> None:
    """What anyone who can write the registry's Redis key could do."""
    topic = httpx.get(f"{url}/_health").json()["topic"]
    lease = json.dumps({"id": "impostor", "url": fake, "token": 99, "sig": "0" * 64})
    connect(settings().redis_url).set(registry_lease_key(topic), lease, px=60_000)


@pytest.mark.parametrize("with_peer_secret", [True, False])
def test_a_planted_leader_never_receives_the_callers_credentials(
        instances: Starter, fake_leader: str, tmp_path: Path, with_peer_secret: bool) -> None:
    env = {"SCHEMA_REGISTRY_AUTH_USERS": f"admin:{SECRET}", "SCHEMA_REGISTRY_LEADER_ELIGIBLE": "false"}
    if with_peer_secret:
        env["SCHEMA_REGISTRY_PEER_SECRET_FILE"] = peer_secret(tmp_path)
    _, url = instances("follower", **env)
    plant_lease(url, fake_leader)
    for method, path, payload in (("POST", "/subjects/x-value/versions", json.dumps({"schema": SCHEMA})),
                                  ("DELETE", "/subjects/x-value", ""), ("PUT", "/config", '{"compatibility": "NONE"}')):
        answer = httpx.request(method, f"{url}{path}", content=payload, headers=CT, auth=("admin", SECRET), timeout=30)
        assert answer.status_code == 500 and answer.json()["error_code"] == 50003, answer.text
    assert Recorder.seen == [], f"the planted leader was called: {Recorder.seen}"


def test_without_configuration_nothing_changes(instances: Starter) -> None:
    _, url = instances("open")
    ok = httpx.post(f"{url}/subjects/open-value/versions", content=json.dumps({"schema": SCHEMA}),
                    headers=CT)
    assert ok.status_code == 200
