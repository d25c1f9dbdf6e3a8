"""Schema references in the registry: parsing with referenced types, identity, bounds over the
resolved schema, compatibility, the stored records, and the REST rules (pinning ``latest``,
``referencedby``, deletes refused while referenced), run on a registry whose log is a list."""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka.schema_registry import Schema, SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext
from starlette.testclient import TestClient

from choreo import avro_bounds
from choreo.errors import DeadLetterReason
from choreo.serde import DecodeFailure, _referenced
from registry import errors
from registry.api import Api, create_app
from registry.avro_schema import Reference, identity_of, parse
from registry.compat import Level, problems
from registry.registry import Registry
from registry.state import Record, State, schema_id_record, version_record

LOCATION = {"type": "record", "name": "Location", "namespace": "geo",
            "fields": [{"name": "lat", "type": "double"}, {"name": "lon", "type": "double"}]}
DELIVERY = {"type": "record", "name": "Delivery", "namespace": "drone",
            "fields": [{"name": "id", "type": "string"}, {"name": "at", "type": "geo.Location"}]}
TO_LOCATION = [{"name": "geo.Location", "subject": "location", "version": 1}]


def text(document: Any) -> str:
    return json.dumps(document)


def with_fields(document: dict[str, Any], *extra: dict[str, Any]) -> dict[str, Any]:
    return {**document, "fields": [*document["fields"], *extra]}


