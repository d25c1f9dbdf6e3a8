"""The three-node mode: replication factor 3 with min ISR 2 survives one kill -9, not two.

The cluster is the one ``choreo stack start --nodes 3`` runs (infra.stack.kafka_cluster):
three brokers on 19092/19094/19096 and a dedicated controller on 19093, with a data dir of
this test's own. Its ports are fixed, so concurrent runs on one machine take turns (flock).
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from choreo.config import REPO_ROOT, Settings
from infra.kafka import KafkaCluster
from infra.process import port_in_use
from infra.stack import kafka_cluster
from tests.services.coordinator_move import offsets_leadership, offsets_partition

pytestmark = pytest.mark.integration

TOPIC = "t.rf3"


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[KafkaCluster]:
    with open("/tmp/choreo-kafka-cluster3.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ports are fixed: one three-node test at a time
        cfg = Settings(CHOREO_DATA_DIR=str(tmp_path))
        cluster = kafka_cluster(cfg, nodes=3)
        taken = [p for p in range(19092, 19098) if port_in_use("127.0.0.1", p)]
        assert not taken, f"ports {taken} are taken; is another three-node cluster running?"
        try:
            yield cluster
        finally:
            cluster.stop()


def produce_one(bootstrap: str, value: bytes, *, retry: bool, timeout_ms: int) -> KafkaError | None:
    """Produce with acks=all and return what the delivery callback reported.

    ``retry=False`` hands the broker's own answer to the callback instead of retrying it
    until the message times out (NOT_ENOUGH_REPLICAS is retriable).
    """
    producer = Producer({
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "enable.idempotence": retry,
        "retries": 2_147_483_647 if retry else 0,
        "message.timeout.ms": timeout_ms,
        "request.timeout.ms": min(timeout_ms, 5000),
        "log_level": 0,  # refused connections to the killed nodes are the point of the test
    })
    reports: list[KafkaError | None] = []
    producer.produce(TOPIC, value=value, on_delivery=lambda err, _msg: reports.append(err))
    producer.flush(timeout_ms / 1000 + 10)
    assert len(reports) == 1, "the delivery callback must fire, never hang"
    return reports[0]


def partition(admin: AdminClient) -> tuple[int, list[int]]:
    meta = admin.list_topics(TOPIC, timeout=10).topics[TOPIC].partitions[0]
    return meta.leader, sorted(meta.isrs)


def topic_min_isr(admin: AdminClient, timeout_s: float = 30) -> str:
    """The topic's effective min.insync.replicas (retried: a broker may not know the topic yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        future = next(iter(admin.describe_configs([ConfigResource("topic", TOPIC)]).values()))
        try:
            return str(future.result()["min.insync.replicas"].value)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def wait_isr(admin: AdminClient, size: int, timeout_s: float = 30) -> tuple[int, list[int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            leader, isr = partition(admin)
        except KeyError:  # the topic is not in this broker's metadata yet
            leader, isr = -1, []
        if len(isr) == size or time.monotonic() > deadline:
            return leader, isr
        time.sleep(0.3)


def rss_mib(pid: int | None) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def test_rf3_survives_one_kill_and_rejects_writes_when_two_are_down(
    cluster: KafkaCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    begin = time.monotonic()
    started = cluster.start(timeout_s=90)
    cold_start = time.monotonic() - begin
    assert started == ["kafka-controller", "kafka-0", "kafka-1", "kafka-2"]
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers, "log_level": 0})
    assert len(admin.list_topics(timeout=10).brokers) == 3

    admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=3)])[TOPIC].result(30)
    assert wait_isr(admin, 3)[1] == [1, 2, 3]  # every broker has learnt of the new topic
    assert topic_min_isr(admin) == "2", "the cluster default min ISR must be 2"
    assert produce_one(cluster.bootstrap_servers, b"all-up", retry=True, timeout_ms=20_000) is None
    leader, isr = partition(admin)
    assert isr == [1, 2, 3]
    memory = {p.name: rss_mib(p.pid()) for p in cluster.processes()}

    # kill -9 the leader: the worst single failure (a new leader must be elected)
    first = cluster.node(leader - 1)
    first.kill()
    begin = time.monotonic()
    err = produce_one(cluster.bootstrap_servers, b"one-down", retry=True, timeout_ms=30_000)
    one_down = time.monotonic() - begin
    assert err is None, f"acks=all must succeed with 2 of 3 replicas in sync: {err}"
    leader, isr = wait_isr(admin, 2)
    assert len(isr) == 2 and leader in isr

    # kill -9 the new leader too: one replica left, below min ISR 2
    second = cluster.node(leader - 1)
    second.kill()
    leader, isr = wait_isr(admin, 1)
    assert len(isr) == 1
    begin = time.monotonic()
    err = produce_one(cluster.bootstrap_servers, b"two-down", retry=False, timeout_ms=15_000)
    two_down = time.monotonic() - begin
    assert err is not None and err.code() == KafkaError.NOT_ENOUGH_REPLICAS, err

    # restart both: the cluster accepts acks=all writes again
    begin = time.monotonic()
    restarted = cluster.start(timeout_s=90)
    assert sorted(restarted) == sorted([first.name, second.name])
    err = produce_one(cluster.bootstrap_servers, b"healed", retry=True, timeout_ms=30_000)
    healed = time.monotonic() - begin
    assert err is None, err

    with capsys.disabled():
        print(
            f"\n[stack] three nodes: cold start {cold_start:.1f}s; acks=all delivered "
            f"{one_down:.1f}s after kill -9 of the leader; with two down NOT_ENOUGH_REPLICAS "
            f"after {two_down:.1f}s; restart + first acks=all write {healed:.1f}s; "
            f"RSS MiB {memory}"
        )


