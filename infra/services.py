"""The pipeline's services as managed background processes (pid file, log, start/stop),
the same way as the broker and Redis, so the demo, the benchmark and the chaos runner
start every service as its own real process."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from choreo.config import REPO_ROOT, Settings, settings
from infra.process import ManagedProcess
from infra.tls import verify_for

PIPELINE = {
    "package": "consumers.package:service",
    "drone-scheduler": "consumers.drone_scheduler:service",
    "delivery": "consumers.delivery:service",
    "notifier": "consumers.notifier:service",
    "supervisor": "choreo.supervisor:service",
}


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    ref: str
    instance: str = "0"


def service_process(spec: ServiceSpec, env: dict[str, str] | None = None,
                    cfg: Settings | None = None, *, workdir: Path | None = None,
                    workflow: str | None = None) -> ManagedProcess:
    """``choreo run`` of one instance; ``workdir`` keeps its pid and log files apart from
    another launcher's instances of the same id, ``workflow`` is ``run --workflow``."""
    cfg = cfg or settings()
    name = f"{spec.name}-{spec.instance}"
    return ManagedProcess(
        name=name,
        argv=[sys.executable, "-m", "infra.cli", "run", spec.ref, "--instance", spec.instance,
              *(["--workflow", workflow] if workflow is not None else [])],
        workdir=workdir or cfg.data_dir / "services",
        ports=[],
        ready=lambda: True,
        marker=f"run {spec.ref} --instance {spec.instance}",
        env={"PYTHONPATH": str(REPO_ROOT), **(env or {})},
    )


def ingestion_process(url: str, env: dict[str, str] | None = None,
                      cfg: Settings | None = None, *, workdir: Path | None = None) -> ManagedProcess:
    return http_server_process("ingestion", ["producers.cli", "serve"], url,
                               {"INGESTION_URL": url, **(env or {})}, cfg, workdir=workdir)


def http_server_process(name: str, module_args: list[str], url: str,
                        env: dict[str, str] | None = None, cfg: Settings | None = None,
                        *, workdir: Path | None = None) -> ManagedProcess:
    """``python -m <module_args> --host H --port P`` serving ``url``, ready once its
    ``/readyz`` answers 200."""
    cfg = cfg or settings()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 8000

    def ready() -> bool:
        return httpx.get(f"{url}/readyz", timeout=1.0, verify=verify_for(env)).status_code == 200

    where = ["--host", host, "--port", str(port)]
    return ManagedProcess(
        name=name,
        argv=[sys.executable, "-m", *module_args, *where],
        workdir=workdir or cfg.data_dir / "services",
        ports=[(host, port)],
        ready=ready,
        marker=" ".join([module_args[-1], *where]),
        env={"PYTHONPATH": str(REPO_ROOT), **(env or {})},
    )


def pipeline_specs(instances: int = 1, names: list[str] | None = None) -> list[ServiceSpec]:
    chosen = names or list(PIPELINE)
    return [ServiceSpec(n, PIPELINE[n], str(i)) for n in chosen for i in range(instances)]
