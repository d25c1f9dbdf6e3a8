"""Apicurio Registry as a managed process: an external registry for the pipeline's tests.

The services speak the Confluent REST API, which Apicurio serves under ``/apis/ccompat/v7``;
pointing ``SCHEMA_REGISTRY_URL`` there (with ``CHOREO_EXTERNAL=registry``) runs the pipeline
on a registry this project did not write. ``infra/apicurio.sh`` installs it (setup.sh runs it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from infra.process import ManagedProcess, StackError

VERSION = "3.3.3"
HOME = Path(os.environ.get("APICURIO_HOME",
                           Path.home() / ".cache" / "dronepipe" / f"apicurio-registry-{VERSION}"))
MIN_JAVA = 21  # Apicurio 3.x is built for Java 21
CCOMPAT = "/apis/ccompat/v7"
INSTALL_HINT = "bash infra/apicurio.sh installs it (setup.sh runs it)."


def java_home(candidates: Path = Path("/usr/lib/jvm")) -> Path:
    """A JDK of version ``MIN_JAVA`` or newer: ``APICURIO_JAVA_HOME``, else the newest under
    /usr/lib/jvm (the machine's default ``java`` may be older, as Kafka's Java 17 is)."""
    chosen = os.environ.get("APICURIO_JAVA_HOME")
    if chosen:
        return Path(chosen)
    found = [(major, home) for home in sorted(candidates.glob("*"))
             if (major := _java_major(home)) >= MIN_JAVA and (home / "bin" / "java").exists()]
    if not found:
        raise StackError(f"Apicurio Registry needs Java {MIN_JAVA}+, and no such JDK is under "
                         f"{candidates}; set APICURIO_JAVA_HOME")
    return max(found)[1]


def _java_major(home: Path) -> int:
    try:
        release = (home / "release").read_text()
    except OSError:
        return 0
    match = re.search(r'^JAVA_VERSION="(\d+)', release, re.MULTILINE)
    return int(match.group(1)) if match else 0


def url(port: int) -> str:
    """The Confluent-compatible API of the instance on ``port``: a SCHEMA_REGISTRY_URL."""
    return f"http://127.0.0.1:{port}{CCOMPAT}"


def apicurio_process(port: int, workdir: Path, name: str = "apicurio") -> ManagedProcess:
    """Apicurio on loopback ``port``, in-memory storage, its management port off (it would
    bind 0.0.0.0:9000)."""
    jar = HOME / "quarkus-run.jar"
    if not jar.exists():
        raise StackError(f"Apicurio Registry {VERSION} is not installed in {HOME}; {INSTALL_HINT}")
    base = url(port)
    return ManagedProcess(
        name=name,
        argv=[str(java_home() / "bin" / "java"), "-Xms64m", "-Xmx384m",
              "-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={port}",
              "-Dquarkus.management.enabled=false", "-jar", str(jar)],
        workdir=workdir,
        ports=[("127.0.0.1", port)],
        ready=lambda: httpx.get(f"{base}/subjects", timeout=1.0).status_code == 200,
        marker=f"-Dquarkus.http.port={port}",
        install_hint=INSTALL_HINT,
    )


def require_backward(registry_url: str) -> None:
    """Set the registry's global compatibility to BACKWARD, the Confluent default the deploy
    gate relies on: Apicurio starts with none, so every change would pass."""
    response = httpx.put(f"{registry_url}/config", json={"compatibility": "BACKWARD"},
                         headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
                         timeout=10)
    response.raise_for_status()


def start(port: int, workdir: Path, timeout_s: float = 120.0) -> ManagedProcess:
    """Start Apicurio on ``port`` (or reuse the one running there) with the gate's rule set."""
    process = apicurio_process(port, workdir)
    process.start(timeout_s)
    require_backward(url(port))
    return process
