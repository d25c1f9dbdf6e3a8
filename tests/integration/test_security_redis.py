"""Redis in ACL mode: one user per principal, each limited to the keys it owns.

``infra.security.redis_key_prefixes`` derives each principal's key prefixes from the
workflow's declarations; a private ``redis-server`` runs with those users, on TLS only with
the certificate of a CA made for the module (``infra.tls``), as in the secured stack (the URL
carries a principal's credentials and the CA,
``rediss://package:<secret>@127.0.0.1:26379/0?ssl_ca_certs=<ca.pem>``, what its ``REDIS_URL``
holds); the ``default`` user is off, so a connection without them, or with a wrong password,
is refused, and so is one without TLS or that does not trust the CA. A service runs the pipeline's scripts on its own keys and is
refused (NOPERM) on the supervisor's lease, another service's record or pool, ingestion's
owner records and the registry's leader lease; admin commands are refused to everyone.
"""

from __future__ import annotations

import fcntl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from choreo.dedupe import sighting
from choreo.lease import Lease, lease_key
from choreo.state import Begin, StateTable, StepStatus, delivery_key
from consumers.workflow import WORKFLOW
from infra.process import ManagedProcess, port_in_use
from infra.redis_server import redis_process
from infra.security import Secrets, derive_policy, redis_key_prefixes, redis_passwords, redis_url
from infra.tls import ensure_certificates
from producers.submit import owner_redis_key
from registry.leader import lease_key as registry_lease_key

pytestmark = pytest.mark.integration

PORT = 26379  # below the ephemeral port range, so a probe never collides with itself


class AclRedis:
    def __init__(self, secrets: Secrets, proc: ManagedProcess) -> None:
        self.secrets = secrets
        self.proc = proc

    def url(self, user: str) -> str:
        return redis_url(self.secrets, user, PORT)

    def bare(self, login: str = "") -> str:
        """The server's TLS URL with ``login`` (``user:password@``) as given."""
        return redis_url(self.secrets, None, PORT).replace("rediss://", f"rediss://{login}", 1)

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user), socket_timeout=5)


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    with open("/tmp/choreo-redis-acl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not port_in_use("127.0.0.1", PORT), f"port {PORT} is taken"
        data = tmp_path_factory.mktemp("acl-redis")
        secrets = Secrets(data / "secrets")
        tls = ensure_certificates(secrets.tls.root)
        users = redis_key_prefixes(WORKFLOW, derive_policy(WORKFLOW))
        proc = redis_process(redis_url(secrets, "ops", PORT), data, users=redis_passwords(secrets, users),
                             keys=users, name="redis-acl", tls=tls)
        try:
            proc.start(timeout_s=30)
            yield AclRedis(secrets, proc)
        finally:
            proc.stop()


def test_the_acl_file_is_private_and_holds_no_clear_password(acl_redis: AclRedis) -> None:
    acl_file = acl_redis.proc.workdir / "users.acl"
    assert acl_file.stat().st_mode & 0o777 == 0o600
    text = acl_file.read_text()
    assert "user default off" in text
    for user in ("package", "supervisor", "ingestion", "schema-registry", "ops"):
        assert f"user {user} on" in text and acl_redis.secrets.password(user, kind="redis") not in text


def test_without_credentials_or_with_a_wrong_password_redis_refuses(acl_redis: AclRedis) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_redis.bare()).set("k", "v")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_redis.bare("package:wrong-password@")).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_redis.bare("default:@")).ping()
    with pytest.raises(redis.AuthenticationError):  # one principal's password is not another's
        redis.Redis.from_url(acl_redis.url("package").replace("package:", "supervisor:")).ping()
    assert acl_redis.client("package").ping()


