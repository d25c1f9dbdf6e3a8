"""confluent-kafka's own client, serializer and deserializer, unchanged, against our registry.

Everything uses the client's DEFAULT configuration (subject-name strategy, auto-register,
association look-ups) and messages cross the real broker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import ConfigCompatibilityLevel, Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from choreo.config import settings
from choreo.kafka import ensure_topics

pytestmark = pytest.mark.integration


def avro(*fields: dict[str, Any], name: str = "Parcel") -> str:
    return json.dumps({"type": "record", "name": name, "namespace": "test.registry", "fields": list(fields)})


ID = {"name": "id", "type": "string"}
WEIGHT = {"name": "weight", "type": "int"}
V1 = avro(ID, WEIGHT)
V2 = avro(ID, WEIGHT, {"name": "note", "type": ["null", "string"], "default": None})
V2_REQUIRED = avro(ID, WEIGHT, {"name": "priority", "type": "int"})


@pytest.fixture()
def url(stack: None) -> str:
    return settings().schema_registry_url


@pytest.fixture()
def sr(url: str) -> Iterator[SchemaRegistryClient]:
    client = SchemaRegistryClient({"url": url})
    yield client
    client.close()


def test_client_calls(sr: SchemaRegistryClient, unique: str) -> None:
    subject, other = f"reg-{unique}-value", f"reg-{unique}-other"
    v2 = avro(ID, WEIGHT, {"name": f"note_{unique}", "type": ["null", "string"], "default": None})
    first = sr.register_schema(subject, Schema(V1, "AVRO"))
    assert sr.register_schema(subject, Schema(V1, "AVRO")) == first
    # the same schema spelled differently is the same schema, in any subject
    respelled = json.dumps(json.loads(V1), indent=4)
    fresh = SchemaRegistryClient({"url": settings().schema_registry_url})
    assert fresh.register_schema(other, Schema(respelled, "AVRO")) == first
    second = sr.register_schema(subject, Schema(v2, "AVRO"))
    assert second > first

    found = fresh.lookup_schema(subject, Schema(v2, "AVRO"))
    assert (found.schema_id, found.version, found.subject) == (second, 2, subject)
    assert json.loads(fresh.get_schema(first).schema_str or "") == json.loads(V1)
    assert sr.get_versions(subject) == [1, 2]
    latest = sr.get_latest_version(subject)
    assert (latest.version, latest.schema_id) == (2, second)
    assert sr.get_version(subject, 1).schema_id == first
    assert {subject, other} <= set(sr.get_subjects())
    # V1 may also live in subjects of earlier runs: look at ours only
    assert sorted(s for s in fresh.get_subjects_by_schema_id(first) if unique in s) == sorted([subject, other])
    assert {(v.subject, v.version) for v in fresh.get_schema_versions(first)
            if unique in (v.subject or "")} == {(subject, 1), (other, 1)}
    assert "AVRO" in sr.get_schema_types()

    assert sr.test_compatibility(subject, Schema(v2, "AVRO")) is True
    assert sr.test_compatibility(subject, Schema(V2_REQUIRED, "AVRO")) is False
    assert sr.test_compatibility(subject, Schema(V2_REQUIRED, "AVRO"), version=1) is False
    assert sr.test_compatibility_all_versions(subject, Schema(V2_REQUIRED, "AVRO")) is False

    answer: Any = sr.set_compatibility(subject, "FORWARD")  # typed as str, really the JSON body
    assert answer == {"compatibility": "FORWARD"}
    assert sr.get_compatibility(subject) == "FORWARD"
    assert sr.test_compatibility(subject, Schema(V2_REQUIRED, "AVRO")) is True  # old readers ignore it
    assert sr.get_config(subject).compatibility_level == ConfigCompatibilityLevel.FORWARD
    assert sr.delete_config(subject).compatibility_level == ConfigCompatibilityLevel.FORWARD
    assert sr.get_config().compatibility_level is not None

    assert sr.update_mode(other, "READONLY") == "READONLY"
    assert sr.get_mode(other) == "READONLY"
    with pytest.raises(SchemaRegistryError) as refused:
        sr.register_schema(other, Schema(v2, "AVRO"))
    assert refused.value.error_code == 42205
    assert sr.delete_mode(other) == "READONLY"

    assert sr.delete_version(subject, 2) == 2
    assert sr.get_versions(subject) == [1]
    assert sr.delete_version(subject, 2, permanent=True) == 2
    assert sr.delete_subject(other) == [1]
    with pytest.raises(SchemaRegistryError) as gone:
        fresh.get_versions(other)
    assert (gone.value.http_status_code, gone.value.error_code) == (404, 40401)
    assert sr.delete_subject(other, permanent=True) == [1]
    assert other not in sr.get_subjects(deleted=True)
    # soft-deleted versions keep their id readable (old messages stay decodable); hard-deleted do not
    assert sr.delete_subject(subject) == [1]
    after = SchemaRegistryClient({"url": settings().schema_registry_url})
    assert json.loads(after.get_schema(first).schema_str or "") == json.loads(V1)
    with pytest.raises(SchemaRegistryError) as purged:
        after.get_schema(second)
    assert purged.value.error_code == 40403


def _consume(topic: str, expect: int, timeout_s: float = 20.0) -> list[Any]:
    consumer = Consumer({"bootstrap.servers": settings().kafka_bootstrap_servers, "group.id": f"g-{topic}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    found: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(found) < expect and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            found.append(msg)
    consumer.close()
    return found


def _produce(sr: SchemaRegistryClient, topic: str, schema: str, values: list[dict[str, Any]]) -> None:
    serializer = AvroSerializer(sr, schema)  # default configuration
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    for value in values:
        payload = serializer(value, SerializationContext(topic, MessageField.VALUE))
        producer.produce(topic, key=value["id"], value=payload)
    assert producer.flush(15) == 0


def test_serializer_and_deserializer_over_the_broker(sr: SchemaRegistryClient, unique: str) -> None:
    topic = f"t.registry.{unique}"
    ensure_topics([topic], partitions=1)
    values = [{"id": f"p{i}", "weight": i} for i in range(5)]
    _produce(sr, topic, V1, values)
    messages = _consume(topic, len(values))
    deserializer = AvroDeserializer(SchemaRegistryClient({"url": settings().schema_registry_url}))
    decoded = [deserializer(m.value(), SerializationContext(topic, MessageField.VALUE)) for m in messages]
    assert decoded == values
    assert messages[0].value()[0] == 0  # Confluent wire format: magic byte, then the schema id
    schema_id = int.from_bytes(messages[0].value()[1:5], "big")
    assert sr.get_latest_version(f"{topic}-value").schema_id == schema_id


def test_evolution_v2_producer_and_v1_consumer_read_each_other(sr: SchemaRegistryClient, unique: str) -> None:
    topic = f"t.registry.evo.{unique}"
    ensure_topics([topic], partitions=1)
    _produce(sr, topic, V1, [{"id": "old", "weight": 1}])
    _produce(sr, topic, V2, [{"id": "new", "weight": 2, "note": "fragile"}])
    assert sr.get_versions(f"{topic}-value") == [1, 2]
    messages = _consume(topic, 2)
    ctx = SerializationContext(topic, MessageField.VALUE)
    v1_reader = AvroDeserializer(SchemaRegistryClient({"url": settings().schema_registry_url}), schema_str=V1)
    v2_reader = AvroDeserializer(SchemaRegistryClient({"url": settings().schema_registry_url}), schema_str=V2)
    assert [v1_reader(m.value(), ctx) for m in messages] == [{"id": "old", "weight": 1}, {"id": "new", "weight": 2}]
    assert [v2_reader(m.value(), ctx) for m in messages] == [
        {"id": "old", "weight": 1, "note": None}, {"id": "new", "weight": 2, "note": "fragile"}]

    with pytest.raises(SchemaRegistryError) as refused:
        sr.register_schema(f"{topic}-value", Schema(V2_REQUIRED, "AVRO"))
    assert (refused.value.http_status_code, refused.value.error_code) == (409, 409)
    assert "READER_FIELD_MISSING_DEFAULT_VALUE" in refused.value.error_message
    assert sr.get_versions(f"{topic}-value") == [1, 2]


def test_concurrent_registrations_never_duplicate(url: str, unique: str) -> None:
    """16 threads: half register one shared schema, half each a distinct one, in two subjects."""
    results: list[tuple[str, str, int]] = []
    failures: list[str] = []

    def work(n: int) -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            schema = V1 if n % 2 else avro(ID, {"name": f"f{n}", "type": ["null", "int"], "default": None})
            subject = f"conc-{unique}-{n % 2}" if n % 2 else f"conc-{unique}-{n}"
            answer = http.post(f"/subjects/{subject}/versions", json={"schema": schema})
            if answer.status_code != 200:
                failures.append(answer.text)
            else:
                results.append((subject, schema, answer.json()["id"]))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    by_schema: dict[str, set[int]] = {}
    for _, schema, schema_id in results:
        by_schema.setdefault(schema, set()).add(schema_id)
    assert all(len(ids) == 1 for ids in by_schema.values())  # one schema, one id
    all_ids = [next(iter(ids)) for ids in by_schema.values()]
    assert len(all_ids) == len(set(all_ids))  # different schemas, different ids
    with httpx.Client(base_url=url) as http:
        assert http.get(f"/subjects/conc-{unique}-1/versions").json() == [1]
