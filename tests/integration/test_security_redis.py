"""Redis in ACL mode: a private ``redis-server`` whose only user is the pipeline's.

The URL carries the credentials (``redis://pipeline:<secret>@127.0.0.1:26379/0``, what
``REDIS_URL`` holds for every service); the ``default`` user is off, so a connection without
them, or with a wrong password, is refused; the pipeline's own scripts (the state table,
dedupe, the supervisor's lease) run as that user; admin commands do not.
"""

from __future__ import annotations

import fcntl
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from choreo.dedupe import Deduper, Seen
from choreo.lease import Lease
from choreo.state import Begin, StateTable, StepStatus
from infra.process import ManagedProcess, port_in_use
from infra.redis_server import redis_process
from infra.security import Secrets

pytestmark = pytest.mark.integration

PORT = 26379  # below the ephemeral port range, so a probe never collides with itself


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ManagedProcess]]:
    with open("/tmp/choreo-redis-acl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not port_in_use("127.0.0.1", PORT), f"port {PORT} is taken"
        data = tmp_path_factory.mktemp("acl-redis")
        secret = Secrets(data / "secrets").password("pipeline", kind="redis")
        url = f"redis://pipeline:{secret}@127.0.0.1:{PORT}/0"
        proc = redis_process(url, data, name="redis-acl")
        try:
            proc.start(timeout_s=30)
            yield url, proc
        finally:
            proc.stop()


def test_the_acl_file_is_private_and_holds_no_clear_password(acl_redis: tuple[str, ManagedProcess]) -> None:
    url, proc = acl_redis
    acl_file = proc.workdir / "users.acl"
    assert acl_file.stat().st_mode & 0o777 == 0o600
    password = url.split(":")[2].split("@")[0]
    text = acl_file.read_text()
    assert password not in text and "user default off" in text


def test_without_credentials_or_with_a_wrong_password_redis_refuses(acl_redis: tuple[str, ManagedProcess]) -> None:
    url, _ = acl_redis
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://127.0.0.1:{PORT}/0").set("k", "v")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://pipeline:wrong-password@127.0.0.1:{PORT}/0").ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://default:@127.0.0.1:{PORT}/0").ping()
    assert redis.Redis.from_url(url).ping()


def test_the_pipeline_user_runs_the_pipeline_scripts(acl_redis: tuple[str, ManagedProcess]) -> None:
    url, _ = acl_redis
    client = redis.Redis.from_url(url, socket_timeout=5)
    delivery = str(uuid.uuid4())
    now = int(time.time() * 1000)
    state = StateTable(client)
    state.open(delivery, "prepare_package", now + 30_000, now)
    assert state.begin(delivery, "prepare_package", 1, now, 30_000, 10, "t|t|0|0") is Begin.GO
    assert state.finish(delivery, "prepare_package", 1, now, StepStatus.COMPLETED) == "ok"
    assert state.steps(delivery)["prepare_package"].status == "completed"
    dedupe = Deduper(client, "package", 3600)
    item = (delivery, "event-1", 1, "delivery.requested|0|7")
    assert dedupe.verdicts([item]) == [Seen.FRESH]
    assert dedupe.verdicts([(delivery, "event-1", 1, "delivery.requested|0|8")]) == [Seen.DUPLICATE]
    lease = Lease(client, f"supervisor-{uuid.uuid4().hex[:6]}", "a", 5000)
    assert lease.acquire() and lease.token is not None
    lease.release()
    # scripts are served by EVALSHA once loaded (redis-py loads them on NOSCRIPT)
    assert client.script_exists(state._begin.sha) == [True]


def test_the_pipeline_user_cannot_administer_redis(acl_redis: tuple[str, ManagedProcess]) -> None:
    url, _ = acl_redis
    client = redis.Redis.from_url(url)
    for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("SHUTDOWN",), ("KEYS", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)  # type: ignore[no-untyped-call]


def test_the_default_mode_is_unchanged(tmp_path: Path) -> None:
    proc = redis_process("redis://127.0.0.1:6379/0", tmp_path)
    assert "--aclfile" not in proc.argv and "--requirepass" not in proc.argv
    assert proc.name == "redis" and proc.workdir == tmp_path / "redis"
