"""``choreo up`` on the real stack: the drone workflow from its configuration file, an
instance killed with kill -9 is restarted under the same id, every delivery ends once, and
SIGTERM stops everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from choreo import topology
from consumers.workflow import WORKFLOW
from infra.process import pid_alive
from tests.factories import request_body
from tests.helpers import REPO, free_port, wait_for
from tests.pipeline import wait_terminal

pytestmark = pytest.mark.integration

ORDINAL = 7  # from the host name, as a StatefulSet's pod drone-7 would have it
VICTIM = f"drone-scheduler-{ORDINAL * 2}"  # two instances per host: 14 and 15


def _config(path: Path, ingestion_port: int | str) -> Path:
    """The shipped example with fewer instances (a 2-core machine) and this run's intake."""
    text = (REPO / "deploy" / "drone.toml").read_text()
    text = text.replace('url = "http://127.0.0.1:8000"', f'url = "http://127.0.0.1:{ingestion_port}"')
    for service in ("package", "delivery"):
        text = text.replace(f"[services.{service}]\nref = \"consumers.{service}:service\"\ninstances = 2",
                            f"[services.{service}]\nref = \"consumers.{service}:service\"\ninstances = 1")
    path.write_text(text)
    return path


def _env(config: Path, ordinal: int = ORDINAL) -> dict[str, str]:
    """Host drone-<ordinal>, with pid, log and state files of its own beside the test's config."""
    env = {k: v for k, v in os.environ.items() if k != "CHOREO_ORDINAL"}
    return {**env, "HOSTNAME": f"drone-{ordinal}", "CHOREO_DATA_DIR": str(config.parent / f"host-{ordinal}")}


def _status(config: Path, ordinal: int = ORDINAL) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "infra.cli", "up", "status", "--json", "--config",
                             str(config)], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=_env(config, ordinal))
    found: dict[str, Any] = json.loads(result.stdout)
    found["exit_code"] = result.returncode
    return found


def _by_name(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in found["processes"]}


@pytest.fixture()
def running_up(stack: None, tmp_path: Path, unique: str) -> Iterator[tuple[Path, str, subprocess.Popen[bytes]]]:
    topology.create(WORKFLOW)
    port = free_port()
    config = _config(tmp_path / f"drone-{unique}.toml", port)
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--config", str(config)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env(config))
    try:
        yield config, f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:  # the test failed before its own stop: drain, then make sure
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _submit(url: str, count: int) -> list[str]:
    ids = []
    with httpx.Client(base_url=url, timeout=30) as http:
        for n in range(count):
            response = http.post("/deliveries", json=request_body(weight_kg=1.0 + n % 10))
            assert response.status_code == 202, response.text
            ids.append(str(response.json()["delivery_id"]))
    return ids


def test_up_restarts_a_killed_instance_and_every_delivery_ends_once(
        running_up: tuple[Path, str, subprocess.Popen[bytes]]) -> None:
    config, url, up_proc = running_up
    started = wait_for(lambda: (s := _status(config))["healthy"] and s, timeout_s=120,
                       what="every process of choreo up running")
    names = set(_by_name(started))
    assert names == {"ingestion", "package-7", "delivery-7", "notifier-7", "supervisor-7",
                     "drone-scheduler-14", "drone-scheduler-15"}

    ids = _submit(url, 40)
    victim = _by_name(started)[VICTIM]
    os.kill(victim["pid"], signal.SIGKILL)
    ids += _submit(url, 40)

    restarted = wait_for(
        lambda: (p := _by_name(_status(config))[VICTIM])["restarts"] == 1 and p["state"] == "running" and p,
        timeout_s=60, what=f"{VICTIM} restarted")
    assert restarted["pid"] != victim["pid"] and pid_alive(restarted["pid"])
    assert restarted["last_exit"] == "killed by SIGKILL"

    counts = wait_terminal(set(ids), timeout_s=180)
    assert len(counts) == 80 and set(counts.values()) == {1}
    after = _status(config)
    assert after["healthy"] and after["exit_code"] == 0
    assert {n: p["restarts"] for n, p in _by_name(after).items() if p["restarts"]} == {VICTIM: 1}

    stopped = subprocess.run([sys.executable, "-m", "infra.cli", "up", "stop", "--config", str(config)],
                             cwd=REPO, capture_output=True, text=True, timeout=180, env=_env(config))
    assert stopped.returncode == 0, stopped.stderr
    assert up_proc.wait(10) == 0
    assert not any(pid_alive(p["pid"]) for p in after["processes"])
    assert _status(config)["exit_code"] == 1  # nothing runs any more, and status says so


