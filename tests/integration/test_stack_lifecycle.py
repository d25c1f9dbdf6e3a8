"""The local stack's lifecycle, as a person drives it: ``choreo stack start|stop|status``.

Every test runs its own stack (own data dir, own free ports) through the real CLI in a
subprocess, so the shared stack on 9092/6379 is never touched and the settings the CLI
reads from the environment are exercised too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from infra.kafka import KafkaCluster
from infra.process import port_listening
from infra.redis_server import redis_process
from tests.helpers import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHOREO = [str(Path(sys.executable).parent / "choreo")]  # the console script a person runs
KAFKA_LIBS = Path(os.environ.get("KAFKA_LIBS", Path.home() / ".cache/dronepipe/kafka-4.1.2/libs"))


def free_port_pair() -> int:
    """A free port whose successor is free too (a Kafka node needs broker and controller ports)."""
    for _ in range(50):
        port = free_port()
        if port < 65535 and not port_listening("127.0.0.1", port + 1):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no pair of adjacent free ports")


@dataclass
class Run:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def message(self) -> str:
        """stderr as one line: the CLI's console hard-wraps long sentences at 80 columns."""
        return self.err.replace("\n", "")


@dataclass
class IsolatedStack:
    """A stack of our own: data dir under tmp_path, free ports, env for the CLI."""

    data_dir: Path
    kafka_port: int
    redis_port: int
    registry_port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "REDIS_URL": self.redis_url,
            "SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{self.registry_port}",
            "CHOREO_DATA_DIR": str(self.data_dir),
            "CHOREO_START_TIMEOUT": "90",
            "CHOREO_EXTERNAL": "",  # every part is this stack's own, whatever the run uses
            **extra,
        }

    def choreo(self, *args: str, timeout_s: float = 180, **env: str) -> Run:
        begin = time.monotonic()
        proc = subprocess.run(
            [*CHOREO, "stack", *args], env=self.env(**env), capture_output=True, text=True,
            timeout=timeout_s, cwd=REPO, check=False,
        )
        run = Run(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - begin)
        assert "Traceback" not in run.err, run.err  # a person never sees a traceback
        return run

    def status(self) -> tuple[int, dict[str, dict[str, object]]]:
        run = self.choreo("status", "--json")
        return run.code, {part["name"]: part for part in json.loads(run.out)}

    def pids(self) -> dict[str, object]:
        return {name: part["pid"] for name, part in self.status()[1].items()}


@pytest.fixture()
def isolated(tmp_path: Path) -> Iterator[IsolatedStack]:
    registry_port = free_port()
    stack = IsolatedStack(tmp_path / "stack", free_port_pair(), free_port(), registry_port)
    yield stack
    stack.choreo("stop")  # always stop what we started, whatever the test did


def started_names(run: Run) -> list[str]:
    line = next(line for line in run.err.splitlines() if line.startswith("started:"))
    return [] if "nothing" in line else [n.strip() for n in line.split(":", 1)[1].split(",")]


def test_start_twice_is_harmless_and_reuses_the_processes(isolated: IsolatedStack) -> None:
    first = isolated.choreo("start")
    assert first.code == 0, first.err
    assert {"kafka-0", "redis"} <= set(started_names(first))
    pids = isolated.pids()

    second = isolated.choreo("start")
    assert second.code == 0, second.err
    assert started_names(second) == [], second.err
    assert isolated.pids() == pids
    assert second.seconds < 15, "a second start must not wait for anything new"


def test_status_tells_the_truth(isolated: IsolatedStack) -> None:
    code, parts = isolated.status()
    assert code == 1 and not any(p["running"] for p in parts.values())

    assert isolated.choreo("start").code == 0
    code, parts = isolated.status()
    assert code == 0 and all(p["running"] for p in parts.values()), parts

    # one part down (stopped behind the CLI's back): status says which, exit code 1
    redis_process(isolated.redis_url, isolated.data_dir).stop()
    code, parts = isolated.status()
    assert code == 1
    assert parts["redis"]["running"] is False and parts["redis"]["pid"] is None
    assert parts["kafka-0"]["running"] is True

    # start brings back exactly what is missing
    again = isolated.choreo("start")
    assert again.code == 0 and started_names(again) == ["redis"], again.err
    assert isolated.status()[0] == 0


