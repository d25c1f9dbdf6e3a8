"""ManagedProcess, the lifecycle under every part of the stack, on small real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import process
from infra.process import ManagedProcess, StackError, cmdline_has, describe_exit, port_in_use, stop_all

SLEEPER = "import time; time.sleep(300)"


def sleeper(tmp_path: Path, name: str = "sleeper", ready: bool = True, code: str = SLEEPER,
            ports: list[tuple[str, int]] | None = None) -> ManagedProcess:
    marker = str(tmp_path / f"{name}.marker")
    return ManagedProcess(
        name=name, argv=[sys.executable, "-c", code, marker], workdir=tmp_path,
        ports=ports or [], ready=lambda: ready, marker=marker,
    )


@pytest.fixture()
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_second_start_reuses_the_running_process(tmp_path: Path) -> None:
    proc = sleeper(tmp_path)
    try:
        assert proc.start(timeout_s=5) is True
        pid = proc.pid()
        assert pid is not None
        assert proc.start(timeout_s=5) is False
        assert proc.pid() == pid
    finally:
        assert proc.stop(timeout_s=5) is True
    assert proc.pid() is None and not proc.pid_file.exists()
    assert proc.stop() is False


def test_stale_pid_files_are_ignored_and_never_kill_a_bystander(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    proc = sleeper(tmp_path)
    proc.pid_file.write_text(str(bystander.pid))  # a pid reused by an unrelated process
    assert proc.pid() is None and not proc.pid_file.exists()
    proc.pid_file.write_text(str(bystander.pid))
    assert proc.stop() is False
    assert bystander.poll() is None
    proc.pid_file.write_text("garbage")
    try:
        assert proc.start(timeout_s=5) is True
        assert proc.pid() not in (None, bystander.pid)
    finally:
        proc.stop(timeout_s=5)


def test_marker_matches_whole_arguments_only(tmp_path: Path) -> None:
    inner = tmp_path / "a" / "kafka-0" / "server.properties"
    outer = Path("/x") / str(inner).lstrip("/")  # same path under another root
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, str(outer)])
    try:
        deadline = time.monotonic() + 5  # argv shows in /proc a moment after Popen returns
        while not cmdline_has(proc.pid, str(outer)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cmdline_has(proc.pid, str(outer))
        assert not cmdline_has(proc.pid, str(inner))
    finally:
        proc.kill()
        proc.wait()


def test_exit_during_start_up_names_the_log(tmp_path: Path) -> None:
    proc = sleeper(tmp_path, ready=False, code="import sys; print('boom'); sys.exit(3)")
    with pytest.raises(StackError, match=r"exited with code 3 during start-up; see .*sleeper\.log"):
        proc.start(timeout_s=10)
    assert not proc.pid_file.exists()
    assert "boom" in proc.log_file.read_text()


def test_not_ready_in_time_stops_the_process_and_names_the_log(tmp_path: Path) -> None:
    proc = sleeper(tmp_path, ready=False)
    with pytest.raises(StackError, match=r"did not become ready within 0\.5s; see .*sleeper\.log"):
        proc.start(timeout_s=0.5)
    assert proc.pid() is None and not proc.pid_file.exists()


def test_missing_binary_is_a_clear_sentence(tmp_path: Path) -> None:
    proc = ManagedProcess(
        name="thing", argv=["no-such-binary-here"], workdir=tmp_path, ports=[],
        ready=lambda: True, marker="x", install_hint="Install it with: apt-get install thing.",
    )
    with pytest.raises(StackError, match="no-such-binary-here was not found on PATH. Install it"):
        proc.start(timeout_s=1)


def test_port_in_use_sees_listening_and_merely_bound_sockets() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert port_in_use("127.0.0.1", port)  # bound, not listening
        sock.listen()
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)


def test_taken_port_refuses_to_start(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = sleeper(tmp_path, ports=[("127.0.0.1", port)])
        with pytest.raises(StackError, match=rf"port 127\.0\.0\.1:{port} is already taken.*log: "):
            proc.start(timeout_s=5)
    assert proc.pid() is None


def test_stop_all_stops_everything_and_kills_who_ignores_sigterm(tmp_path: Path) -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    procs = [sleeper(tmp_path, "a"), sleeper(tmp_path, "b", code=stubborn)]
    for proc in procs:
        proc.start(timeout_s=5)
    assert stop_all(procs, timeout_s=1) == ["a", "b"]
    assert all(proc.pid() is None for proc in procs)


def test_kill_leaves_the_pid_file_like_a_crash(tmp_path: Path) -> None:
    proc = sleeper(tmp_path)
    proc.start(timeout_s=5)
    proc.kill()
    assert proc.pid_file.exists()
    assert proc.pid() is None  # and the stale file is recognised as such
    assert proc.start(timeout_s=5) is True
    proc.stop(timeout_s=5)


def test_the_chaos_run_tells_a_crash_from_a_running_instance(tmp_path: Path) -> None:
    """A service that dies by itself during a chaos run is a violation, named with how it
    ended (both supervisors once died of SIGSEGV and the run only showed stuck deliveries)."""
    from infra.chaos import died_on_their_own

    alive, crashed, stopped = (sleeper(tmp_path, name) for name in ("alive", "crashed", "stopped"))
    for proc in (alive, crashed, stopped):
        proc.start(timeout_s=5)
    try:
        for proc, sig in ((crashed, signal.SIGSEGV), (stopped, signal.SIGTERM)):
            pid = proc.pid()
            assert pid is not None
            os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while (crashed.running() or stopped.running()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # any new child reaps the dropped Popen objects of children that have ended
        subprocess.run(["true"], check=True)
        assert died_on_their_own([alive, crashed, stopped]) == [
            "crashed: killed by SIGSEGV", "stopped: killed by SIGTERM"]
    finally:
        stop_all([alive, crashed, stopped], timeout_s=5)


def test_how_a_process_ended_is_known_for_one_this_process_started(tmp_path: Path) -> None:
    """The return code of a process started here, whichever object for it stopped and reaped
    it (a cluster's nodes are made afresh for each call); none while it runs, and none for an
    object that runs nothing."""
    proc, twin, never = sleeper(tmp_path, "proc"), sleeper(tmp_path, "proc"), sleeper(tmp_path, "never")
    assert proc.exit_code(wait_s=0) is None and never.exit_code(wait_s=0) is None
    proc.start(timeout_s=5)
    try:
        assert proc.exit_code(wait_s=0.1) is None  # still running
        assert twin.start(timeout_s=5) is False  # the same process, adopted
        twin.stop(timeout_s=5)
        assert proc.exit_code(wait_s=0) == -signal.SIGTERM
        assert twin.exit_code(wait_s=0) == -signal.SIGTERM
    finally:
        stop_all([proc], timeout_s=5)


@pytest.mark.parametrize(("code", "said"), [
    (None, "how unknown"), (0, "exit code 0"), (3, "exit code 3"),
    (-signal.SIGKILL, "killed by SIGKILL"), (-(signal.SIGRTMIN + 2), f"killed by signal {signal.SIGRTMIN + 2}")])
def test_a_return_code_is_told_as_a_person_reads_it(code: int | None, said: str) -> None:
    assert describe_exit(code) == said


def test_the_record_of_processes_started_here_is_bounded(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``KEPT_CHILDREN`` records, the oldest ended processes' go; a running one's stays."""
    monkeypatch.setattr(process, "KEPT_CHILDREN", 2)
    monkeypatch.setattr(process, "_CHILDREN", {})
    alive = sleeper(tmp_path, "alive")
    alive.start(timeout_s=5)
    try:
        for n in range(3):
            quick = sleeper(tmp_path, f"quick{n}")
            quick.start(timeout_s=5)
            quick.stop(timeout_s=5)
        assert set(process._CHILDREN) == {alive.run_pid, quick.run_pid}
        assert quick.exit_code(wait_s=0) == -signal.SIGTERM
        assert alive.exit_code(wait_s=0.1) is None
    finally:
        stop_all([alive], timeout_s=5)
