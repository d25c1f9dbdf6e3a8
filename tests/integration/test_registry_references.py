"""Schema references against the real registry, through confluent-kafka's own client,
serializer and deserializer (default configuration), and through this project's decoder.

A ``Location`` record is registered in one subject and a schema using it in another; the
hostile cases (a cycle written straight into a store topic, too many or too deep references,
a referenced type that makes an array unbounded) are refused as invalid schemas.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from choreo import avro_bounds
from choreo.config import settings
from choreo.serde import Decoder
from schemas.models import PackageReady
from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)
from tests.integration.test_registry_lock import CT
from tests.integration.test_registry_store_records import write_raw

pytestmark = pytest.mark.integration


@pytest.fixture()
def sr(stack: None) -> Iterator[SchemaRegistryClient]:
    client = SchemaRegistryClient({"url": settings().schema_registry_url})
    yield client
    client.close()


def location(namespace: str, *extra: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": "Location", "namespace": namespace,
                       "fields": [{"name": "lat", "type": "double"}, {"name": "lon", "type": "double"}, *extra]})


def delivery(namespace: str) -> str:
    return json.dumps({"type": "record", "name": "Delivery", "namespace": namespace,
                       "fields": [{"name": "id", "type": "string"}, {"name": "at", "type": f"{namespace}.Location"}]})


def refused(code: int, call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(SchemaRegistryError) as info:
        call(*args, **kwargs)
    assert info.value.error_code == code, info.value.error_message
    return str(info.value.error_message)


def test_register_read_serialize_and_delete_with_references(sr: SchemaRegistryClient, unique: str) -> None:
    ns, loc_subject, subject = f"geo{unique}", f"loc-{unique}", f"refs-{unique}-value"
    loc_id = sr.register_schema(loc_subject, Schema(location(ns), "AVRO"))
    ref = SchemaReference(f"{ns}.Location", loc_subject, 1)
    schema = Schema(delivery(ns), "AVRO", [ref])
    delivery_id = sr.register_schema(subject, schema)
    assert sr.register_schema(subject, schema) == delivery_id  # same text and references: same id

    by_id = sr.get_schema(delivery_id)
    assert [(r.name, r.subject, r.version) for r in by_id.references or []] == [(ref.name, loc_subject, 1)]
    assert not sr.get_schema(loc_id).references
    latest = sr.get_latest_version(subject)
    assert latest.schema_id == delivery_id and (latest.schema.references or [])[0].subject == loc_subject
    assert sr.lookup_schema(subject, schema).schema_id == delivery_id
    with httpx.Client(base_url=settings().schema_registry_url, timeout=30) as http:
        assert http.get(f"/subjects/{loc_subject}/versions/1/referencedby").json() == [delivery_id]
        # "latest" (-1) in a reference is stored as the version it meant
        pinned = http.post(f"/subjects/{subject}/versions", headers=CT, json={
            "schema": delivery(ns), "references": [{"name": ref.name, "subject": loc_subject, "version": -1}]})
        assert pinned.json() == {"id": delivery_id}

    value = {"id": "d-1", "at": {"lat": 59.3, "lon": 18.1}}
    serializer = AvroSerializer(sr, schema)
    deserializer = AvroDeserializer(sr)
    ctx = SerializationContext(f"refs-{unique}", MessageField.VALUE)
    raw = serializer(value, ctx)
    assert raw is not None and int.from_bytes(raw[1:5], "big") == delivery_id
    assert deserializer(raw, ctx) == value

    # deletes: refused while referenced (a soft-deleted referrer still counts), then allowed
    assert refused(42206, sr.delete_version, loc_subject, 1).startswith("One or more references exist")
    refused(42206, sr.delete_subject, loc_subject)
    sr.delete_subject(subject)
    refused(42206, sr.delete_version, loc_subject, 1)
    sr.delete_subject(subject, permanent=True)
    assert sr.delete_version(loc_subject, 1) == 1


def test_compatibility_with_references(sr: SchemaRegistryClient, unique: str) -> None:
    ns, loc_subject, subject = f"geo{unique}", f"loc-{unique}", f"refs-{unique}-value"
    sr.register_schema(loc_subject, Schema(location(ns), "AVRO"))
    sr.register_schema(loc_subject, Schema(location(ns, {"name": "alt", "type": "double", "default": 0.0}), "AVRO"))
    sr.register_schema(subject, Schema(delivery(ns), "AVRO", [SchemaReference(f"{ns}.Location", loc_subject, 1)]))
    v2 = Schema(delivery(ns), "AVRO", [SchemaReference(f"{ns}.Location", loc_subject, 2)])
    assert sr.test_compatibility(subject, v2) is True  # a reader whose Location gained a default
    other, third = f"loc2-{unique}", Schema(location(ns, {"name": "alt", "type": "double"}), "AVRO")
    sr.set_compatibility(other, "NONE")
    sr.register_schema(other, Schema(location(ns), "AVRO"))
    sr.register_schema(other, third)
    required = Schema(delivery(ns), "AVRO", [SchemaReference(f"{ns}.Location", other, 2)])
    assert sr.test_compatibility(subject, required) is False  # alt has no default: BACKWARD fails
    refused(409, sr.register_schema, subject, required)
    assert sr.register_schema(subject, v2) > 0


def test_references_to_nothing_and_hostile_references_are_refused(sr: SchemaRegistryClient, unique: str) -> None:
    ns, loc_subject = f"geo{unique}", f"loc-{unique}"
    sr.register_schema(loc_subject, Schema(location(ns), "AVRO"))
    for subject, version in ((f"nowhere-{unique}", 1), (loc_subject, 2)):
        message = refused(42201, sr.register_schema, f"refs-{unique}",
                          Schema(delivery(ns), "AVRO", [SchemaReference(f"{ns}.Location", subject, version)]))
        assert "No schema reference found" in message

    # too deep: each schema references the one before, one level past the limit is refused
    previous: list[SchemaReference] = []
    for level in range(avro_bounds.MAX_REFERENCE_DEPTH + 2):
        name = f"L{level}"
        fields = [{"name": "f", "type": f"{ns}.L{level - 1}" if level else "string"}]
        schema = Schema(json.dumps({"type": "record", "name": name, "namespace": ns, "fields": fields}),
                        "AVRO", previous)
        if level <= avro_bounds.MAX_REFERENCE_DEPTH:
            sr.register_schema(f"chain-{unique}-{level}", schema)
        else:
            assert "deeper" in refused(42201, sr.register_schema, f"chain-{unique}-{level}", schema)
        previous = [SchemaReference(f"{ns}.{name}", f"chain-{unique}-{level}", 1)]

    # too many: more references than a schema may have
    many = [SchemaReference(f"r{i}", loc_subject, 1) for i in range(avro_bounds.MAX_REFERENCES + 1)]
    assert "more than" in refused(42201, sr.register_schema, f"many-{unique}", Schema(delivery(ns), "AVRO", many))

    # a referenced type harmless on its own, unbounded where the referring schema uses it
    empty = json.dumps({"type": "record", "name": "Empty", "namespace": ns, "fields": []})
    sr.register_schema(f"empty-{unique}", Schema(empty, "AVRO"))
    arrays = json.dumps({"type": "record", "name": "Many", "namespace": ns,
                         "fields": [{"name": "x", "type": {"type": "array", "items": "Empty"}}]})
    message = refused(42201, sr.register_schema, f"arrays-{unique}",
                      Schema(arrays, "AVRO", [SchemaReference(f"{ns}.Empty", f"empty-{unique}", 1)]))
    assert "bounded work" in message


def test_the_pipeline_decoder_reads_a_writer_schema_with_references(sr: SchemaRegistryClient, unique: str) -> None:
    """choreo.serde's Decoder fetches the references of a writer schema and skips a field of a
    referenced type that its reader (the handler's model) does not have."""
    ns, loc_subject, topic = f"geo{unique}", f"loc-{unique}", f"refs.{unique}"
    sr.register_schema(loc_subject, Schema(location(ns), "AVRO"))
    writer = json.loads(PackageReady.avro_schema())
    writer["fields"].append({"name": "at", "type": f"{ns}.Location"})
    schema = Schema(json.dumps(writer), "AVRO", [SchemaReference(f"{ns}.Location", loc_subject, 1)])
    event = PackageReady(delivery_id="d-1", package_id="p-1", package_size="SMALL", weight_kg=1.5,
                         ready_at=datetime(2030, 1, 1, tzinfo=UTC))
    raw = AvroSerializer(sr, schema)({**event.to_avro(), "at": {"lat": 1.0, "lon": 2.0}},
                                     SerializationContext(topic, MessageField.VALUE))
    assert raw is not None
    assert Decoder(PackageReady, topic, sr)(raw) == event


def test_a_reference_cycle_in_the_store_is_refused(instances: Starter, unique: str) -> None:  # noqa: F811
    """No registration can make a cycle (a reference names an existing version); records
    written straight into the store can. The registry keeps working, and a schema that
    references the cycle is refused."""
    _, url = instances("cycle")
    topic = f"_schemas_test_{unique}"  # the instances fixture's store topic
    records = []
    for schema_id, name, other in ((1_000_001, "A", "b"), (1_000_002, "B", "a")):
        text = json.dumps({"type": "record", "name": name, "namespace": "loop", "fields": [{"name": "x", "type": "int"}]})
        records.append(("", json.dumps({"keytype": "SCHEMA_ID", "id": schema_id, "magic": 0}).encode(),
                        json.dumps({"id": schema_id, "schema": text, "schemaType": "AVRO",
                                    "references": [{"name": other, "subject": other, "version": 1}]}).encode()))
        records.append(("", json.dumps({"keytype": "SCHEMA", "subject": name.lower(), "version": 1, "magic": 1}).encode(),
                        json.dumps({"subject": name.lower(), "version": 1, "id": schema_id, "deleted": False}).encode()))
    write_raw(topic, records)
    with httpx.Client(base_url=url, timeout=30) as http:
        deadline = time.monotonic() + 30
        while http.get("/subjects/b/versions").status_code != 200:
            assert time.monotonic() < deadline, "the records never showed up"
            time.sleep(0.2)
        assert http.get("/schemas/ids/1000001").json()["references"] == [{"name": "b", "subject": "b", "version": 1}]
        user = json.dumps({"type": "record", "name": "U", "fields": [{"name": "a", "type": "loop.A"}]})
        answer = http.post("/subjects/u/versions", headers=CT,
                           json={"schema": user, "references": [{"name": "loop.A", "subject": "a", "version": 1}]})
        assert answer.status_code == 422 and answer.json()["error_code"] == 42201
        assert "cycle" in answer.json()["message"]
