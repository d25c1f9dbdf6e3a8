"""The runtime on the real stack: typed handlers, exactly-once output, dead letters, retries,
crash recovery and schema evolution, with services as real processes."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
import redis
from confluent_kafka import Producer
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from choreo.config import settings
from choreo.dedupe import sighting
from choreo.envelope import MAX_ATTEMPT, Envelope, now_ms
from choreo.kafka import CommittedOffsets, ensure_topics
from choreo.publisher import Publisher
from choreo.serde import Encoder, registry_client
from choreo.state import Begin, StateTable, StepStatus
from schemas.models import DeliveryRequested, DeliveryShipped, PackageFailed
from tests.factories import delivery_request
from tests.helpers import ServiceProcess, free_port, read_topic, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture()
def probe_topic(stack: None, unique: str) -> str:
    topic = f"t.probe.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq", f"retry.probe-{topic}.{topic}", "recovery"],
                  partitions=3)
    return topic


@pytest.fixture()
def services() -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for proc in started:
        proc.kill()


def _publish(requests: list, topic: str) -> list[str]:
    publisher = Publisher("test")
    ids = [str(uuid.uuid4()) for _ in requests]
    for request, event_id in zip(requests, ids):
        publisher.publish(request, event_id, topic=topic)
    publisher.flush(30)
    return ids


def _raw_producer() -> Producer:
    return Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})


def test_ten_line_subscriber_receives_typed_events_and_emits(services: list[ServiceProcess],
                                                              stack: None, unique: str) -> None:
    topic = f"t.shipped.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq"], partitions=3)
    publisher = Publisher("test")
    shipped = [DeliveryShipped(delivery_id=f"d{i}", package_id=f"p{i}", drone_id=f"drone-{i}",
                               shipped_at=datetime.now(UTC)) for i in range(30)]
    ids = {}
    for event in shipped:
        ids[event.delivery_id] = publisher.publish(event, str(uuid.uuid4()), topic=topic).event_id
    publisher.flush(30)
    services.append(ServiceProcess("tests.services.notifier_copy:service", env={"PROBE_TOPIC": topic},
                                   workflow="").start())
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 30 and r, what="30 outputs")
    assert len(out) == 30
    for record in out:
        env = record.envelope
        assert env is not None
        assert env.causation_id == ids[env.correlation_id]  # caused by its own input
        assert env.hops == 1 and env.event_type == "DroneReleased"
    assert {r.key for r in out} == {f"d{i}".encode() for i in range(30)}


def test_batches_that_write_nothing_commit_plainly_between_transactional_ones(
        services: list[ServiceProcess], stack: None, unique: str) -> None:
    # one partition, one input per batch, an output for every other input: each plain commit
    # follows a transactional one whose markers may land after it (the coordinator keeps the
    # newer by its place in the offsets log); the group ends at the end of the topic
    topic, port = f"t.sometimes.{unique}", free_port()
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq"], partitions=1)
    publisher = Publisher("test")
    for i in range(40):
        publisher.publish(DeliveryShipped(delivery_id=f"d{i}", package_id=f"p{i}", drone_id=f"drone-{i}",
                                          shipped_at=datetime.now(UTC)), str(uuid.uuid4()), topic=topic)
    publisher.flush(30)
    services.append(ServiceProcess("tests.services.sometimes:service", env={"PROBE_TOPIC": topic},
                                   workflow="", args=["--metrics-port", str(port)]).start())
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 20 and r, what="20 outputs")
    assert sorted(r.key for r in out) == sorted(f"d{i}".encode() for i in range(0, 40, 2))
    offsets = CommittedOffsets()
    try:
        wait_for(lambda: offsets.of(f"sometimes-{topic}", [(topic, 0)])[(topic, 0)] == 40, what="offset 40")
        time.sleep(3)  # every marker is written by now: the group still reads on after the last input
        assert offsets.of(f"sometimes-{topic}", [(topic, 0)])[(topic, 0)] == 40
    finally:
        offsets.close()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    commits = {how: float(line.rsplit(" ", 1)[1]) for how in ("plain", "transaction") for line in text.splitlines()
               if line.startswith(f'choreo_offset_commits_total{{how="{how}",service="sometimes-{topic}"}}')}
    assert commits == {"plain": 20, "transaction": 20}


def test_poison_messages_are_dead_lettered_while_good_ones_flow(
        services: list[ServiceProcess], probe_topic: str) -> None:
    topic = probe_topic
    good = [delivery_request(weight_kg=1.0) for _ in range(20)]
    good_ids = _publish(good[:10], topic)

    def bad_headers() -> list:
        return Envelope.first(str(uuid.uuid4()), "bad", "DeliveryRequested", "test").to_headers()

    producer = _raw_producer()
    encoder = Encoder(type(good[0]), topic, registry_client())
    valid_bytes = encoder(good[0])
    # a record of another schema, registered for real, so the id is known but unreadable as ours
    other = AvroSerializer(registry_client(), PackageFailed.avro_schema())
    other_bytes = other(PackageFailed(delivery_id="x", reason="r", failed_at=datetime.now(UTC)).to_avro(),
                        SerializationContext(f"{topic}-other", MessageField.VALUE))
    invalid = delivery_request(weight_kg=1.0).model_copy(update={"weight_kg": -5.0})
    stranger = delivery_request(weight_kg=1.0)
    poison = {
        "garbage": (b"\xff\xfe not avro at all", bad_headers()),
        "wrong-magic": (b"\x01" + valid_bytes[1:], bad_headers()),
        "unknown-schema": (b"\x00" + (2**31 - 7).to_bytes(4, "big") + valid_bytes[5:], bad_headers()),
        "truncated": (valid_bytes[:12], bad_headers()),
        "other-schema": (other_bytes, bad_headers()),
        "invalid-payload": (encoder(invalid), bad_headers()),
        "missing-headers": (valid_bytes, []),
        "hop-storm": (valid_bytes, [(k, v if k != "hops" else b"999") for k, v in bad_headers()]),
        # a good body under another delivery's envelope: the handler would act on the body's
        "other-delivery": (valid_bytes, bad_headers()),
        # a good body under an envelope of another owner: its outcome would go to that owner
        "other-owner": (encoder(stranger), Envelope.first(str(uuid.uuid4()), stranger.delivery_id, "DeliveryRequested",
                                                          "test", owner="someone-else").to_headers()),
    }
    for value, headers in poison.values():
        producer.produce(topic, key=b"bad", value=value, headers=headers)
    for name in ("truncated", "hop-storm"):  # copies (the same event at another position): skipped
        producer.produce(topic, key=b"bad", value=poison[name][0], headers=poison[name][1])
    # a good record behind them in their partition: once its output is in, they were read
    behind, last = str(uuid.uuid4()), delivery_request(weight_kg=1.0)
    producer.produce(topic, key=b"bad", value=encoder(last),
                     headers=Envelope.first(behind, last.delivery_id, "DeliveryRequested", "test").to_headers())
    producer.flush(10)
    _publish([delivery_request(weight_kg=13)], topic)  # refused by its handler: REJECTED
    _publish([delivery_request(weight_kg=11)], topic)  # yields its event: a bug, dead-lettered
    _publish([delivery_request(weight_kg=17)], topic)  # raises a ValueError: dead-lettered, the service goes on
    _publish([delivery_request(weight_kg=19)], topic)  # emits what Avro cannot write: dead-lettered, the same
    _publish([delivery_request(weight_kg=23)], topic)  # emits more than a consumer takes: dead-lettered
    flaky = _publish([delivery_request(weight_kg=7)], topic)
    hopeless = _publish([delivery_request(weight_kg=9)], topic)
    good_ids += _publish(good[10:], topic)

    services.append(ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic}).start())
    dlq = wait_for(lambda: len(r := read_topic(f"{topic}.dlq")) >= 15 and r, what="15 dead letters")
    reasons = {
        "UNDECODABLE": 3, "UNKNOWN_SCHEMA": 1, "INCOMPATIBLE_SCHEMA": 1, "INVALID_PAYLOAD": 3,
        "MISSING_HEADERS": 1, "HOP_LIMIT": 1, "REJECTED": 2, "HANDLER_ERROR": 2, "OVERSIZED": 1,
    }
    assert Counter(r.header("dlq.reason") for r in dlq) == reasons
    assert any("yields typed operations or ctx.effect(...) only" in (r.header("dlq.error") or "") for r in dlq)
    assert "handle raised ValueError: year 10000 is out of range" in {r.header("dlq.error") for r in dlq}
    assert any((r.header("dlq.error") or "").startswith("handle emitted what Avro cannot write, Unwritable: "
                                                         "PackageReady: UnicodeEncodeError") for r in dlq)
    assert [r.header("dlq.error") for r in dlq if r.header("dlq.reason") == "OVERSIZED"] == [
        f"its PackageReady for {topic}.out would be 600103 bytes, over the 524288 a consumer takes"]
    assert {"its body names another delivery than its envelope (36 characters)",
            "its body names another owner than its envelope"} <= {r.header("dlq.error") for r in dlq}
    for record in dlq:
        assert record.header("dlq.source.topic") == topic
        assert record.header("dlq.service") == f"probe-{topic}"
        assert int(record.header("dlq.source.offset") or -1) >= 0
        assert record.header("dlq.error")
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 22 and r, what="22 outputs")
    caused_by = {r.envelope.causation_id for r in out if r.envelope}
    assert set(good_ids) | set(flaky) | {behind} == caused_by  # the 7 kg one succeeded on its retry
    recovery = wait_for(lambda: [r for r in read_topic("recovery")
                                 if r.envelope and r.envelope.causation_id == hopeless[0]],
                        what="recovery report")
    assert len(recovery) == 1
    # read last, after the good record behind the two copies: they were not dead-lettered
    assert Counter(r.header("dlq.reason") for r in read_topic(f"{topic}.dlq")) == reasons
    assert services[0].alive()


def test_kill_mid_batch_loses_nothing_and_duplicates_nothing(
        services: list[ServiceProcess], probe_topic: str, redis_client: redis.Redis) -> None:
    topic = probe_topic
    requests = [delivery_request(weight_kg=42 if i == 150 else 1.0) for i in range(300)]
    ids = _publish(requests, topic)
    env = {"PROBE_TOPIC": topic, "PROBE_BATCH": "500"}
    services.append(ServiceProcess("tests.services.probe:service", env=env).start())
    wait_for(lambda: redis_client.get(f"probe:{topic}:hanging"), what="the probe to hang mid-batch")
    services[0].kill()  # kill -9: outputs of the open transaction were produced, not committed
    services.append(ServiceProcess("tests.services.probe:service", env=env).start())
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 300 and r, what="300 outputs")
    event_ids = [r.header("event_id") for r in out]
    assert len(event_ids) == len(set(event_ids)) == 300
    assert {r.envelope.causation_id for r in out if r.envelope} == set(ids)
    effects = {k.decode(): int(v) for k, v in redis_client.hgetall(f"probe:{topic}:effects").items()}
    assert len(effects) == 300 and set(effects.values()) == {1}


def test_a_failed_replay_of_a_completed_step_is_retried_until_it_publishes(
        services: list[ServiceProcess], probe_topic: str, redis_client: redis.Redis) -> None:
    """Found by a chaos run: a package step completed in a batch that was killed before its
    commit; the replay met a transient failure of the warehouse, was reported and consumed,
    and ``package.ready`` was never published: the supervisor leaves a completed step alone.
    Here the step is left completed as such a batch leaves it, and the replay fails on its
    first three tries (two in one batch)."""
    topic = probe_topic
    request = delivery_request(weight_kg=3.0)
    [event_id] = _publish([request], topic)
    [record] = read_topic(topic)
    position = f"{topic}|{record.partition}|{record.offset}"
    table, now = StateTable(redis_client), now_ms()
    table.open(request.delivery_id, "probe", now + 30_000, now)
    # the killed batch's begin saw the event at its position, then its finish completed the step
    assert table.begin_many([(request.delivery_id, "probe", 1, now, 30_000, position)], 10,
                            sightings=[sighting(f"probe-{topic}", request.delivery_id, event_id, position)],
                            dedupe_ttl_s=3600) == [(Begin.GO, 1)]
    assert table.finish(request.delivery_id, "probe", 1, now, StepStatus.COMPLETED) == "ok"
    services.append(ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic}).start())
    out = wait_for(lambda: read_topic(f"{topic}.out"), timeout_s=60, what="the replay's output")
    assert [r.envelope.causation_id for r in out if r.envelope] == [event_id]
    assert int(redis_client.get(f"probe:{topic}:flaky:{request.delivery_id}") or 0) == 4
    reports = [r for r in read_topic("recovery") if (r.key or b"").decode().startswith(request.delivery_id)]
    assert reports == []  # not consumed as a failure


def test_the_effects_of_a_batch_go_to_redis_together(
        services: list[ServiceProcess], probe_topic: str, redis_client: redis.Redis) -> None:
    topic, port = probe_topic, free_port()
    _publish([delivery_request() for _ in range(200)], topic)  # waiting before the probe starts
    services.append(ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic},
                                   args=["--metrics-port", str(port)]).start())
    wait_for(lambda: len(read_topic(f"{topic}.out")) >= 200, what="200 outputs")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    label = f'{{service="probe-{topic}"}}'
    effects, trips = (float(line.rsplit(" ", 1)[1]) for name in ("sum", "count") for line in text.splitlines()
                      if line.startswith(f"choreo_effects_per_round_trip_{name}{label}"))
    assert effects == 200
    assert trips <= 20, f"{trips:g} round trips for 200 effects: not batched"
    assert redis_client.hlen(f"probe:{topic}:effects") == 200


def test_two_instances_one_killed_the_other_takes_over(
        services: list[ServiceProcess], probe_topic: str) -> None:
    topic = probe_topic
    env = {"PROBE_TOPIC": topic, "PROBE_BATCH": "50"}
    services.append(ServiceProcess("tests.services.probe:service", instance="a", env=env).start())
    services.append(ServiceProcess("tests.services.probe:service", instance="b", env=env).start())
    ids = _publish([delivery_request() for _ in range(500)], topic)
    wait_for(lambda: len(read_topic(f"{topic}.out")) >= 100, what="first outputs")
    services[0].kill()
    ids += _publish([delivery_request() for _ in range(500)], topic)
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 1000 and r, timeout_s=90,
                   what="1000 outputs")
    assert len(out) == 1000
    assert {r.envelope.causation_id for r in out if r.envelope} == set(ids)


def test_v1_handler_reads_v2_events(services: list[ServiceProcess], stack: None, unique: str) -> None:
    topic = f"t.shipped.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq"], partitions=1)
    v2 = json.loads(DeliveryShipped.avro_schema())
    v2["fields"].append({"name": "carbon_g", "type": ["null", "double"], "default": None,
                         "doc": "v2: the flight's CO2 estimate."})
    serializer = AvroSerializer(registry_client(), json.dumps(v2))
    headers = Envelope.first(str(uuid.uuid4()), "d-v2", "DeliveryShipped", "v2-producer").to_headers()
    value = serializer({"delivery_id": "d-v2", "package_id": "p", "drone_id": "drone-1",
                        "shipped_at": datetime.now(UTC), "carbon_g": 12.5},
                       SerializationContext(topic, MessageField.VALUE))
    producer = _raw_producer()
    producer.produce(topic, key=b"d-v2", value=value, headers=headers)
    producer.flush(10)
    services.append(ServiceProcess("tests.services.notifier_copy:service", env={"PROBE_TOPIC": topic},
                                   workflow="").start())
    out = wait_for(lambda: read_topic(f"{topic}.out"), what="output from a v2 input")
    assert len(out) == 1 and out[0].key == b"d-v2"
    assert read_topic(f"{topic}.dlq") == []


def test_sigterm_commits_and_leaves_the_group(services: list[ServiceProcess], probe_topic: str) -> None:
    from confluent_kafka import ConsumerGroupTopicPartitions

    from choreo.kafka import admin

    topic = probe_topic
    proc = ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic}).start()
    services.append(proc)
    ids = _publish([delivery_request() for _ in range(50)], topic)
    wait_for(lambda: len(read_topic(f"{topic}.out")) >= 50, what="50 outputs")
    assert proc.stop() == 0  # SIGTERM: the loop ends after its batch, then close() leaves the group
    client = admin()  # keep a reference: futures of a collected client never complete
    group = client.describe_consumer_groups([f"probe-{topic}"])[f"probe-{topic}"].result(10)
    assert group.members == []
    offsets = client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(f"probe-{topic}")])
    committed = sum(tp.offset for tp in offsets[f"probe-{topic}"].result(10).topic_partitions
                    if tp.topic == topic and tp.offset > 0)
    assert committed == len(ids)  # everything handled was committed before leaving


def test_an_attempt_past_the_bound_is_dead_lettered(services: list[ServiceProcess], probe_topic: str) -> None:
    """A forged huge ``attempt`` header would outrank every supervisor token (and no longer
    fit a recovery report): such an event is dead-lettered as ATTEMPT_LIMIT, unrun."""
    topic = probe_topic
    encoder = Encoder(DeliveryRequested, topic, registry_client())
    producer = _raw_producer()
    forged = {}
    for attempt in (MAX_ATTEMPT + 1, 10**15):
        request = delivery_request(weight_kg=1.0)
        envelope = Envelope.first(str(uuid.uuid4()), request.delivery_id, "DeliveryRequested", "test")
        producer.produce(topic, key=request.key.encode(), value=encoder(request),
                         headers=envelope.with_attempt(attempt).to_headers())
        forged[request.delivery_id] = attempt
    producer.flush(10)
    [good] = _publish([delivery_request(weight_kg=1.0)], topic)
    services.append(ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic}).start())
    dlq = wait_for(lambda: len(r := read_topic(f"{topic}.dlq")) >= 2 and r, what="2 dead letters")
    assert {r.key.decode(): (r.header("dlq.reason"), r.header("dlq.error")) for r in dlq if r.key} == {
        delivery_id: ("ATTEMPT_LIMIT", f"attempt {attempt} > limit {MAX_ATTEMPT}")
        for delivery_id, attempt in forged.items()}
    out = wait_for(lambda: read_topic(f"{topic}.out"), what="the good event's output")
    assert [r.envelope.causation_id for r in out if r.envelope] == [good]


def test_a_redis_out_of_memory_holds_the_batch_and_dead_letters_nothing(
        services: list[ServiceProcess], probe_topic: str, redis_client: redis.Redis) -> None:
    """Redis refusing writes whatever they are (``maxmemory`` reached) is an outage, not a
    bad input: the service reads its batch again until Redis takes writes, and nothing is
    dead-lettered. Dead-lettered as a handler's error, every input of the outage would have
    needed a redrive; raised, it stopped the service."""
    topic = probe_topic
    services.append(ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic}).start())
    [warm] = _publish([delivery_request(weight_kg=1.0)], topic)
    wait_for(lambda: read_topic(f"{topic}.out"), what="the first output")
    before = redis_client.config_get("maxmemory")["maxmemory"]
    redis_client.config_set("maxmemory", 1)
    try:
        [held] = _publish([delivery_request(weight_kg=1.0)], topic)
        wait_for(lambda: "maxmemory" in services[-1].log_file.read_text(errors="replace"), timeout_s=30,
                 what="the batch refused by Redis")  # read, and held: nothing out
        time.sleep(3)  # a few more tries
        assert "batch.transient" in services[-1].log_file.read_text(errors="replace")
        assert [r.envelope.causation_id for r in read_topic(f"{topic}.out") if r.envelope] == [warm]
        assert services[-1].alive()
    finally:
        redis_client.config_set("maxmemory", before)
    out = wait_for(lambda: len(r := read_topic(f"{topic}.out")) >= 2 and r, what="the held event's output")
    time.sleep(1)  # a copy would come right behind
    out = read_topic(f"{topic}.out")
    assert sorted(r.envelope.causation_id for r in out if r.envelope) == sorted([warm, held])  # once each
    assert read_topic(f"{topic}.dlq", timeout_s=2) == []
    assert services[-1].alive()
