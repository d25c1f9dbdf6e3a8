"""A background process with a pid file, a log file and a readiness probe.

Every part of the local stack (broker, Redis, registry, services) is started the same
way, so start/stop/status behave identically: a second start reuses a live process, a
stale pid file is ignored, and a process that dies or never becomes ready yields one
clear sentence naming its log file instead of a hang.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class StackError(RuntimeError):
    """A part of the stack could not be started or stopped; the message is for a person."""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); treat it as dead
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class ManagedProcess:
    """One long-running process of the stack, identified by its pid file and a marker in its argv."""

    name: str
    argv: Sequence[str]
    workdir: Path
    ports: Sequence[tuple[str, int]]
    ready: Callable[[], bool]
    marker: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid_file(self) -> Path:
        return self.workdir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def pid(self) -> int | None:
        """The pid of our live process, or None (a stale pid file is removed)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid_alive(pid) and self.marker in pid_cmdline(pid):
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def running(self) -> bool:
        return self.pid() is not None

    def start(self, timeout_s: float) -> bool:
        """Start unless already running; True when a new process was started."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.pid() is not None:
            self._wait_ready(timeout_s)
            return False
        for host, port in self.ports:
            if port_in_use(host, port):
                raise StackError(
                    f"{self.name}: port {host}:{port} is already taken by another process; "
                    f"stop it or choose another port (log: {self.log_file})"
                )
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                list(self.argv),
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.env},
            )
        self.pid_file.write_text(str(proc.pid))
        self._wait_ready(timeout_s, proc)
        return True

    def _wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise StackError(
                    f"{self.name} exited with code {proc.returncode} during start-up; "
                    f"see {self.log_file}"
                )
            try:
                if self.ready():
                    return
            except Exception:  # readiness probes fail in many ways while starting
                pass
            time.sleep(0.2)
        raise StackError(
            f"{self.name} did not become ready within {timeout_s:.0f}s; see {self.log_file}"
        )

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> bool:
        """Stop gracefully, then forcefully; True when something was running."""
        pid = self.pid()
        if pid is None:
            return False
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.1)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid):
                _reap(pid)
                time.sleep(0.05)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """kill -9, for chaos tests: no shutdown hooks run."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            while pid_alive(pid):
                _reap(pid)
                time.sleep(0.05)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
