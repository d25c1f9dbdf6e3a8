"""The whole local stack: start, stop and status, idempotent and in dependency order.

A part named in ``CHOREO_EXTERNAL`` (``kafka``, ``redis``, ``registry``, comma-separated) is a
server someone else runs at the address the environment gives (``KAFKA_BOOTSTRAP_SERVERS``,
``REDIS_URL``, ``SCHEMA_REGISTRY_URL``): start waits until it answers, status probes it, and
stop leaves it alone. Only the other parts are started here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import redis

from choreo.config import Settings, settings
from infra.kafka import KafkaCluster
from infra.process import ManagedProcess, StackError, port_listening
from infra.redis_cluster import RedisCluster
from infra.redis_server import redis_process

EXTERNAL_ENV = "CHOREO_EXTERNAL"
PARTS = ("kafka", "redis", "registry")


def _port_of(bootstrap: str) -> int:
    first = bootstrap.split(",")[0]
    return int(first.rsplit(":", 1)[1])


def kafka_cluster(cfg: Settings | None = None, nodes: int = 1) -> KafkaCluster:
    cfg = cfg or settings()
    if nodes == 1:
        return KafkaCluster(
            data_dir=cfg.data_dir, libs=cfg.kafka_libs, nodes=1,
            base_port=_port_of(cfg.kafka_bootstrap_servers), heap=cfg.kafka_heap,
        )
    return KafkaCluster(
        data_dir=cfg.data_dir / f"cluster{nodes}", libs=cfg.kafka_libs, nodes=nodes,
        base_port=19092, heap="-Xms128m -Xmx384m",
    )


def external() -> frozenset[str]:
    """The parts ``CHOREO_EXTERNAL`` names; an unknown name is refused, not ignored."""
    names = {n.strip().lower() for n in os.environ.get(EXTERNAL_ENV, "").split(",") if n.strip()}
    unknown = names - set(PARTS)
    if unknown:
        raise StackError(f"{EXTERNAL_ENV} names {', '.join(sorted(unknown))}; "
                         f"it takes a comma-separated list of {', '.join(PARTS)}")
    return frozenset(names)


@dataclass(frozen=True)
class PartStatus:
    name: str
    running: bool
    pid: int | None
    log: str


def redis_cluster(cfg: Settings | None = None) -> RedisCluster:
    """The Redis Cluster of ``stack start --redis-cluster``, beside the single Redis."""
    return RedisCluster((cfg or settings()).data_dir)


def _registry_process(cfg: Settings) -> ManagedProcess | None:
    try:
        from infra.registry_process import registry_process
    except ImportError:
        return None
    process: ManagedProcess = registry_process(cfg)
    return process


def _own(cfg: Settings) -> dict[str, list[ManagedProcess]]:
    """Each part this stack runs itself, by part name (external ones left out)."""
    outside = external()
    owned: dict[str, list[ManagedProcess]] = {}
    if "kafka" not in outside:
        owned["kafka"] = kafka_cluster(cfg).processes()
    if "redis" not in outside:
        owned["redis"] = [redis_process(cfg.redis_url, cfg.data_dir)]
    registry = _registry_process(cfg)
    if "registry" not in outside and registry is not None:
        owned["registry"] = [registry]
    return owned


def parts(cfg: Settings | None = None) -> list[ManagedProcess]:
    """The processes this stack runs itself, in start order."""
    return [p for procs in _own(cfg or settings()).values() for p in procs]


def _probes(cfg: Settings) -> dict[str, tuple[str, Callable[[], bool]]]:
    """How to tell an external part answers: its address and a read-only probe."""
    host, _, port = cfg.kafka_bootstrap_servers.split(",")[0].rpartition(":")
    registry = cfg.schema_registry_url.rstrip("/")
    return {
        "kafka": (cfg.kafka_bootstrap_servers, lambda: port_listening(host or "127.0.0.1", int(port))),
        "redis": (_without_password(cfg.redis_url),
                  lambda: bool(redis.Redis.from_url(cfg.redis_url, socket_timeout=2).ping())),
        "registry": (_without_password(registry),
                     lambda: httpx.get(f"{registry}/subjects", timeout=2).status_code == 200),
    }


def _without_password(url: str) -> str:
    """``url`` without its user info, for status lines and errors (never print a secret)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def _answers(probe: Callable[[], bool]) -> bool:
    try:
        return probe()
    except Exception:  # refused, timed out, unauthenticated: it does not answer us
        return False


def _await_external(cfg: Settings, timeout_s: float) -> None:
    """Wait for every external part to answer; one sentence names the first that does not."""
    probes = _probes(cfg)
    for name in sorted(external()):
        where, probe = probes[name]
        deadline = time.monotonic() + timeout_s
        while not _answers(probe):
            if time.monotonic() >= deadline:
                raise StackError(f"external {name} at {where} ({EXTERNAL_ENV}) did not answer "
                                 f"within {timeout_s:g}s")
            time.sleep(0.5)


def start(cfg: Settings | None = None) -> list[str]:
    """Start what is not running nor external; return the names of what was started."""
    cfg = cfg or settings()
    _await_external(cfg, cfg.start_timeout_s)
    owned = _own(cfg)
    started = kafka_cluster(cfg).start(cfg.start_timeout_s) if "kafka" in owned else []
    for proc in owned.get("redis", []) + owned.get("registry", []):
        if proc.start(cfg.start_timeout_s):
            started.append(proc.name)
    return started


def stop(cfg: Settings | None = None) -> list[str]:
    """Stop in reverse dependency order (never an external part), the Redis Cluster too;
    return what was stopped."""
    return [*redis_cluster(cfg).stop(), *(p.name for p in reversed(parts(cfg)) if p.stop())]


def status(cfg: Settings | None = None) -> list[PartStatus]:
    cfg = cfg or settings()
    cluster = redis_cluster(cfg)  # shown when one of its nodes runs: it is started on demand
    shown = [*parts(cfg), *(cluster.processes() if cluster.running() else [])]
    owned = [PartStatus(p.name, p.pid() is not None, p.pid(), str(p.log_file)) for p in shown]
    probes = _probes(cfg)
    return owned + [PartStatus(f"{name} (external)", _answers(probes[name][1]), None, probes[name][0])
                    for name in sorted(external())]