def test_stop_then_start_keeps_the_data(isolated: IsolatedStack, unique: str) -> None:
    assert isolated.choreo("start").code == 0
    topic = f"t.lifecycle.{unique}"
    admin = AdminClient({"bootstrap.servers": isolated.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": isolated.bootstrap, "acks": "all"})
    producer.produce(topic, value=b"before-restart")
    assert producer.flush(10) == 0
    redis.Redis.from_url(isolated.redis_url).set(f"k:{unique}", "kept")
    old_pids = isolated.pids()

    stop = isolated.choreo("stop")
    assert stop.code == 0 and "kafka-0" in stop.err and "redis" in stop.err, stop.err
    code, parts = isolated.status()
    assert code == 1 and not any(p["running"] for p in parts.values())
    assert not port_listening("127.0.0.1", isolated.kafka_port)
    assert not port_listening("127.0.0.1", isolated.redis_port)
    assert "nothing" in isolated.choreo("stop").err  # stopping a stopped stack is harmless

    start = isolated.choreo("start")
    assert start.code == 0, start.err
    assert {"kafka-0", "redis"} <= set(started_names(start))
    assert isolated.status()[0] == 0
    assert isolated.pids()["kafka-0"] != old_pids["kafka-0"]
    # the broker's log and Redis's append-only file survived the restart
    assert redis.Redis.from_url(isolated.redis_url).get(f"k:{unique}") == b"kept"
    consumer = Consumer({"bootstrap.servers": isolated.bootstrap, "group.id": unique,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    msg = None
    deadline = time.monotonic() + 30
    while msg is None and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
    consumer.close()
    assert msg is not None and msg.error() is None and msg.value() == b"before-restart"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_stale_pid_files_do_not_confuse_start_or_stop(isolated: IsolatedStack) -> None:
    assert isolated.choreo("start").code == 0
    assert isolated.choreo("stop").code == 0
    # a crash leaves pid files behind; by now the pids are dead, or reused by someone else
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        kafka_pid_file = isolated.data_dir / "kafka-0" / "kafka-0.pid"
        redis_pid_file = isolated.data_dir / "redis" / "redis.pid"
        kafka_pid_file.write_text(str(dead_pid()))
        redis_pid_file.write_text(str(bystander.pid))

        code, parts = isolated.status()
        assert code == 1 and not parts["kafka-0"]["running"] and not parts["redis"]["running"]
        assert isolated.choreo("stop").code == 0
        assert bystander.poll() is None, "stop must never kill an unrelated process"

        # a garbage pid file is just as harmless
        kafka_pid_file.write_text("not a pid\n")
        start = isolated.choreo("start")
        assert start.code == 0, start.err
        assert {"kafka-0", "redis"} <= set(started_names(start))
        pids = isolated.pids()
        assert pids["redis"] not in (None, bystander.pid)
        assert int(redis_pid_file.read_text()) == pids["redis"]
        assert isolated.status()[0] == 0
        assert isolated.choreo("stop").code == 0
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# ---- clear errors: one sentence, non-zero exit, no hang, no traceback --------------------


def test_missing_java_is_one_clear_sentence(isolated: IsolatedStack, tmp_path: Path) -> None:
    no_java = tmp_path / "bin-without-java"
    no_java.mkdir()
    run = isolated.choreo("start", timeout_s=60, PATH=str(no_java))
    assert run.code != 0
    assert run.message.startswith("error: Java was not found on PATH"), run.err
    assert "Java 17" in run.message
    assert run.seconds < 30
    # status and stop need no Java
    assert isolated.choreo("status", PATH=str(no_java)).code == 1
    assert isolated.choreo("stop", PATH=str(no_java)).code == 0


def test_kafka_port_taken_names_the_port_and_the_log(isolated: IsolatedStack) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", isolated.kafka_port))
        squatter.listen()
        run = isolated.choreo("start", timeout_s=60)
    assert run.code != 0
    log = isolated.data_dir / "kafka-0" / "kafka-0.log"
    assert f"port 127.0.0.1:{isolated.kafka_port} is already taken" in run.message, run.err
    assert str(log) in run.message, run.err
    assert run.seconds < 30
    assert isolated.status()[0] == 1  # nothing was left half-started


def test_redis_port_held_without_listening_is_detected(isolated: IsolatedStack) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", isolated.redis_port))  # bound, not listening
        run = isolated.choreo("start", timeout_s=120)
    assert run.code != 0
    assert f"port 127.0.0.1:{isolated.redis_port} is already taken" in run.message, run.err
    assert str(isolated.data_dir / "redis" / "redis.log") in run.message, run.err


def test_broker_not_up_in_time_fails_fast_with_the_log(isolated: IsolatedStack) -> None:
    run = isolated.choreo("start", timeout_s=60, CHOREO_START_TIMEOUT="0.5")
    assert run.code != 0
    assert "Kafka did not answer a metadata request within 0.5s" in run.message, run.err
    assert str(isolated.data_dir / "kafka-0" / "kafka-0.log") in run.message, run.err
    assert run.seconds < 30
    # the broker that was too slow is not left running behind the error
    assert not isolated.status()[1]["kafka-0"]["running"]
    assert not port_listening("127.0.0.1", isolated.kafka_port)


# ---- start-up times (figures for people, printed; bounds are loose) ----------------------


def test_cold_and_warm_start_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = KafkaCluster(data_dir=tmp_path / "timing", libs=KAFKA_LIBS, base_port=free_port_pair())
    try:
        begin = time.monotonic()
        assert cluster.start(timeout_s=90) == ["kafka-0"]  # fresh dir: includes the format
        cold = time.monotonic() - begin
        cluster.stop()
        begin = time.monotonic()
        assert cluster.start(timeout_s=90) == ["kafka-0"]  # existing dir
        warm = time.monotonic() - begin
        begin = time.monotonic()
        assert cluster.start(timeout_s=90) == []  # already running
        reuse = time.monotonic() - begin
    finally:
        cluster.stop()
    with capsys.disabled():
        print(f"\n[stack] single Kafka node: cold start {cold:.1f}s (with format), "
              f"warm start {warm:.1f}s, start when running {reuse * 1000:.0f}ms")
    assert cold < 60 and warm < 60 and reuse < 5
