"""Dead-letter redrive on the real stack: after the cause is fixed, each redriven event is
handled once by the service that dead-lettered it, never again by the others, and a second
redrive of the same records does nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from confluent_kafka import Producer

from choreo.config import settings
from choreo.envelope import Envelope
from choreo.kafka import ensure_topics
from choreo.ops import dlq
from choreo.ops.dlq import Selection, dead_letters, redrive, show, summary
from choreo.publisher import Publisher
from tests.factories import delivery_request
from tests.helpers import ServiceProcess, read_topic, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture()
def services() -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for proc in started:
        proc.kill()


def _causes(topic: str) -> Counter[str]:
    return Counter(r.envelope.causation_id for r in read_topic(topic) if r.envelope)


def test_redrive_after_the_fix_delivers_each_event_once(services: list[ServiceProcess], stack: None,
                                                        redis_client: redis.Redis, unique: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    topic = f"t.ops.dlq.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.other", f"{topic}.dlq"], partitions=3)
    publisher = Publisher("test")
    good = [str(uuid.uuid4()) for _ in range(10)]
    bad = [str(uuid.uuid4()) for _ in range(3)]
    for event_id in good:
        publisher.publish(delivery_request(), event_id, topic=topic)
    bad_deliveries = []
    for event_id in bad:
        request = delivery_request(weight_kg=13)
        bad_deliveries.append(request.delivery_id)
        publisher.publish(request, event_id, topic=topic)
    publisher.flush(30)
    env = {"OPS_TOPIC": topic}
    for ref in ("tests.services.ops_picky:picky", "tests.services.ops_picky:other"):
        services.append(ServiceProcess(ref, env=env, workflow="").start())
    wait_for(lambda: len(read_topic(f"{topic}.dlq")) == 3 and len(read_topic(f"{topic}.other")) == 13
             and len(read_topic(f"{topic}.out")) == 10, what="3 dead letters, 13 + 10 outputs")

    letters = dead_letters(Selection(topics=[topic]))
    assert summary(letters) == [{"topic": f"{topic}.dlq", "reason": "REJECTED", "count": 3, "redriven": 0}]
    shown = show(f"{topic}.dlq", letters[0].partition, letters[0].offset)
    assert shown["headers"]["dlq.reason"] == "REJECTED" and shown["body"]["weight_kg"] == 13

    redis_client.set(f"ops:{topic}:fixed", 1)  # the cause is fixed
    monkeypatch.setattr(dlq, "REDRIVE_CHUNK_BYTES", 1)  # a transaction a record: the first two in two
    first = redrive(Selection(topics=[topic], reasons=["REJECTED"], delivery_ids=bad_deliveries[:2]))
    assert len(first.redriven) == 2 and first.skipped == []
    monkeypatch.undo()
    rest = redrive(Selection(topics=[topic], reasons=["REJECTED"]))
    assert len(rest.redriven) == 1 and [why for _, why in rest.skipped] == ["already redriven"] * 2
    again = redrive(Selection(topics=[topic]))
    assert again.redriven == [] and len(again.skipped) == 3

    out = wait_for(lambda: len(c := _causes(f"{topic}.out")) == 13 and c, what="13 outputs")
    assert set(out.values()) == {1} and set(out) == set(good) | set(bad)
    time.sleep(2)  # give a wrong second handling the time to show up
    assert set(_causes(f"{topic}.out").values()) == {1} and len(read_topic(f"{topic}.out")) == 13
    assert len(read_topic(f"{topic}.other")) == 13  # the other subscriber skipped the copies
    assert len(read_topic(f"{topic}.dlq")) == 3  # nothing was dead-lettered again
    redriven = dead_letters(Selection(topics=[topic]))
    assert all(letter.redriven for letter in redriven)
    copies = [r for r in read_topic(topic) if r.header("redrive.from")]
    assert len(copies) == 3 and {r.header("event_id") for r in copies} == set(bad)


def test_forged_dlq_headers_never_choose_where_a_redrive_goes(services: list[ServiceProcess], stack: None,
                                                              unique: str) -> None:
    """A record arrives with ``dlq.*`` headers of its own (naming another topic and service):
    its dead letter carries the runtime's set only, and its redrive goes back to the true
    topic. A dead letter written straight into ``<topic>.dlq`` with a foreign source is
    never redriven."""
    topic = f"t.ops.forged.{unique}"
    victim = f"{topic}.victim"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq", victim], partitions=1)
    forged = [("dlq.source.topic", victim.encode()), ("dlq.service", b"someone-else"),
              ("dlq.reason", b"REJECTED"), ("dlq.source.partition", b"0"), ("dlq.source.offset", b"0")]
    envelope = Envelope.first(str(uuid.uuid4()), str(uuid.uuid4()), "DeliveryRequested", "test")
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    producer.produce(topic, key=b"k", value=b"\xff\xfe not avro", headers=forged + envelope.to_headers())
    producer.flush(10)
    services.append(ServiceProcess("tests.services.ops_picky:picky", env={"OPS_TOPIC": topic},
                                   workflow="").start())
    [letter] = wait_for(lambda: read_topic(f"{topic}.dlq"), what="the dead letter")
    names = [name for name, _ in letter.headers if name.startswith("dlq.")]
    assert sorted(names) == sorted(set(names))  # one of each: the forged ones were stripped
    assert letter.header("dlq.source.topic") == topic and letter.header("dlq.service") == f"ops-picky-{topic}"
    assert letter.header("dlq.reason") == "UNDECODABLE"

    # a dead letter nobody's runtime wrote: its source is a topic the dlq is not of
    producer.produce(f"{topic}.dlq", key=b"k", value=b"\xff",
                     headers=[*Envelope.first(str(uuid.uuid4()), "x", "T", "test").to_headers(),
                              ("dlq.reason", b"REJECTED"), ("dlq.error", b"e"), ("dlq.source.topic", victim.encode()),
                              ("dlq.source.partition", b"0"), ("dlq.source.offset", b"0"),
                              ("dlq.service", f"ops-picky-{topic}".encode()), ("dlq.time_ms", b"1")])
    producer.flush(10)
    result = redrive(Selection(topics=[topic]))
    assert [(letter.source_topic, letter.offset) for letter in result.redriven] == [(topic, 0)]
    assert [why for _, why in result.skipped] == [
        f"untrusted: dlq.source.topic is neither {topic} nor ops-picky-{topic}'s retry topic of it"]
    copies = wait_for(lambda: [r for r in read_topic(topic) if r.header("redrive.from")], what="the copy")
    assert len(copies) == 1 and copies[0].header("redrive.from") == f"{topic}.dlq|0|0"
    assert not any(name.startswith("dlq.") for name, _ in copies[0].headers)
    assert read_topic(victim) == []


def _peak_rss_mib(*args: str) -> tuple[float, bytes]:
    """``choreo ops <args>``'s peak resident memory, as the kernel counted it (``wait4``),
    and what it printed."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "ops", *args], stdout=out, stderr=err)
        stop = threading.Timer(120, proc.kill)
        stop.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            stop.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        printed, complaint = out.read(), err.read()
    assert proc.returncode == 0, complaint[-2000:]
    return usage.ru_maxrss / 1024, printed


