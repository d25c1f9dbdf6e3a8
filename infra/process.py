"""A background process with a pid file, a log file and a readiness probe.

Every part of the local stack (broker, Redis, registry, services) is started the same
way, so start/stop/status behave identically: a second start reuses a live process, a
stale pid file is ignored, and a process that dies or never becomes ready yields one
clear sentence naming its log file instead of a hang.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class StackError(RuntimeError):
    """A part of the stack could not be started or stopped; the message is for a person."""


def port_listening(host: str, port: int) -> bool:
    """True when something accepts connections on ``host:port`` (a read-only probe)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on, or merely holds, ``host:port``.

    A connect probe alone misses a socket that is bound but not listening (the broker would
    then die with "Address already in use"), so a bind probe is tried too. SO_REUSEADDR
    matches what Java and Redis set, so connections lingering in TIME_WAIT after a stop do
    not count as "taken".
    """
    if port_listening(host, port):
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


# The processes this process started, by pid, kept: CPython hands a dropped ``Popen`` of a
# running child to the next ``Popen`` anyone makes, which reaps it, and how it ended is lost.
# A ``ManagedProcess`` is often made afresh for the same process (a cluster's nodes), so the
# record is kept here, not on the object.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
KEPT_CHILDREN = 256  # records kept at most: past it, the oldest of the ended processes' go


def _keep(proc: subprocess.Popen[bytes]) -> None:
    """Record a process started here, within ``KEPT_CHILDREN`` (a ``choreo up`` restarting a
    crashing member for days, a cluster's nodes made afresh at each restart)."""
    _CHILDREN[proc.pid] = proc
    excess = len(_CHILDREN) - KEPT_CHILDREN
    if excess > 0:
        for pid in [pid for pid, child in _CHILDREN.items() if child.poll() is not None][:excess]:
            del _CHILDREN[pid]


def _forget_ended(pid: int) -> None:
    """Drop the record of ``pid`` when its process has ended: the pid may be another's now."""
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]


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
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def pid_cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` (empty when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def cmdline_has(pid: int, marker: str) -> bool:
    """True when ``marker`` is a whole argument of ``pid``.

    Whole arguments, not substrings: ``/a/.stack/kafka-0/server.properties`` must not match a
    broker of ``/x/a/.stack``. Programs that rewrite their title into one argument (Redis shows
    ``redis-server 127.0.0.1:6379``) are split on spaces as well.
    """
    args = " ".join(pid_cmdline(pid)).split()
    wanted = marker.split()
    return any(args[i : i + len(wanted)] == wanted for i in range(len(args) - len(wanted) + 1))


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
    install_hint: str = ""  # how to get ``argv[0]`` when it is missing, for the error sentence
    # the process this object runs, started or adopted: how it ended is known when it is one
    # of ``_CHILDREN``
    run_pid: int = field(default=0, init=False, compare=False)

    @property
    def pid_file(self) -> Path:
        return self.workdir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def pid(self) -> int | None:
        """The pid of our live process, or None (a stale pid file is removed).

        A pid file is trusted only when the pid is alive *and* carries our marker, so a pid
        recycled by an unrelated process after a crash or reboot is never adopted or killed.
        """
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid_alive(pid) and cmdline_has(pid, self.marker):
            return pid
        _collect_own(pid)  # not a bare waitpid: the pid may be some other code's child
        self.pid_file.unlink(missing_ok=True)
        return None

    def running(self) -> bool:
        return self.pid() is not None

    def check_ports(self) -> None:
        """Raise one clear sentence when a port we need is held by someone else."""
        for host, port in self.ports:
            if port_in_use(host, port):
                raise StackError(
                    f"{self.name}: port {host}:{port} is already taken by another process; "
                    f"stop it or choose another port (log: {self.log_file})"
                )

    def start(self, timeout_s: float) -> bool:
        """Start unless already running; True when a new process was started.

        A process we started that exits or is not ready in time is stopped again before the
        error is raised, so a failed start leaves nothing half-running behind.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        running = self.pid()
        if running is not None:
            _forget_ended(running)
            self.run_pid = running
            self._wait_ready(timeout_s)
            return False
        self.check_ports()
        try:
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
        except FileNotFoundError:
            raise StackError(
                f"{self.name}: {self.argv[0]} was not found on PATH. {self.install_hint}".strip()
            ) from None
        _await_exec(proc, self.marker)
        self.pid_file.write_text(str(proc.pid))
        _forget_ended(self.run_pid)  # the one this object ran before, read or not by now
        _keep(proc)
        self.run_pid = proc.pid
        try:
            self._wait_ready(timeout_s, proc)
        except StackError:
            self.stop(timeout_s=5)
            raise
        return True

    def _wait_ready(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
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
            if time.monotonic() >= deadline:
                raise StackError(
                    f"{self.name} did not become ready within {timeout_s:g}s; see {self.log_file}"
                )
            time.sleep(0.2)

    def terminate(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` without waiting; the pid signalled, or None when nothing runs."""
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return None
        return pid

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> bool:
        """Stop gracefully, then forcefully; True when something was running."""
        pid = self.terminate(sig)
        if pid is None:
            return False
        self._reap_stopped(pid, timeout_s)
        return True

    def _reap_stopped(self, pid: int, timeout_s: float) -> None:
        """Wait for a signalled ``pid`` to go, SIGKILL it past ``timeout_s``, drop the pid file."""
        if not _wait_gone(pid, timeout_s):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_gone(pid, 10.0)
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """kill -9, for chaos tests: no shutdown hooks run (the pid file stays, as after a crash)."""
        pid = self.terminate(signal.SIGKILL)
        if pid is not None:
            _wait_gone(pid, 10.0)

    def exit_code(self, wait_s: float = 2.0) -> int | None:
        """The return code of the process this object runs (a signal's number negated),
        waited for up to ``wait_s``: a dying process drops its argv, and so reads as not
        running, before the kernel has its status (longer when it dumps core). None when it
        still runs, or is not a child of this process (adopted from an earlier run)."""
        child = _CHILDREN.get(self.run_pid)
        if child is None:
            return None
        try:
            return child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None


def stop_all(procs: Iterable[ManagedProcess], timeout_s: float = 30.0) -> list[str]:
    """Stop several processes at once: signal all first, then wait, so shutdowns overlap."""
    signalled = [(proc, proc.terminate()) for proc in procs]
    for proc, pid in signalled:
        if pid is not None:
            proc._reap_stopped(pid, timeout_s)
    return [proc.name for proc, pid in signalled if pid is not None]


def _await_exec(proc: subprocess.Popen[bytes], marker: str, timeout_s: float = 5.0) -> None:
    """Wait until the child's argv is visible in /proc.

    Popen may return (vfork) a moment before the kernel publishes the new program's argv;
    a pid() check in that moment would find no marker and take our own child for a stranger.
    """
    deadline = time.monotonic() + timeout_s
    while not cmdline_has(proc.pid, marker) and proc.poll() is None:
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        _reap(pid)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    _reap(pid)
    return True


def describe_exit(code: int | None) -> str:
    """A return code as a person reads it: ``exit code 1``, ``killed by SIGSEGV``, or that it
    is not known."""
    if code is None:
        return "how unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:  # the real-time signals between SIGRTMIN and SIGRTMAX have no name
        return f"killed by signal {-code}"


def _collect_own(pid: int) -> bool:
    """Collect the status of a dead process started here through its ``Popen``, which keeps
    it (``ManagedProcess.exit_code``); False when ``pid`` was not started here."""
    child = _CHILDREN.get(pid)
    if child is not None:
        child.poll()
    return child is not None


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    if _collect_own(pid):
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