def test_redis_speaks_tls_only(acl_redis: AclRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """No plain listener (``port 0``), the TLS settings in a private config file rather than on
    the command line; a client that does not trust the stack's CA refuses the certificate."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # only what the URL says is trusted
    config = acl_redis.proc.workdir / "tls.conf"
    assert acl_redis.proc.argv[1] == str(config) and config.stat().st_mode & 0o777 == 0o600
    assert "port 0\n" in config.read_text() and f"tls-port {PORT}\n" in config.read_text()
    assert not any("tls" in arg for arg in acl_redis.proc.argv[2:])
    login = f"package:{acl_redis.secrets.password('package', kind='redis')}@"
    with pytest.raises(redis.ConnectionError):  # the server closes a connection that is not TLS
        redis.Redis.from_url(f"redis://{login}127.0.0.1:{PORT}/0", socket_timeout=5).ping()
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis.from_url(acl_redis.url("package").split("?")[0], socket_timeout=5).ping()
    assert acl_redis.client("package").ping()


def test_a_service_runs_the_pipeline_scripts_on_its_own_keys(acl_redis: AclRedis) -> None:
    client = acl_redis.client("package")
    delivery = str(uuid.uuid4())
    now = int(time.time() * 1000)
    state = StateTable(client)
    state.open(delivery, "prepare_package", now + 30_000, now)
    assert state.begin(delivery, "prepare_package", 1, now, 30_000, 10, "t|t|0|0") is Begin.GO
    assert state.finish(delivery, "prepare_package", 1, now, StepStatus.COMPLETED) == "ok"
    assert state.steps(delivery)["prepare_package"].status == "completed"
    seen = [sighting("package", delivery, "event-1", position)
            for position in ("delivery.requested|0|7", "delivery.requested|0|8")]
    assert state.begin_many([(delivery, "", 1, now, 0, "")] * 2, 10, sightings=seen, dedupe_ttl_s=3600) \
        == [(Begin.GO, 1), (Begin.DUPLICATE, 1)]
    client.hset(f"pkg:{{{delivery}}}", "size", "S")  # its own record
    # scripts are served by EVALSHA once loaded (redis-py loads them on NOSCRIPT)
    assert client.script_exists(state._begin.sha) == [True]


def test_only_the_supervisor_holds_its_lease(acl_redis: AclRedis) -> None:
    name = f"supervisor-{uuid.uuid4().hex[:6]}"
    lease = Lease(acl_redis.client("supervisor"), name, "a", 5000)
    assert lease.acquire() and lease.token is not None
    stolen = Lease(acl_redis.client("package"), name, "b", 5000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        stolen.acquire()
    lease.release()


def noperm(client: redis.Redis, *command: str) -> None:
    """Refused by the ACL: NOPERM, or inside a script the error that wraps it."""
    with pytest.raises(redis.exceptions.ResponseError, match="NOPERM|no permissions|can't access"):
        client.execute_command(*command)  # type: ignore[no-untyped-call]


def test_a_service_cannot_touch_what_other_principals_own(acl_redis: AclRedis) -> None:
    package = acl_redis.client("package")
    delivery = str(uuid.uuid4())
    owned_elsewhere = [
        lease_key("supervisor"),                    # the supervisor's lease
        f"notified:{{{delivery}}}",                 # the notifier's record
        "fleet:free", "fleet:{fleet}:free",         # the drone scheduler's pool
        owner_redis_key(delivery),                  # who may read a delivery (ingestion)
        "ingestion:inflight",                       # ingestion's admission places
        registry_lease_key("_schemas"),                  # the registry's leader: where writes go
        "release:supervisor:0",                     # the supervisor's release queue
    ]
    for key in owned_elsewhere:
        noperm(package, "SET", key, "x")
        noperm(package, "GET", key)
        noperm(package, "DEL", key)
        # a script must declare its keys, and Redis checks them before it runs
        noperm(package, "EVAL", "return redis.call('SET', KEYS[1], 'x')", "1", key)
    # nor inside a script through a key it did not declare
    noperm(package, "EVAL", f"return redis.call('SET', '{owner_redis_key(delivery)}', 'x')", "1",
           delivery_key(delivery))
    # the same keys are theirs to write
    acl_redis.client("ingestion").set(owner_redis_key(delivery), "owner-1", ex=60)
    acl_redis.client("notifier").hset(f"notified:{{{delivery}}}", "at", "1")
    acl_redis.client("schema-registry").get(registry_lease_key("_schemas"))
    # and ops (rebuild-state, redrive) reaches every key
    assert acl_redis.client("ops").get(owner_redis_key(delivery)) == b"owner-1"
    # the registry reaches nothing of the pipeline's
    noperm(acl_redis.client("schema-registry"), "HGETALL", delivery_key(delivery))
    noperm(acl_redis.client("ingestion"), "HSET", f"pkg:{{{delivery}}}", "size", "L")


def test_no_principal_can_administer_redis(acl_redis: AclRedis) -> None:
    for user in ("package", "ops"):
        client = acl_redis.client(user)
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("SHUTDOWN",), ("KEYS", "*")):
            noperm(client, *command)


def test_the_default_mode_is_unchanged_and_a_password_stays_off_the_command_line(tmp_path: Path) -> None:
    proc = redis_process("redis://127.0.0.1:6379/0", tmp_path)
    assert "--aclfile" not in proc.argv and "--requirepass" not in proc.argv
    assert proc.name == "redis" and proc.workdir == tmp_path / "redis"
    secret = "a-secret-" + uuid.uuid4().hex
    guarded = redis_process(f"redis://:{secret}@127.0.0.1:6379/0", tmp_path, name="guarded")
    assert not any(secret in arg for arg in guarded.argv)
    config = Path(guarded.argv[1])
    assert config.stat().st_mode & 0o777 == 0o600 and secret in config.read_text()