def test_a_reader_of_large_dead_letters_holds_what_it_prefetches_not_the_topic(stack: None, unique: str) -> None:
    """An operator's reader took from the broker as much as one wait brought, and fetched
    ahead of its caller as much as librdkafka let it: listing a dead-letter topic of
    half-megabyte letters held two hundred megabytes and more, and the live view holds a
    reader per trace and redrive. Listing 480 of them (240 MB) now takes at most 96 MiB more
    than listing one."""
    topic = f"t.ops.large.{unique}"
    ensure_topics([topic, f"{topic}.dlq"], partitions=1)
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers, "linger.ms": 5})
    headers = [("dlq.reason", b"REJECTED"), ("dlq.error", b"e"), ("dlq.source.topic", topic.encode()),
               ("dlq.source.partition", b"0"), ("dlq.source.offset", b"0"), ("dlq.service", b"s")]

    def letters(n: int) -> None:
        for _ in range(n):
            producer.produce(f"{topic}.dlq", key=b"k", value=os.urandom(500_000), headers=headers)
            producer.poll(0)
        assert producer.flush(30) == 0

    def listed() -> tuple[float, int]:
        peak, printed = _peak_rss_mib("dlq", "list", "--topic", topic, "--json")
        return peak, sum(row["count"] for row in json.loads(printed)["summary"])

    letters(1)
    one, counted = listed()
    assert counted == 1
    letters(479)
    many, counted = listed()
    assert counted == 480
    print({"peak_rss_mib_one_letter": round(one), "peak_rss_mib_480_letters": round(many)})
    assert many - one < 96