def test_committed_offsets_are_read_across_a_coordinator_move(cluster: KafkaCluster) -> None:
    """The supervisor's release and the ingestion's admission read groups' committed offsets
    every period. When a broker comes back, the controller hands its ``__consumer_offsets``
    partitions back to it (preferred-leader election) and the groups' coordinators move;
    read through the admin client, the next read then killed the process with a segmentation
    fault (librdkafka #5040: both supervisors of a chaos run at once). Reading with
    ``choreo.kafka.CommittedOffsets`` finds the new coordinator and goes on."""
    cluster.start(timeout_s=90)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers, "log_level": 0})
    admin.create_topics([NewTopic(TOPIC, num_partitions=1, replication_factor=3)])[TOPIC].result(30)
    group = "coordinator-move"
    member = Consumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": group,
                       "enable.auto.commit": False, "log_level": 0})
    deadline = time.monotonic() + 60
    while True:  # a fresh cluster creates __consumer_offsets on the first request for a group
        try:
            member.commit(offsets=[TopicPartition(TOPIC, 0, 7)], asynchronous=False)
            break
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    member.close()
    partition = offsets_partition(admin, group)
    # on a fresh cluster the preferred replica leads: stop it and start it again, so that a
    # follower leads until the preferred-leader election moves the coordinator back
    leader, preferred, _ = offsets_leadership(admin, partition)
    assert leader == preferred
    cluster.node(leader - 1).stop(timeout_s=30)
    cluster.start(timeout_s=90)
    deadline = time.monotonic() + 60
    while offsets_leadership(admin, partition)[2] < 3 and time.monotonic() < deadline:
        time.sleep(0.3)
    leader, preferred, in_sync = offsets_leadership(admin, partition)
    assert leader != preferred and in_sync == 3

    done = subprocess.run(
        [sys.executable, "-m", "tests.services.coordinator_move", cluster.bootstrap_servers, group,
         TOPIC, str(partition)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}; stderr tail:\n{done.stderr[-2000:]}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["coordinator_was"] == leader and seen["coordinator_now"] == preferred
    assert seen["before"] == 7 and seen["after"] == [7] * 5
