"""The Redis Cluster of ``choreo stack start --redis-cluster`` (``infra.redis_cluster``):
three masters with one replica each on loopback, every slot served, a client that talks to
any node, a master killed and its replica taking over, and a stop that leaves nothing.

The cluster is the stack's (``infra.stack.redis_cluster``), in this test's own data dir.
Its ports are fixed (7000-7005), so concurrent runs on one machine take turns (flock), and
the test refuses to start when another cluster holds them.
"""

from __future__ import annotations

import fcntl
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from choreo.config import Settings
from infra import stack
from infra.process import port_in_use
from infra.redis_cluster import BUS_OFFSET, HOST, MASTERS, SLOTS, RedisCluster

pytestmark = pytest.mark.integration


@pytest.fixture()
def cfg(tmp_path: Path) -> Settings:
    return Settings(CHOREO_DATA_DIR=str(tmp_path))


@pytest.fixture()
def cluster(cfg: Settings) -> Iterator[RedisCluster]:
    with open("/tmp/choreo-redis-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ports are fixed: one cluster test at a time
        cluster = stack.redis_cluster(cfg)
        taken = [p for port in cluster.ports for p in (port, port + BUS_OFFSET) if port_in_use(HOST, p)]
        assert not taken, f"ports {taken} are taken; is another Redis Cluster running?"
        try:
            yield cluster
        finally:
            cluster.stop()


def roles(cluster: RedisCluster) -> tuple[list[int], list[int]]:
    """(masters holding slots, replicas), as ports, as the cluster sees itself."""
    view = [n for n in cluster.nodes() if n.alive]
    return sorted(n.port for n in view if n.master and n.slots), sorted(n.port for n in view if not n.master)


def test_three_masters_three_replicas_every_slot_and_a_failover(cluster: RedisCluster, cfg: Settings) -> None:
    assert len(cluster.start(timeout_s=30)) == 2 * MASTERS
    assert {p.name for p in stack.status(cfg) if p.running} >= {f"redis-{p}" for p in cluster.ports}
    masters, replicas = roles(cluster)
    assert len(masters) == MASTERS and len(replicas) == MASTERS
    view = cluster.nodes()
    assert sum(n.slots for n in view if n.master) == SLOTS
    # each master has its own replica
    assert sorted(n.master_id for n in view if not n.master) == sorted(n.node_id for n in view if n.master)
    assert cluster.start(timeout_s=30) == []  # a second start reuses what runs

    client = ClusterClient.from_url(cluster.url)
    keys = {f"k:{{{uuid.uuid4()}}}": str(i) for i in range(50)}
    for key, value in keys.items():
        client.set(key, value)
    assert len({client.keyslot(k) for k in keys}) > 40  # spread over slots
    assert len({client.get_node_from_key(k).port for k in keys}) == MASTERS  # and over masters
    assert all(client.get(k) == v.encode() for k, v in keys.items())
    first, other = next((a, b) for a in keys for b in keys  # two keys of one node, two slots
                        if client.get_node_from_key(a).port == client.get_node_from_key(b).port
                        and client.keyslot(a) != client.keyslot(b))
    with redis.Redis(host=HOST, port=client.get_node_from_key(first).port) as node:
        with pytest.raises(redis.ResponseError, match="hash to the same slot"):  # CROSSSLOT
            node.mget(first, other)

    killed, promoted = cluster.kill_master(timeout_s=30)
    assert killed in masters and promoted in replicas
    masters_after, _ = roles(cluster)
    assert killed not in masters_after and promoted in masters_after and len(masters_after) == MASTERS
    # the same client finds the new master by itself; writes acknowledged before the kill
    # may be lost (replication is asynchronous), new writes are taken on every slot
    for key in keys:
        client.set(key, "after")
    assert {client.get(k) for k in keys} == {b"after"}
    client.close()

    assert cluster.start(timeout_s=30) == [f"redis-{killed}"]  # back, as a replica
    masters_back, replicas_back = roles(cluster)
    assert len(masters_back) == MASTERS and killed in replicas_back and len(replicas_back) == MASTERS

    stopped = stack.stop(cfg)  # the stack's stop covers it (nothing else of it runs in this data dir)
    assert sorted(stopped) == sorted(f"redis-{p}" for p in cluster.ports)
    assert not cluster.running()
    assert not any(port_in_use(HOST, p) for p in cluster.ports)
    assert not list(cluster.workdir.glob("*/*.pid"))
    assert not [p for p in stack.status(cfg) if p.name.startswith("redis-")]  # shown while it runs only
