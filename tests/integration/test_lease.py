"""The supervisor lease on a real Redis (a database of its own): one holder, a token that only
grows, takeover after the TTL, and writes of a deposed holder that lose."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from choreo import keys
from choreo.lease import COPY_TTL_MS, Lease, holder, shard_copy_key

pytestmark = pytest.mark.integration

DB = int(os.environ.get("SUP_TEST_REDIS_DB", "11"))

FENCED_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 'fenced' end
redis.call('SET', KEYS[2], ARGV[2])
return 'ok'
"""


@pytest.fixture()
def client(stack: None) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=6379, db=DB)
    yield client
    client.close()


def test_one_holder_renews_and_a_second_waits(client: redis.Redis) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = Lease(client, name, "a", 1000), Lease(client, name, "b", 1000)
    assert a.acquire()
    token = a.token
    assert not b.acquire() and b.fence is None
    assert a.acquire() and a.token == token  # renewal keeps the token
    found = holder(client, name)
    assert found is not None and found.owner == "a" and found.token == token


def test_takeover_after_ttl_gets_a_higher_token_and_fences_the_old_holder(client: redis.Redis) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = Lease(client, name, "a", 300), Lease(client, name, "b", 300)
    assert a.acquire()
    old_fence, old_token = a.fence, a.token
    time.sleep(0.4)  # a "pauses" past its TTL
    assert b.acquire()
    assert b.token is not None and old_token is not None and b.token > old_token
    write = client.register_script(FENCED_WRITE)
    target = f"{name}:target"
    assert write(keys=[a.key, target], args=[old_fence, "from a"]) == b"fenced"
    assert write(keys=[b.key, target], args=[b.fence, "from b"]) == b"ok"
    assert client.get(target) == b"from b"
    assert not a.acquire()  # a learns it was deposed
    client.delete(target)


def test_release_lets_the_next_holder_in_at_once(client: redis.Redis) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a, b = Lease(client, name, "a", 60_000), Lease(client, name, "b", 60_000)
    assert a.acquire()
    a.release()
    assert b.acquire()


def test_a_holder_that_finds_a_newer_fence_posted_steps_down(client: redis.Redis) -> None:
    """It took the lease, then paused past the TTL before posting its fence, and a newer
    holder posted meanwhile: its post is refused in that shard, and it does not lead."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    client.set(shard_copy_key(name, 3), f"newer|{10**6}", px=1000)
    a = Lease(client, name, "a", 1000)
    assert not a.acquire() and a.fence is None
    assert client.get(shard_copy_key(name, 3)) == f"newer|{10**6}".encode()
    assert holder(client, name) is None  # it gave the key up for whoever comes next


def test_a_steady_holder_posts_its_fence_once_and_again_only_when_it_may_have_lost_it(
        client: redis.Redis) -> None:
    """Renewing does not write the shards' copies again (64 script items a scan, for nothing);
    a new token does, and so does a holder told it was fenced (a copy lost with a node)."""
    name = f"lease-{uuid.uuid4().hex[:8]}"
    a = Lease(client, name, "a", 1000)
    assert a.acquire() and a.fence is not None
    fence = a.fence.encode()
    copies = [shard_copy_key(name, shard) for shard in range(keys.SHARDS)]
    assert all(client.get(copy) == fence for copy in copies)
    assert 1000 < client.pttl(copies[0]) <= COPY_TTL_MS
    client.delete(copies[5])
    assert a.acquire()
    assert client.get(copies[5]) is None  # a renewal posts nothing
    a.lost()
    assert a.acquire() and a.fence == fence.decode()
    assert client.get(copies[5]) == fence
    a.release()
    b = Lease(client, name, "b", 1000)
    assert b.acquire() and b.fence is not None
    assert all(client.get(copy) == b.fence.encode() for copy in copies)  # a new token posts
    client.delete(*copies)
