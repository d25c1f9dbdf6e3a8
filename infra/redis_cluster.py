"""A Redis Cluster on loopback: three masters with one replica each (Debian's ``redis-server``).

Each node is the stack's own Redis (``infra.redis_server``) with cluster mode on, so start,
stop and status behave like every other part: a node that runs is reused, a stale pid file
is ignored. The cluster is formed once with ``redis-cli --cluster create``; each node keeps
its view in ``nodes.conf`` in its work dir, so a later start (after a stop, or after a node
was killed) rejoins the same cluster instead of forming a new one.

``REDIS_URL=redis://127.0.0.1:7000`` (any node) is what a client needs: redis-py's
``RedisCluster`` discovers the rest. The ports (7000-7005, and their cluster bus ports
17000-17005) are fixed and used by nothing else of the project.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from infra.process import ManagedProcess, StackError, stop_all
from infra.redis_server import INSTALL_HINT, redis_process

HOST = "127.0.0.1"
BASE_PORT = 7000
MASTERS = 3
REPLICAS_PER_MASTER = 1
SLOTS = 16384
BUS_OFFSET = 10000  # Redis's cluster bus listens on port + 10000
# how long a master may be unreachable before its replica takes over: short, for failover tests
NODE_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class NodeView:
    """One node as the cluster sees it (a line of ``CLUSTER NODES``)."""

    node_id: str
    port: int
    master: bool
    alive: bool
    master_id: str  # a replica's master; "-" for a master
    slots: int


class RedisCluster:
    """The cluster's nodes under ``data_dir/redis-cluster``, on ``base_port`` and the ports after."""

    def __init__(self, data_dir: Path, base_port: int = BASE_PORT) -> None:
        self.workdir = data_dir / "redis-cluster"
        self.ports = list(range(base_port, base_port + MASTERS * (1 + REPLICAS_PER_MASTER)))

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.ports[0]}"

    def node(self, port: int) -> ManagedProcess:
        proc = redis_process(
            f"redis://{HOST}:{port}/0", self.workdir, name=f"redis-{port}",
            extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                        # a replica's first full sync at once, not after the default 5 s wait
                        "--repl-diskless-sync-delay", "0"],
        )
        proc.ports = [*proc.ports, (HOST, port + BUS_OFFSET)]
        return proc

    def processes(self) -> list[ManagedProcess]:
        return [self.node(port) for port in self.ports]

    def running(self) -> bool:
        """True when any node runs (what status and stop look at)."""
        return any(p.running() for p in self.processes())

    def start(self, timeout_s: float = 60.0) -> list[str]:
        """Start the nodes that are not running, form the cluster if it never was, and wait
        until it serves every slot; the names of the nodes started."""
        started = [p.name for p in self.processes() if p.start(timeout_s)]
        known = {port: _info(port)["cluster_known_nodes"] for port in self.ports}
        if all(n == "1" for n in known.values()):
            self._create(timeout_s)
        elif any(n == "1" for n in known.values()):
            raise StackError(
                f"Redis Cluster: nodes {sorted(p for p, n in known.items() if n == '1')} are not in the "
                f"cluster the others form; stop it and remove {self.workdir} to form it again")
        self.wait_ok(timeout_s)
        return started

    def _create(self, timeout_s: float) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise StackError(f"Redis Cluster: redis-cli was not found on PATH. {INSTALL_HINT}")
        argv = [cli, "--cluster", "create", *(f"{HOST}:{p}" for p in self.ports),
                "--cluster-replicas", str(REPLICAS_PER_MASTER), "--cluster-yes"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        (self.workdir / "create.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise StackError(f"Redis Cluster: redis-cli --cluster create failed (exit "
                             f"{done.returncode}); see {self.workdir / 'create.log'}")

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        return stop_all(self.processes(), timeout_s)

    def nodes(self, port: int | None = None) -> list[NodeView]:
        """The cluster as node ``port`` (default: the first one that answers) sees it."""
        ports = [port] if port is not None else [p for p in self.ports if self.node(p).running()]
        for candidate in ports:
            try:
                with _client(candidate) as client:
                    return _parse_nodes(str(client.execute_command("CLUSTER", "NODES")))
            except redis.RedisError:
                continue
        raise StackError("Redis Cluster: no node answers")

    def healthy(self, replicated: bool = True) -> bool:
        """Every running node says ``cluster_state:ok`` with every slot served and sees
        ``MASTERS`` masters that hold slots, each alive; each running replica is in sync with
        its master (one that never synced cannot take over). ``replicated``: besides, each
        master has its replicas (not so right after a failover, until the old master is back)."""
        running = [p for p in self.ports if self.node(p).running()]
        if not running:
            return False
        for port in running:
            info = _info(port)
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                return False
            view = self.nodes(port)
            masters = [n for n in view if n.master and n.slots]
            if len(masters) != MASTERS or not all(n.alive for n in masters):
                return False
            if replicated and any(
                    sum(r.alive for r in view if r.master_id == m.node_id) < REPLICAS_PER_MASTER
                    for m in masters):
                return False
            with _client(port) as client:
                replication = client.info("replication")
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
        return True

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.healthy():
                    return
            except (redis.RedisError, StackError):  # a node still starting or just killed
                pass
            if time.monotonic() >= deadline:
                raise StackError(f"Redis Cluster not ok within {timeout_s:g}s; see the logs in {self.workdir}")
            time.sleep(0.2)

    def kill_master(self, timeout_s: float = 30.0, port: int | None = None) -> tuple[int, int]:
        """kill -9 the master on ``port`` (default: the lowest), wait until its replica is
        promoted and the cluster is ok again; (the killed port, the promoted port). ``start``
        brings the killed node back, as a replica of the one that took over."""
        view = self.nodes()
        victim = min((n for n in view if n.master and n.alive and n.slots and port in (None, n.port)),
                     key=lambda n: n.port)
        replicas = {n.port for n in view if n.master_id == victim.node_id}
        if not replicas:
            raise StackError(f"Redis Cluster: master {victim.port} has no replica to take over")
        self.node(victim.port).kill()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                promoted = [n.port for n in self.nodes() if n.master and n.alive and n.port in replicas]
                if promoted and self.healthy(replicated=False):
                    return victim.port, promoted[0]
            except (redis.RedisError, StackError):
                pass
            if time.monotonic() >= deadline:
                raise StackError(f"Redis Cluster: no replica of {victim.port} took over within {timeout_s:g}s")
            time.sleep(0.2)


def _client(port: int) -> redis.Redis:
    return redis.Redis(host=HOST, port=port, socket_timeout=2, socket_connect_timeout=2,
                       decode_responses=True)


def _info(port: int) -> dict[str, str]:
    with _client(port) as client:
        raw = str(client.execute_command("CLUSTER", "INFO"))
    return dict(line.split(":", 1) for line in raw.split() if ":" in line)


def _slot_count(ranges: list[str]) -> int:
    count = 0
    for item in ranges:
        if item.startswith("["):  # a slot being migrated, not served yet
            continue
        low, _, high = item.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def _parse_nodes(raw: str) -> list[NodeView]:
    """``CLUSTER NODES``: id, ip:port@bus, flags, master id, ..., link state, slots."""
    views = []
    for line in raw.strip().splitlines():
        fields = line.split()
        flags = fields[2].split(",")
        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
        views.append(NodeView(
            node_id=fields[0], port=port, master="master" in flags,
            alive=not {"fail", "fail?", "noaddr"} & set(flags) and fields[7] == "connected",
            master_id=fields[3], slots=_slot_count(fields[8:]),
        ))
    return views

