"""Redis 7 from Debian's ``redis-server``, with append-only persistence for the local stack."""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

import redis

from infra.process import ManagedProcess


INSTALL_HINT = "Install it with: apt-get install -y redis-server (bash infra/setup.sh does this)."


def redis_process(url: str, data_dir: Path) -> ManagedProcess:
    """Redis for ``url``, with its files under ``data_dir/redis``.

    The binary is looked up lazily (start raises a clear sentence when it is missing), so that
    status and stop work on a machine without it.
    """
    parsed = urlparse(url)
    host = parsed.hostname or "127.0.0.1"
    port = parsed.port or 6379
    binary = shutil.which("redis-server") or "redis-server"
    workdir = data_dir / "redis"
    argv = [
        binary,
        "--bind", host,
        "--port", str(port),
        "--dir", str(workdir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--daemonize", "no",
        "--protected-mode", "no",
    ]
    password = parsed.password
    if password:
        argv += ["--requirepass", password]

    def ready() -> bool:
        with redis.Redis.from_url(url, socket_timeout=1) as client:
            return bool(client.ping())

    return ManagedProcess(
        name="redis", argv=argv, workdir=workdir, ports=[(host, port)], ready=ready,
        # Redis rewrites its title to "redis-server <host>:<port>", which is what stays visible
        marker=f"{host}:{port}",
        install_hint=INSTALL_HINT,
    )
