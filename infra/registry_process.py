"""The registry as a managed process of the local stack (start/stop/status like the others)."""

from __future__ import annotations

import os
import sys
from urllib.parse import urlparse

import httpx

from choreo.config import REPO_ROOT, Settings
from infra.process import ManagedProcess
from infra.tls import verify_for


def registry_process(cfg: Settings, *, port: int | None = None, topic: str | None = None,
                     name: str = "registry", env: dict[str, str] | None = None) -> ManagedProcess:
    """The shared registry by default; tests pass their own port, topic and name for isolated instances."""
    url = urlparse(cfg.schema_registry_url)
    host = url.hostname or "127.0.0.1"
    bind_port = port or url.port or 8081
    scheme = url.scheme or "http"  # https when its env names a certificate (CHOREO_HTTP_TLS_*)
    argv = [sys.executable, "-m", "registry", "serve", "--host", host, "--port", str(bind_port)]
    if topic:
        argv += ["--topic", topic]

    def ready() -> bool:
        # the port opens only after the store was read to its end, so 200 here means caught up
        return httpx.get(f"{scheme}://{host}:{bind_port}/", timeout=1.0,
                         verify=verify_for(env)).status_code == 200

    return ManagedProcess(
        name=name,
        argv=argv,
        workdir=cfg.data_dir / name,
        ports=[(host, bind_port)],
        ready=ready,
        marker=f"registry serve --host {host} --port {bind_port}",
        env={
            "KAFKA_BOOTSTRAP_SERVERS": cfg.kafka_bootstrap_servers,
            "REDIS_URL": cfg.redis_url,
            # the process runs in its workdir: make sure ``-m registry`` resolves to this checkout
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
            **(env or {}),
        },
    )