def test_a_process_that_keeps_crashing_is_restarted_later_and_later(tmp_path: Path) -> None:
    """A service that cannot start (its module is missing) crash-loops with a doubling delay,
    and status says so instead of hiding it."""
    config = tmp_path / "ghost.toml"
    config.write_text('[services.ghost]\nref = "tests.services.no_such_module:service"\n'
                      "[restart]\ninitial_s = 0.5\nmax_s = 2\n")
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--no-prepare", "--config",
                                 str(config)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=_env(config))
    try:
        ghost = wait_for(lambda: (p := _by_name(_status(config)).get(f"ghost-{ORDINAL}")) and
                         p["restarts"] >= 4 and p, timeout_s=90, what="four restarts of ghost")
        assert ghost["last_exit"] == "exit code 1"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    delays = [line.rsplit(" ", 1)[1] for line in log.read_text().splitlines() if "next start in" in line]
    assert delays[:4] == ["0.5s", "1s", "2s", "2s"]


def test_a_registry_that_does_not_answer_stops_up_with_one_sentence(tmp_path: Path) -> None:
    """(A broker that does not answer is the same sentence, after the admin client's 30 s.)"""
    config = _config(tmp_path / "drone.toml", free_port())
    dead = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-m", "infra.cli", "up", "--config", str(config)], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**_env(config), "SCHEMA_REGISTRY_URL": dead})
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "cannot register the workflow's contracts: ConnectError" in run.stderr.replace("\n", "")
    assert not (config.parent / f"host-{ORDINAL}" / "up" / "drone" / "up.pid").exists()  # nothing started


def test_two_hosts_with_one_file_run_distinct_ids_and_share_the_work(stack: None, tmp_path: Path) -> None:
    """Hosts drone-3 and drone-4 (two supervisors on this machine, each with its own files and
    intake, ``${UP_TEST_INGESTION_PORT}`` from its environment) run one file."""
    topology.create(WORKFLOW)
    config = _config(tmp_path / "fleet.toml", "${UP_TEST_INGESTION_PORT}")
    ports = {3: free_port(), 4: free_port()}
    procs = {n: subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--config", str(config)],
                                 cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**_env(config, n), "UP_TEST_INGESTION_PORT": str(ports[n])})
             for n in ports}
    try:
        hosts = {n: wait_for(lambda n=n: (s := _status(config, n))["healthy"] and s, timeout_s=120,  # type: ignore[misc]
                             what=f"host drone-{n} running") for n in ports}
        names = {n: set(_by_name(found)) - {"ingestion"} for n, found in hosts.items()}
        assert names[3] == {"package-3", "drone-scheduler-6", "drone-scheduler-7", "delivery-3",
                            "notifier-3", "supervisor-3"}
        assert names[4] == {"package-4", "drone-scheduler-8", "drone-scheduler-9", "delivery-4",
                            "notifier-4", "supervisor-4"}
        ids = _submit(f"http://127.0.0.1:{ports[3]}", 30) + _submit(f"http://127.0.0.1:{ports[4]}", 30)
        counts = wait_terminal(set(ids), timeout_s=180)
        assert len(counts) == 60 and set(counts.values()) == {1}
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(120) for proc in procs.values()] == [0, 0]


def test_a_killed_up_leaves_its_processes_to_the_next_up_which_adopts_them(stack: None, tmp_path: Path) -> None:
    topology.create(WORKFLOW)
    config = tmp_path / "notifier.toml"
    config.write_text('[services.notifier]\nref = "consumers.notifier:service"\n')
    name = f"notifier-{ORDINAL}"
    started: list[subprocess.Popen[bytes]] = []
    service: list[int] = []

    def up(log: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / log, "wb") as out:
            started.append(subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--no-prepare",
                                             "--config", str(config)], cwd=REPO, stdout=out,
                                            stderr=subprocess.STDOUT, env=_env(config)))
        return started[-1]

    def running_pid() -> int:
        found = _status(config)
        return int(found["healthy"] and _by_name(found)[name]["pid"] or 0)

    try:
        first = up("first.log")
        service.append(wait_for(running_pid, timeout_s=60, what="notifier running"))
        first.kill()  # kill -9: no stop hook runs
        first.wait()
        assert pid_alive(service[0])
        second = up("second.log")
        assert wait_for(running_pid, timeout_s=60, what="the notifier adopted") == service[0]
        assert f"{name} adopted" in (tmp_path / "second.log").read_text()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        assert not pid_alive(service[0])
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in service:
            if pid > 0 and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
