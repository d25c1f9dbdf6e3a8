"""Reaching Redis the same way on a single node and on a Redis Cluster.

``connect`` asks the server named by the URL whether it is a cluster node (``CLUSTER
INFO``, which a user kept from ``@dangerous`` commands such as ``INFO`` may still run) and
answers a ``RedisCluster`` if so: ``REDIS_URL`` pointing at any node of a cluster is enough. Both
offer the same commands (a ``RedisCluster`` passes for a ``redis.Redis`` here), and every
script the runtime runs touches keys of one hash slot (``choreo.keys``).

What differs is pipelining scripts: redis-py's cluster pipeline refuses ``EVALSHA``. A
``NodePipelines`` queues each call on a plain pipeline of the node that serves its keys
(which also loads a script a node lacks, as after a failover), one round trip per node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.client import Pipeline
from redis.exceptions import (AskError, ClusterError, ConnectionError as RedisConnectionError, InvalidResponse,
                              NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError, SlotNotCoveredError,
                              TimeoutError as RedisTimeout, TryAgainError)

from choreo.config import settings


class ReplicationLag(RedisConnectionError):
    """Fewer replicas than ``CHOREO_REDIS_WAIT_REPLICAS`` acknowledged a batch's writes in
    time: the batch fails like one whose connection broke, and is done again."""


# what a caller retries: the server is unreachable or slow, or a cluster's slots are moving
# (a failover: MOVED/ASK, CLUSTERDOWN, TRYAGAIN, a demoted master's READONLY), or the
# replicas lag
TRANSIENT: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeout, AskError, ClusterError,
                                          TryAgainError, ReadOnlyError, SlotNotCoveredError)


# Redis refusing a call whatever its arguments, besides ``TRANSIENT``: the replies redis-py
# names (it strips their code), the codes of those it does not (left in the text), and a
# reply it could not parse (the connection's, not the call's)
REFUSALS: tuple[type[Exception], ...] = (*TRANSIENT, OutOfMemoryError, NoPermissionError, InvalidResponse)
REFUSAL_CODES = {"MISCONF", "BUSY", "NOREPLICAS"}


def refused_by_redis(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis unreachable or refusing a call whatever its input (out of
    memory, an ACL, a replica cut from its master, a cluster's slots moving), not a call
    failing on what it was given: a script's Lua error, a command refusing its arguments, a
    key of the wrong type, or an argument redis-py will not send (``DataError``)."""
    if isinstance(exc, REFUSALS):
        return True
    return type(exc) is ResponseError and str(exc).split(" ", 1)[0] in REFUSAL_CODES


# the replies that say the slot map this client holds is out of date
_MOVED: tuple[type[Exception], ...] = (AskError, ClusterError, TryAgainError, ReadOnlyError)


def connect(url: str, **options: Any) -> redis.Redis:
    """A client of the server at ``url``: a cluster client when it is a cluster node.

    ``url`` may name several seed nodes of one cluster (``redis://h1:p1,h2:p2/0``): the
    first that answers is asked, so a process starting while one node is down (a failover
    in progress) still finds the cluster, whose client then learns every node from it."""
    unreachable: RedisConnectionError | None = None
    for seed in seeds(url):
        probe = redis.Redis.from_url(seed, **options)
        try:
            answer = probe.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
            clustered = "cluster_state" in (answer if isinstance(answer, dict) else str(answer))
        except NoPermissionError:  # neither answer can be trusted: say so rather than guess
            probe.close()
            raise
        except ResponseError:  # "cluster support disabled", or a proxy that knows no CLUSTER
            clustered = False
        except RedisConnectionError as exc:
            probe.close()
            unreachable = exc
            continue
        if not clustered:
            return probe
        probe.close()
        return cast(redis.Redis, redis.RedisCluster.from_url(seed, **options))
    assert unreachable is not None
    raise unreachable


