"""Redis 7 from Debian's ``redis-server``, with append-only persistence for the local stack."""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlparse

import redis

from infra.process import ManagedProcess, StackError


def redis_process(url: str, data_dir: Path) -> ManagedProcess:
    parsed = urlparse(url)
    host = parsed.hostname or "127.0.0.1"
    port = parsed.port or 6379
    binary = shutil.which("redis-server")
    if binary is None:
        raise StackError(
            "redis-server was not found on PATH; install it with: apt-get install -y redis-server "
            "(the setup script does this)"
        )
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
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())

    return ManagedProcess(
        name="redis", argv=argv, workdir=workdir, ports=[(host, port)], ready=ready,
        marker=f"{host}:{port}",
    )
