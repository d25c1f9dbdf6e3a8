"""Registry processes of their own (own port, own store topic): restart, kill -9, two at once.

Each test runs isolated instances on a fresh ``_schemas``-like topic so the shared registry
is never disturbed; they are real processes started exactly as the stack starts its own.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from choreo.config import settings
from choreo.kafka import admin
from infra.process import ManagedProcess
from registry import errors
from infra.registry_process import registry_process
from registry.state import State, config_record
from registry.store import KafkaStore
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.integration

CT = {"Content-Type": "application/vnd.schemaregistry.v1+json"}


def schema(n: int, extra: str = "") -> str:
    """Distinct per (n, extra), and any two are BACKWARD compatible (one optional field each)."""
    return json.dumps({"type": "record", "name": "S", "namespace": "burst",
                       "fields": [{"name": "id", "type": "string"},
                                  {"name": f"f{n}{extra}", "type": ["null", "int"], "default": None}]})


Starter = Callable[..., tuple[ManagedProcess, str]]


@pytest.fixture()
def instances(stack: None, tmp_path: Path, unique: str) -> Iterator[Starter]:
    """Start registry processes on one private topic; all are killed at the end."""
    started: list[ManagedProcess] = []
    topic = f"_schemas_test_{unique}"
    cfg = settings().model_copy(update={"data_dir": tmp_path})

    def start(name: str = "a", port: int | None = None, **env: str) -> tuple[ManagedProcess, str]:
        port = port or free_port()
        proc = registry_process(cfg, port=port, topic=topic, name=f"registry-{name}",
                                env={"SCHEMA_REGISTRY_LEASE_MS": "1500", **env})
        proc.start(60)
        started.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    yield start
    for proc in started:
        proc.kill()
    drop_topic(topic)


def drop_topic(topic: str) -> None:
    """Private store topics are test litter once the test is over."""
    client = admin()  # keep the handle alive until the futures resolve
    for future in client.delete_topics([topic], operation_timeout=10).values():
        future.result(timeout=15)


def everything(url: str) -> dict[tuple[str, int], tuple[int, str]]:
    """(subject, version) -> (id, schema), as one instance sees it."""
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    with httpx.Client(base_url=url, timeout=30) as http:
        for subject in http.get("/subjects").json():
            for version in http.get(f"/subjects/{subject}/versions").json():
                got = http.get(f"/subjects/{subject}/versions/{version}").json()
                seen[(subject, version)] = (got["id"], got["schema"])
    return seen


def test_restart_keeps_every_id_and_version(instances: Starter) -> None:
    proc, url = instances()
    with httpx.Client(base_url=url, timeout=30) as http:
        for n in range(6):
            assert http.post(f"/subjects/s{n % 3}/versions", json={"schema": schema(n)}, headers=CT).status_code == 200
        assert http.put("/config/s0", json={"compatibility": "NONE"}, headers=CT).status_code == 200
        assert http.delete("/subjects/s2/versions/1").json() == 1
        # IMPORT mode: ids and versions chosen by the caller (migrating from another registry)
        assert http.put("/mode/imp", json={"mode": "IMPORT"}, headers=CT).json() == {"mode": "IMPORT"}
        imported = http.post("/subjects/imp/versions", json={"schema": schema(50), "id": 500, "version": 7}, headers=CT)
        assert imported.json() == {"id": 500}
        clash = http.post("/subjects/imp/versions", json={"schema": schema(51), "id": 500}, headers=CT)
        assert (clash.status_code, clash.json()["error_code"]) == (422, 42205)
        assert http.put("/mode/imp", json={"mode": "READWRITE"}, headers=CT).status_code == 200
        refused = http.post("/subjects/imp/versions", json={"schema": schema(52), "id": 900}, headers=CT)
        assert (refused.status_code, refused.json()["error_code"]) == (422, 42205)
    before = everything(url)
    proc.stop()
    proc.start(60)
    assert everything(url) == before
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/config/s0").json()["compatibilityLevel"] == "NONE"
        assert http.get("/subjects/s2/versions").json() == [2]
        assert http.get("/subjects/imp/versions/7").json()["id"] == 500
        # a new schema gets a new id, above all earlier ones; the old ones are not reused
        new_id = http.post("/subjects/s9/versions", json={"schema": schema(99)}, headers=CT).json()["id"]
        assert new_id > max(i for i, _ in before.values())
        assert http.post("/subjects/s9/versions", json={"schema": schema(0)}, headers=CT).json()["id"] == \
            before[("s0", 1)][0]


def test_kill_during_a_registration_burst_loses_nothing_acknowledged(instances: Starter) -> None:
    proc, url = instances()
    acknowledged: list[tuple[str, str, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def burst(worker: int) -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            n = 0
            while not stop.is_set():
                # every worker also races the others on one shared schema
                body = schema(0, "shared") if n % 5 == 0 else schema(worker * 1000 + n)
                subject = f"w{worker % 3}"
                try:
                    answer = http.post(f"/subjects/{subject}/versions", json={"schema": body}, headers=CT)
                except httpx.HTTPError:
                    return  # the registry died under us: this one was never acknowledged
                if answer.status_code == 200:
                    with lock:
                        acknowledged.append((subject, body, answer.json()["id"]))
                n += 1

    threads = [threading.Thread(target=burst, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    # killed in the middle of the burst, once it has acknowledged some (each write is a
    # transaction the instance then reads back: slow on a loaded machine)
    wait_for(lambda: len(acknowledged) > 20, 30, 0.05, "twenty writes acknowledged")
    proc.kill()
    stop.set()
    for t in threads:
        t.join()
    proc.start(60)

    ids_of: dict[str, set[int]] = {}
    for _, body, schema_id in acknowledged:
        ids_of.setdefault(body, set()).add(schema_id)
    assert all(len(ids) == 1 for ids in ids_of.values())
    with httpx.Client(base_url=url, timeout=30) as http:
        for subject, body, schema_id in acknowledged:
            found = http.post(f"/subjects/{subject}", json={"schema": body}, headers=CT)
            assert found.status_code == 200 and found.json()["id"] == schema_id, (subject, found.text)
    stored = everything(url)
    id_to_schema: dict[int, str] = {}
    for schema_id, text in stored.values():
        assert id_to_schema.setdefault(schema_id, text) == text  # one id, one schema
    assert len(set(id_to_schema.values())) == len(id_to_schema)  # one schema, one id
    for subject in {s for s, _ in stored}:
        versions = sorted(v for s, v in stored if s == subject)
        assert versions == list(range(1, len(versions) + 1))


def test_two_instances_one_writer(instances: Starter) -> None:
    leader, leader_url = instances("a")
    _, follower_url = instances("b", SCHEMA_REGISTRY_LEADER_ELIGIBLE="false")
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{leader_url}/_health").json()["leader"] is True
        health = http.get(f"{follower_url}/_health").json()
        assert health["leader"] is False and health["leader_url"] == leader_url
        # a write sent to the follower is forwarded, and the follower reads it right after
        first = http.post(f"{follower_url}/subjects/x/versions", json={"schema": schema(1)}, headers=CT).json()["id"]
        assert http.get(f"{follower_url}/subjects/x/versions/latest").json()["id"] == first
        ids: list[int] = []
        lock = threading.Lock()

        def register(n: int) -> None:
            target = leader_url if n % 2 else follower_url
            answer = httpx.post(f"{target}/subjects/y{n % 4}/versions", json={"schema": schema(100 + n)},
                                headers=CT, timeout=30)
            assert answer.status_code == 200, answer.text
            with lock:
                ids.append(answer.json()["id"])

        threads = [threading.Thread(target=register, args=(n,)) for n in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(ids) == 12 and len(set(ids)) == 12 and first not in ids
        assert everything(leader_url) == everything(follower_url)

        # without a leader the follower refuses writes clearly, and still serves reads
        leader.stop()
        refused = http.post(f"{follower_url}/subjects/x/versions", json={"schema": schema(2)}, headers=CT)
        assert refused.status_code == 500 and refused.json()["error_code"] == 50003
        assert "leader" in refused.json()["message"]
        assert http.get(f"{follower_url}/subjects/x/versions/latest").json()["id"] == first
        assert http.post(f"{follower_url}/subjects/x/versions", json={"schema": schema(1)},
                         headers=CT).json()["id"] == first  # already registered: no write needed


def test_a_new_instance_takes_over_when_the_leader_dies(instances: Starter) -> None:
    leader, leader_url = instances("a")
    _, other_url = instances("b")
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{other_url}/_health").json()["leader"] is False
        before = http.post(f"{other_url}/subjects/t/versions", json={"schema": schema(1)}, headers=CT).json()["id"]
        leader.kill()
        deadline = time.monotonic() + 15
        while not http.get(f"{other_url}/_health").json()["leader"]:
            assert time.monotonic() < deadline, "no takeover"
            time.sleep(0.2)
        after = http.post(f"{other_url}/subjects/t/versions", json={"schema": schema(2)}, headers=CT).json()["id"]
        assert after > before


def test_a_fenced_writer_cannot_append(stack: None, unique: str) -> None:
    """The safety half of single-writer: a second writer's init fences the first at the broker."""
    topic = f"_schemas_fence_{unique}"
    bootstrap = settings().kafka_bootstrap_servers
    old, new = KafkaStore(bootstrap, topic, State()), KafkaStore(bootstrap, topic, State())
    old.ensure_topic()
    for store in (old, new):
        store.start()
    try:
        old.append([config_record(None, {"compatibilityLevel": "FULL"})])
        new.prepare_writer()  # e.g. a new leader while the old one was paused
        with pytest.raises(errors.RegistryError) as fenced:
            old.append([config_record(None, {"compatibilityLevel": "NONE"})])
        assert fenced.value.error_code == errors.STORE_ERROR
        new.append([config_record("s", {"compatibilityLevel": "FORWARD"})])
        assert new.state.configs == {None: {"compatibilityLevel": "FULL"}, "s": {"compatibilityLevel": "FORWARD"}}
        assert old.wait_position(new.position, timeout_s=10)
        assert old.state.configs == new.state.configs  # the fenced write never became visible
    finally:
        old.stop()
        new.stop()
        drop_topic(topic)