class ListStore:
    """The ``_schemas`` topic as a list, applied at once: what a write needs of KafkaStore."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.records: list[Record] = []
        self.position = 0

    def prepare_writer(self) -> None:
        pass

    def drop_writer(self) -> None:
        pass

    def append(self, records: list[Record]) -> None:
        for key, value in records:
            assert self.state.apply(key, value)
        self.records += records


class AlwaysLeader:
    url, token = "http://127.0.0.1:0", 1

    def is_leader(self) -> bool:
        return True


@pytest.fixture
def registry() -> Registry:
    state = State()
    return Registry(state, ListStore(state), AlwaysLeader())  # type: ignore[arg-type]


def refused(code: int, call: Any, *args: Any) -> str:
    with pytest.raises(errors.RegistryError) as info:
        call(*args)
    assert info.value.error_code == code, info.value.message
    return info.value.message


# -- parsing and identity ----------------------------------------------------------------------

def test_a_schema_may_use_the_types_of_the_schemas_it_references() -> None:
    refs = [Reference("geo.Location", "location", 1)]
    parsed = parse(text(DELIVERY), refs, [text(LOCATION)])
    assert parsed.references == tuple(refs) and parsed.dependencies == (text(LOCATION),)
    refused(42201, parse, text(DELIVERY))  # alone, the name means nothing
    short = {**DELIVERY, "namespace": "geo", "fields": [{"name": "at", "type": "Location"}]}
    parse(text(short), refs, [text(LOCATION)])  # in the same namespace, the short name


def test_identity_is_the_schema_and_its_references() -> None:
    """Same text, same references: one identity; another version referenced: another schema.
    A schema without references keeps the identity it had before references existed."""
    one, again = (parse(text(DELIVERY), [Reference("geo.Location", "location", 1)], [text(LOCATION)])
                  for _ in range(2))
    other = parse(text(DELIVERY), [Reference("geo.Location", "location", 2)], [text(LOCATION)])
    assert one.identity == again.identity != other.identity
    plain = parse(text(LOCATION))
    assert plain.identity == identity_of(LOCATION, ()) == json.dumps(
        {"fields": LOCATION["fields"], "name": "geo.Location", "type": "record"}, separators=(",", ":"))


def test_the_bounds_apply_to_the_resolved_schema() -> None:
    """A referenced type harmless on its own (an empty record) is refused where the referring
    schema makes an array of it, and the referenced texts count towards the size limit."""
    empty = {"type": "record", "name": "Empty", "namespace": "geo", "fields": []}
    arrays = {"type": "record", "name": "Many", "fields": [{"name": "x", "type": {"type": "array", "items": "geo.Empty"}}]}
    parse(text(empty))
    assert "bounded work" in refused(42201, parse, text(arrays), [Reference("e", "empty", 1)], [text(empty)])
    padded = {**LOCATION, "doc": "x" * (avro_bounds.MAX_SCHEMA_CHARS - len(text(DELIVERY)) - 100)}
    parse(text(padded))
    assert "characters" in refused(42201, parse, text(DELIVERY), [Reference("l", "l", 1)], [text(padded)])
    deep: Any = "string"
    for level in range(avro_bounds.MAX_DEPTH - 2):
        deep = {"type": "record", "name": f"L{level}", "fields": [{"name": "f", "type": deep}]}
    parse(text(deep))
    top = f"L{avro_bounds.MAX_DEPTH - 3}"
    user = {"type": "record", "name": "U", "fields": [
        {"name": "a", "type": {"type": "array", "items": {"type": "array", "items": top}}}]}
    assert "deeper" in refused(42201, parse, text(user), [Reference("d", "d", 1)], [text(deep)])


def test_resolve_orders_dependencies_and_refuses_cycles_depth_and_count() -> None:
    graph = {"a": ["b", "c"], "b": ["c"], "c": [], "loop": ["loop2"], "loop2": ["loop"]}

    def fetch(name: str) -> tuple[str, str, list[str]]:
        return name, name.upper(), graph[name]

    assert avro_bounds.resolve(["a"], fetch) == ["C", "B", "A"]  # c once, before those using it
    assert "cycle" in str(pytest.raises(avro_bounds.UnboundedSchema, avro_bounds.resolve, ["loop"], fetch).value)
    chain = {f"n{i}": [f"n{i + 1}"] for i in range(avro_bounds.MAX_REFERENCE_DEPTH)}
    chain[f"n{avro_bounds.MAX_REFERENCE_DEPTH}"] = []
    with pytest.raises(avro_bounds.UnboundedSchema, match="deeper"):
        avro_bounds.resolve(["n0"], lambda n: (n, n, chain[n]))
    avro_bounds.resolve(["n1"], lambda n: (n, n, chain[n]))  # one level less is fine
    wide = [f"w{i}" for i in range(avro_bounds.MAX_REFERENCES + 1)]
    with pytest.raises(avro_bounds.UnboundedSchema, match="more than"):
        avro_bounds.resolve(wide, lambda n: (n, n, []))


def test_compatibility_compares_the_referenced_types_too() -> None:
    """v2 references a Location that gained a field: without a default, BACKWARD refuses it."""
    v1 = parse(text(DELIVERY), [Reference("geo.Location", "location", 1)], [text(LOCATION)])
    required = with_fields(LOCATION, {"name": "alt", "type": "double"})
    optional = with_fields(LOCATION, {"name": "alt", "type": "double", "default": 0.0})
    refs2 = [Reference("geo.Location", "location", 2)]
    assert problems(parse(text(DELIVERY), refs2, [text(required)]), [(1, v1)], Level.BACKWARD)
    assert not problems(parse(text(DELIVERY), refs2, [text(optional)]), [(1, v1)], Level.FULL)


# -- the registry's rules --------------------------------------------------------------------

def register(registry: Registry, subject: str, document: Any, references: Any = None) -> int:
    body: dict[str, Any] = {"schema": text(document)}
    if references is not None:
        body["references"] = references
    answer: int = registry.register(subject, body)["id"]
    return answer


def test_register_read_lookup_and_referencedby(registry: Registry) -> None:
    location = register(registry, "location", LOCATION)
    latest = [{"name": "geo.Location", "subject": "location", "version": -1}]
    delivery = register(registry, "delivery", DELIVERY, latest)
    stored = [{"name": "geo.Location", "subject": "location", "version": 1}]  # latest, pinned
    assert registry.version("delivery", "1", False)["references"] == stored
    assert registry.schema(str(delivery), None)["references"] == stored
    assert "references" not in registry.schema(str(location), None)
    assert register(registry, "delivery", DELIVERY, TO_LOCATION) == delivery  # the same schema
    assert registry.lookup("delivery", {"schema": text(DELIVERY), "references": TO_LOCATION}, False)["id"] == delivery
    refused(40403, registry.lookup, "delivery", {"schema": text(LOCATION)}, False)
    assert registry.referenced_by("location", "1") == [delivery]
    assert registry.referenced_by("location", "latest") == [delivery]
    assert registry.referenced_by("delivery", "1") == []


def test_a_reference_to_nothing_is_an_invalid_schema(registry: Registry) -> None:
    register(registry, "location", LOCATION)
    for refs in ([{"name": "geo.Location", "subject": "nowhere", "version": 1}],
                 [{"name": "geo.Location", "subject": "location", "version": 2}]):
        assert "No schema reference found" in refused(42201, registry.register, "delivery",
                                                      {"schema": text(DELIVERY), "references": refs})
    for bad in ("x", [{"name": "n"}], [{"name": "n", "subject": "location", "version": 0}],
                [*TO_LOCATION, *TO_LOCATION]):
        refused(42201, registry.register, "delivery", {"schema": text(DELIVERY), "references": bad})


def test_deleting_a_referenced_version_is_refused(registry: Registry) -> None:
    register(registry, "location", LOCATION)
    register(registry, "delivery", DELIVERY, TO_LOCATION)
    assert "One or more references exist" in refused(42206, registry.delete_version, "location", "1", False)
    refused(42206, registry.delete_subject, "location", False)
    registry.delete_subject("delivery", False)  # a soft-deleted referrer still holds it
    assert registry.referenced_by("location", "1") == []
    refused(42206, registry.delete_version, "location", "1", False)
    registry.delete_subject("delivery", True)
    assert registry.delete_version("location", "1", False) == 1


def test_compatibility_with_references_on_registration(registry: Registry) -> None:
    register(registry, "location", LOCATION)
    register(registry, "location", with_fields(LOCATION, {"name": "alt", "type": "double", "default": 0.0}))
    register(registry, "delivery", DELIVERY, TO_LOCATION)
    registry.set_config("delivery", {"compatibility": "FORWARD"})
    body = {"schema": text(DELIVERY), "references": [{"name": "geo.Location", "subject": "location", "version": 2}]}
    assert registry.check("delivery", "latest", body, True)["is_compatible"]
    registry.set_config("delivery", {"compatibility": "BACKWARD"})
    register(registry, "location", with_fields(LOCATION, {"name": "alt", "type": "double"}))
    body3 = {"schema": text(DELIVERY), "references": [{"name": "geo.Location", "subject": "location", "version": 3}]}
    assert not registry.check("delivery", "latest", body3, False)["is_compatible"]
    refused(409, registry.register, "delivery", body3)


def test_the_log_replays_references_and_old_records_read_as_before(registry: Registry) -> None:
    register(registry, "location", LOCATION)
    delivery = register(registry, "delivery", DELIVERY, TO_LOCATION)
    store: ListStore = registry.store  # type: ignore[assignment]
    value = json.loads(next(v or b"" for k, v in store.records if b"SCHEMA_ID" in k and str(delivery).encode() in k))
    assert value["references"] == TO_LOCATION
    replayed = State()
    for key, record_value in reversed(store.records):  # out of order: resolved when needed
        assert replayed.apply(key, record_value)
    assert replayed.parsed(delivery) is not None
    assert replayed.schemas[delivery].identity == registry.state.schemas[delivery].identity
    key, plain = schema_id_record(1, text(LOCATION))
    assert plain is not None and b"references" not in plain  # a record without them is unchanged
    assert not replayed.apply(key, b'{"id":1,"schema":"{}","references":7}')  # skipped, not fatal


def test_a_cycle_written_to_the_log_is_refused(registry: Registry) -> None:
    """Records no registration would write (each version references the other) resolve to
    nothing, and a schema referencing them is refused, not parsed forever."""
    a = {**LOCATION, "name": "A"}
    b = {**LOCATION, "name": "B"}
    for schema_id, document, other in ((1, a, "b"), (2, b, "a")):
        refs = [Reference(other, other, 1)]
        for key, value in (schema_id_record(schema_id, text(document), refs),
                           version_record(other == "b" and "a" or "b", 1, schema_id)):
            assert registry.state.apply(key, value)
    assert registry.state.parsed(1) is None
    user = {"type": "record", "name": "U", "fields": [{"name": "a", "type": "geo.A"}]}
    assert "cycle" in refused(42201, registry.register, "u",
                              {"schema": text(user), "references": [{"name": "a", "subject": "a", "version": 1}]})


def test_confluent_clients_serialize_with_references_over_the_api(registry: Registry) -> None:
    """confluent-kafka's client, AvroSerializer and AvroDeserializer against the REST API in
    process (the client's HTTP session swapped for Starlette's test client: no port)."""
    with TestClient(create_app(Api(registry), lambda: None, lambda: None)) as http:
        sr = SchemaRegistryClient({"url": "http://testserver"})
        sr._rest_client.session = http
        sr.register_schema("location", Schema(text(LOCATION), "AVRO"))
        schema = Schema(text(DELIVERY), "AVRO", [SchemaReference("geo.Location", "location", 1)])
        delivery = sr.register_schema("deliveries-value", schema)
        assert sr.get_schema(delivery).references == [SchemaReference("geo.Location", "location", 1)]
        assert http.get("/subjects/location/versions/1/referencedby").json() == [delivery]
        ctx = SerializationContext("deliveries", MessageField.VALUE)
        value = {"id": "d-1", "at": {"lat": 59.3, "lon": 18.1}}
        assert AvroDeserializer(sr)(AvroSerializer(sr, schema)(value, ctx), ctx) == value
        with pytest.raises(SchemaRegistryError) as info:
            sr.delete_version("location", 1)
        assert (info.value.http_status_code, info.value.error_code) == (422, 42206)


def test_a_reference_to_a_subject_no_url_names_condemns_the_event() -> None:
    """A registry that holds a subject ``..`` (ours refuses the name) makes the client ask
    ``/versions/1``: its plain 404 read as a registry unavailable held every consumer of the
    topic for ever; the consumer refuses the writer schema instead, asking nothing."""
    class NeverAsked:
        def get_version(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("asked the registry")

    for subject in ("..", "."):
        with pytest.raises(DecodeFailure) as info:
            _referenced(NeverAsked(), 7, SchemaReference(name="x.Pad", subject=subject, version=1))  # type: ignore[arg-type]
        assert info.value.reason is DeadLetterReason.UNKNOWN_SCHEMA
