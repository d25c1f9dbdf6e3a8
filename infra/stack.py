"""The whole local stack: start, stop and status, idempotent and in dependency order."""

from __future__ import annotations

from dataclasses import dataclass

from choreo.config import Settings, settings
from infra.kafka import KafkaCluster
from infra.process import ManagedProcess
from infra.redis_server import redis_process


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


@dataclass(frozen=True)
class PartStatus:
    name: str
    running: bool
    pid: int | None
    log: str


def _registry_process(cfg: Settings) -> ManagedProcess | None:
    try:
        from infra.registry_process import registry_process
    except ImportError:
        return None
    process: ManagedProcess = registry_process(cfg)
    return process


def parts(cfg: Settings | None = None) -> list[ManagedProcess]:
    cfg = cfg or settings()
    procs = [*kafka_cluster(cfg).processes(), redis_process(cfg.redis_url, cfg.data_dir)]
    registry = _registry_process(cfg)
    if registry is not None:
        procs.append(registry)
    return procs


def start(cfg: Settings | None = None) -> list[str]:
    """Start what is not running; return the names of what was started."""
    cfg = cfg or settings()
    started = kafka_cluster(cfg).start(cfg.start_timeout_s)
    redis = redis_process(cfg.redis_url, cfg.data_dir)
    if redis.start(cfg.start_timeout_s):
        started.append(redis.name)
    registry = _registry_process(cfg)
    if registry is not None and registry.start(cfg.start_timeout_s):
        started.append(registry.name)
    return started


def stop(cfg: Settings | None = None) -> list[str]:
    """Stop in reverse dependency order; return the names of what was stopped."""
    return [p.name for p in reversed(parts(cfg)) if p.stop()]


def status(cfg: Settings | None = None) -> list[PartStatus]:
    return [
        PartStatus(p.name, p.pid() is not None, p.pid(), str(p.log_file)) for p in parts(cfg)
    ]