def seeds(url: str) -> list[str]:
    """One URL per host of ``url`` (``scheme://[user@]h1:p1,h2:p2/db``), in order."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    return [urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}"))
            for host in hosts.split(",") if host] or [url]


def is_cluster(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster)


def slot_of(client: redis.Redis, key: str) -> int:
    """The hash slot of ``key`` on a cluster (redis-py leaves ``keyslot`` untyped)."""
    return int(cast(redis.RedisCluster, client).keyslot(key))  # type: ignore[no-untyped-call]


def raise_first(replies: list[Any]) -> list[Any]:
    """The replies, once none is an error (the first one is raised)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


class NodePipelines:
    """Commands pipelined per node, answered in the order they were queued. Queue each
    command on ``on(its first key)`` (``None`` for a command without keys, which any node
    may run), exactly one command per call."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._pipes: dict[str, Pipeline] = {}
        self._order: list[tuple[str, int]] = []

    def on(self, key: str | None) -> Pipeline:
        name, node_client = "", self.client
        if is_cluster(self.client):
            cluster = cast(redis.RedisCluster, self.client)
            node = (cluster.get_default_node() if key is None  # type: ignore[no-untyped-call]
                    else cluster.get_node_from_key(key))  # type: ignore[no-untyped-call]
            name, node_client = node.name, cluster.get_redis_connection(node)
        pipe = self._pipes.get(name)
        if pipe is None:
            pipe = self._pipes[name] = node_client.pipeline(transaction=False)
        self._order.append((name, len(pipe)))
        return pipe

    def __len__(self) -> int:
        return len(self._order)

    def execute(self) -> list[Any]:
        """Every command's reply in queue order, an error reply as an exception in its place.
        A reply that says the slot moved (or a node that cannot be reached) makes the cluster
        client read the slot map again, so the caller's next try goes to the right node.

        With ``CHOREO_REDIS_WAIT_REPLICAS`` set, each node's pipeline ends with a ``WAIT``
        on the same connection (``WAIT`` counts that connection's writes), and too few
        acknowledgements raise ``ReplicationLag``."""
        replicas, wait_ms = settings().redis_wait_replicas, settings().redis_wait_ms
        replies: dict[str, list[Any]] = {}
        try:
            for name, pipe in self._pipes.items():
                if replicas:
                    pipe.execute_command("WAIT", replicas, wait_ms)  # type: ignore[no-untyped-call]
                replies[name] = pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeout):
            self._refresh()
            raise
        answers = [replies[name][i] for name, i in self._order]
        if any(isinstance(a, _MOVED) for a in answers):
            self._refresh()
        if replicas:
            for name, node_replies in replies.items():
                acked = node_replies[-1]
                if isinstance(acked, Exception):  # WAIT refused (an ACL, a proxy): not waited
                    raise ReplicationLag(f"WAIT failed on {name or 'redis'}: {acked}")
                if int(acked) < replicas:
                    raise ReplicationLag(f"{acked} of {replicas} replicas of {name or 'redis'} "
                                         f"acknowledged the writes within {wait_ms} ms")
        return answers

    def _refresh(self) -> None:
        if is_cluster(self.client):
            cast(redis.RedisCluster, self.client).nodes_manager.initialize()


def write_waited(client: redis.Redis, key: str, write: Callable[[redis.Redis | Pipeline], Any]) -> Any:
    """The reply to one write of ``key``; with ``CHOREO_REDIS_WAIT_REPLICAS`` set, only once
    that many replicas hold it (``ReplicationLag`` otherwise). For a write outside a batch
    that an answer to a caller rests on: a failover must not lose it after the caller was
    told. ``write`` sends the write to the target it is given: the client itself, or, to
    wait, a pipeline on the key's node that ends with ``WAIT``."""
    if not settings().redis_wait_replicas:
        return write(client)
    pipes = NodePipelines(client)
    write(pipes.on(key))
    return raise_first(pipes.execute())[0]
