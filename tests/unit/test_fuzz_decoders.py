"""Fuzzing the edges where untrusted bytes enter: the event decoder, the envelope parser
and the ingestion HTTP body.

* ``choreo.serde.Decoder``: whatever the bytes, it returns a valid event or raises
  ``DecodeFailure`` (dead-letter, with a reason) or ``RegistryUnavailable`` (retry), never
  anything else, which would crash a consumer or abort its batch forever. Whatever writer
  schema the registry holds for the subject, too (random ones, hostile ones: arrays of
  zero-size items, maps of them, recursion), and in bounded time. The registry is an
  in-memory stand-in for ``SchemaRegistryClient`` (the decoder and fastavro run
  unchanged), so this needs no stack; the integration tests decode through the real registry.
* ``Envelope.from_headers``: any header list or mapping gives an envelope or None.
* ``POST /deliveries``: any JSON (and any bytes) gives a clear 4xx or a 202, never a 500.
"""

from __future__ import annotations

import gc
import io
import json
import multiprocessing
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from multiprocessing.pool import Pool
from typing import Any

import fastavro
import pytest
from confluent_kafka.schema_registry import (
    RegisteredSchema,
    Rule, RuleKind, RuleMode, RuleSet, Schema, SchemaReference, SchemaRegistryClient,
)
from confluent_kafka.schema_registry.error import SchemaRegistryError
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from choreo import avro_bounds, serde
from choreo.envelope import MAX_ATTEMPT, MAX_TIME_MS, Envelope
from choreo.errors import DeadLetterReason
from choreo.ops import records
from choreo.serde import MAX_VALUE_BYTES, DecodeFailure, Decoder, RegistryUnavailable
from producers.ingestion import create_app
from producers.model import parse_request
from producers.settings import IngestionSettings
from producers.submit import Accepted
from schemas.models import DeliveryRequested, PackageReady

SUBJECT = "package.ready-value"  # the decoder's topic is package.ready
OURS, OTHER, FLAKY = 1, 2, 3  # schema ids the stand-in registry knows (FLAKY: it is "down")
MISROUTED = 9  # a 404 that is not the registry's "schema not found" (a wrong URL, a proxy)
PROTOBUF, WITH_REFERENCES, NOT_AVRO, WITH_RULES = 5, 6, 7, 8  # schemas a decoder cannot read
FOREIGN = 10  # our own schema, but registered under another subject only
HOSTILE = 11  # a BACKWARD-compatible v2 whose new field is an array of nulls
REFERRING = 12  # a v2 whose new field's type comes from the "location-value" subject
REFERRING_HOSTILE = 13  # a v2 whose referenced type, fine on its own, is an array of nulls here
REFERENCED_LOCATION = {"type": "record", "name": "Location", "namespace": "com.example",
            "fields": [{"name": "lat", "type": "double"}, {"name": "lon", "type": "double"}]}
EMPTY_RECORD = {"type": "record", "name": "Nothing", "namespace": "com.example", "fields": []}
# subject, version → (id, schema, references); "loop" references itself
VERSIONS: dict[tuple[str, int], tuple[int, str, list[SchemaReference]]] = {
    ("location-value", 1): (20, json.dumps(REFERENCED_LOCATION), []),
    ("nothing-value", 1): (21, json.dumps(EMPTY_RECORD), []),
    ("loop-value", 1): (22, json.dumps(REFERENCED_LOCATION), [SchemaReference("com.example.Loop", "loop-value", 1)]),
}


def with_fields(*extra: dict[str, Any]) -> str:
    """PackageReady's schema with ``extra`` fields after its own: a v2 of the contract."""
    schema = json.loads(PackageReady.avro_schema())
    schema["fields"] += list(extra)
    return json.dumps(schema)


class StandInRegistry(SchemaRegistryClient):
    """Answers schema-by-id and its subjects from memory; unknown ids are a 404, as a real
    registry says. Every schema is under ``SUBJECT``, except ``FOREIGN``."""

    def __init__(self) -> None:
        super().__init__({"url": "http://127.0.0.1:9"})  # never contacted
        self.schemas = {OURS: PackageReady.avro_schema(), OTHER: DeliveryRequested.avro_schema(),
                        FOREIGN: PackageReady.avro_schema(),
                        HOSTILE: with_fields({"name": "x", "type": {"type": "array", "items": "null"},
                                              "default": []}),
                        REFERRING: with_fields({"name": "at", "type": "com.example.Location"}),
                        REFERRING_HOSTILE: with_fields({"name": "x", "type": {
                            "type": "array", "items": "com.example.Nothing"}, "default": []})}
        self.references = {REFERRING: [SchemaReference("com.example.Location", "location-value", 1)],
                           REFERRING_HOSTILE: [SchemaReference("com.example.Nothing", "nothing-value", 1)],
                           WITH_REFERENCES: [SchemaReference("com.example.Loop", "loop-value", 1)]}
        self.asked: list[int] = []
        self.asked_subjects: list[int] = []

    def register(self, schema: str) -> int:
        """A new id for ``schema`` under ``SUBJECT`` (the fuzz's writer schemas)."""
        schema_id = max(100, *self.schemas) + 1
        self.schemas[schema_id] = schema
        return schema_id

    def get_associations_by_resource_name(self, *args: Any, **kwargs: Any) -> Any:
        raise SchemaRegistryError(404, 40401, "no association")

    def get_subjects_by_schema_id(self, schema_id: int, subject_name: str | None = None,
                                  deleted: bool = False, offset: int = 0, limit: int = -1) -> list[str]:
        self.asked_subjects.append(schema_id)
        self._known(schema_id)
        return ["other-value"] if schema_id == FOREIGN else [SUBJECT]

    def _known(self, schema_id: int) -> None:
        """Raise what the registry answers for an id it cannot give."""
        if schema_id == FLAKY:
            raise SchemaRegistryError(503, 50003, "registry unavailable")
        if schema_id == MISROUTED:
            raise SchemaRegistryError(404, 404, "HTTP 404 Not Found")
        if schema_id not in self.schemas and schema_id not in (PROTOBUF, WITH_REFERENCES, NOT_AVRO, WITH_RULES):
            raise SchemaRegistryError(404, 40403, "Schema not found")

    def get_schema(self, schema_id: int, subject_name: str | None = None,  # type: ignore[override]
                   fmt: str | None = None) -> Schema:
        self.asked.append(schema_id)
        self._known(schema_id)
        if schema_id == PROTOBUF:
            return Schema('syntax = "proto3"; message M {}', "PROTOBUF")
        if schema_id == WITH_REFERENCES:
            return Schema(PackageReady.avro_schema(), "AVRO", self.references[WITH_REFERENCES])
        if schema_id == NOT_AVRO:
            return Schema('{"type": "record"}', "AVRO")
        if schema_id == WITH_RULES:
            rule = Rule("encrypt-address", None, RuleKind.TRANSFORM, RuleMode.WRITEREAD, "ENCRYPT",
                        ["PII"], None, None, None, None, False)
            return Schema(PackageReady.avro_schema(), "AVRO", rule_set=RuleSet(None, [rule]))
        return Schema(self.schemas[schema_id], "AVRO", self.references.get(schema_id, []))

    def get_version(self, subject_name: str, version: int | str = "latest",  # type: ignore[override]
                    deleted: bool = False, fmt: str | None = None) -> RegisteredSchema:
        """The referenced versions (``VERSIONS``), as a registry answers them."""
        assert isinstance(version, int)
        if (subject_name, version) not in VERSIONS:
            raise SchemaRegistryError(404, 40402, "Version not found")
        schema_id, text, references = VERSIONS[subject_name, version]
        return RegisteredSchema(subject_name, version, schema_id, None, Schema(text, "AVRO", references))


@pytest.fixture(scope="module")
def decoder() -> Decoder[PackageReady]:
    return Decoder(PackageReady, "package.ready", StandInRegistry())


def framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + schema_id.to_bytes(4, "big") + payload


def avro(event: PackageReady) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(json.loads(PackageReady.avro_schema())),
                               event.to_avro())
    return out.getvalue()


GOOD = PackageReady(delivery_id="d-1", package_id="p-1", package_size="SMALL", weight_kg=1.5,
                    ready_at=datetime(2030, 1, 1, tzinfo=UTC))
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def decode_or_classify(decoder: Decoder[PackageReady], value: bytes | None) -> PackageReady | Exception:
    try:
        return decoder(value)
    except (DecodeFailure, RegistryUnavailable) as exc:
        return exc
    # anything else propagates and fails the test


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_an_event_or_a_classified_failure(decoder: Decoder[PackageReady], data: bytes) -> None:
    outcome = decode_or_classify(decoder, data)
    if isinstance(outcome, DecodeFailure):
        assert isinstance(outcome.reason, DeadLetterReason) and str(outcome)
    if not data or data[0] != 0:
        assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.UNDECODABLE


@FUZZ
@given(st.sampled_from([OURS, OTHER, FLAKY, MISROUTED, 0, 4, 2**31 - 1, 2**32 - 1]), st.binary(max_size=2048))
def test_framed_garbage_is_classified(decoder: Decoder[PackageReady], schema_id: int, payload: bytes) -> None:
    """Right magic byte, any schema id, any payload: the fastavro path itself is fuzzed."""
    outcome = decode_or_classify(decoder, framed(schema_id, payload))
    if not payload:  # a bare header is refused before anyone asks the registry
        assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.UNDECODABLE
    elif schema_id in (FLAKY, MISROUTED):
        assert isinstance(outcome, RegistryUnavailable)  # transient: retried, never dead-lettered
    elif schema_id not in (OURS, OTHER):
        assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.UNKNOWN_SCHEMA


@FUZZ
@given(st.data())
def test_truncated_or_corrupted_avro_is_classified(decoder: Decoder[PackageReady], data: st.DataObject) -> None:
    body = avro(GOOD)
    cut = data.draw(st.integers(0, len(body)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(body) - 1), st.integers(1, 255)), max_size=4))
    mutated = bytearray(body[:cut])
    for at, mask in flips:
        if at < len(mutated):
            mutated[at] ^= mask
    outcome = decode_or_classify(decoder, framed(OURS, bytes(mutated)))
    if cut == len(body) and not flips:
        assert outcome == GOOD


def test_the_wire_format_checks_name_their_reason(decoder: Decoder[PackageReady]) -> None:
    cases: list[tuple[bytes | None, DeadLetterReason]] = [
        (None, DeadLetterReason.UNDECODABLE),
        (b"", DeadLetterReason.UNDECODABLE),
        (b"\x01" + avro(GOOD), DeadLetterReason.UNDECODABLE),  # wrong magic byte
        (b"\x00\x00\x00", DeadLetterReason.UNDECODABLE),  # shorter than the header
        (framed(4242, avro(GOOD)), DeadLetterReason.UNKNOWN_SCHEMA),
        (framed(OTHER, avro(GOOD)), DeadLetterReason.INCOMPATIBLE_SCHEMA),  # valid Avro, wrong schema
        (framed(OURS, avro(GOOD)[:-3]), DeadLetterReason.UNDECODABLE),  # truncated
        (framed(OURS, b"\x00" * (MAX_VALUE_BYTES + 1)), DeadLetterReason.OVERSIZED),
    ]
    for value, reason in cases:
        outcome = decode_or_classify(decoder, value)
        assert isinstance(outcome, DecodeFailure), (value[:12] if value else value, outcome)
        assert outcome.reason is reason, (value[:12] if value else value, outcome.reason, str(outcome))
    assert decoder(framed(OURS, avro(GOOD))) == GOOD


# -- writer schemas ----------------------------------------------------------------------

def varint(n: int) -> bytes:
    """An Avro long, which is how an array or map block declares its count."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    return out.getvalue()


LEAVES = (st.sampled_from(["null", "boolean", "int", "long", "float", "double", "bytes", "string",
                           {"type": "bytes", "logicalType": "decimal", "precision": 10}])
          | st.integers(0, 3).map(lambda n: {"type": "fixed", "name": "?", "size": n})
          | st.just({"type": "enum", "name": "?", "symbols": ["A", "B"]})
          | st.integers(0, 7).map(lambda k: {"ref": k}))  # a use of a named type (see ``named``)
TYPES = st.recursive(LEAVES, lambda inner: (
    inner.map(lambda t: {"type": "array", "items": t})
    | inner.map(lambda t: {"type": "map", "values": t})
    | st.lists(inner, min_size=1, max_size=3)  # a union
    | st.lists(inner, max_size=4).map(lambda ts: {
        "type": "record", "name": "?", "fields": [{"name": f"f{i}", "type": t} for i, t in enumerate(ts)]})
), max_leaves=10)


def named(node: Any, names: list[str]) -> Any:
    """``node`` with its named types called T1, T2, ... and each ``{"ref": k}`` a use of one of
    ``names``: those defined before it, or a record around it (recursion)."""
    if isinstance(node, list):
        return [named(branch, names) for branch in node]
    if not isinstance(node, dict):
        return node
    if "ref" in node:
        return names[node["ref"] % len(names)]
    out = dict(node)
    if out.get("name") == "?":
        out["name"] = f"T{len(names)}"
        names.append(out["name"])
    if "fields" in out:
        out["fields"] = [{**f, "type": named(f["type"], names)} for f in out["fields"]]
    for key in ("items", "values"):
        if key in out:
            out[key] = named(out[key], names)
    return out


@st.composite
def writer_schemas(draw: st.DrawFn) -> str:
    """Half of them a v2 of the contract, new fields of random types after its own (it
    resolves, and the new fields are skipped), half any shape at all."""
    if draw(st.booleans()):
        return json.dumps(named(draw(TYPES), ["string"]))
    schema = json.loads(PackageReady.avro_schema())
    names = [schema["name"]]
    schema["fields"] += [{"name": f"x{i}", "type": named(extra, names)}
                         for i, extra in enumerate(draw(st.lists(TYPES, min_size=1, max_size=3)))]
    return json.dumps(schema)


COUNTS = st.sampled_from([0, 1, 10**7, 2**62, 2**63 - 1, -(2**62)]) | st.integers(-(2**63), 2**63 - 1)
BODIES = st.tuples(st.sampled_from([b"", avro(GOOD)]),  # the contract's own fields, or not
                   st.lists(COUNTS.map(varint) | st.binary(max_size=8), max_size=5).map(b"".join)
                   ).map(b"".join).filter(bool)  # a bare header is refused unread


DECODE_BUDGET_S = 0.2  # CPU time one decode of these small values may take
NEVER_S = 10.0  # a decode still running after this never ends
Outcome = tuple[str, str, float]  # ("event" | reason | "unexpected", its text, CPU seconds)
_open_registry: tuple[StandInRegistry, Decoder[PackageReady]] | None = None


def decode_in_worker(schema: str, body: bytes) -> Outcome:
    """Register ``schema`` under the subject (as a registry without our checks would take
    it) and decode ``body`` with it, in the worker process; garbage collection paused, as a
    collection of a big heap can take longer than a decode may."""
    global _open_registry
    if _open_registry is None:
        registry = StandInRegistry()
        _open_registry = registry, Decoder(PackageReady, "package.ready", registry)
    registry, decoder = _open_registry
    value = framed(registry.register(schema), body)
    gc.disable()
    started = time.thread_time()
    try:
        event = decoder(value)
        found = ("event", repr(event))
    except DecodeFailure as exc:
        found = (exc.reason.value, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        found = ("unexpected", repr(exc))
    finally:
        spent = time.thread_time() - started
        gc.enable()
    return (*found, spent)


class Worker:
    """Decodes in a process of its own: a decode that never ends loops in fastavro's Cython
    code holding the GIL, where no timeout of the test's process (hypothesis's deadline,
    pytest-timeout) ever gets to run. Killed then, and started again for the next one."""

    def __init__(self) -> None:
        self._pool: Pool | None = None

    def decode(self, schema: str, body: bytes) -> Outcome | None:
        """The outcome, or None when the decode did not end within ``NEVER_S``."""
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(1)
        try:
            outcome: Outcome = self._pool.apply_async(decode_in_worker, (schema, body)).get(NEVER_S)
            return outcome
        except multiprocessing.TimeoutError:
            self.close()
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    running = Worker()
    running.decode(PackageReady.avro_schema(), avro(GOOD))  # started before any example's clock runs
    yield running
    running.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writer_schemas(), BODIES)
def test_any_writer_schema_and_body_give_an_event_or_a_dead_letter_in_bounded_time(
        worker: Worker, schema: str, body: bytes) -> None:
    """The time bound is on the decode's own CPU time (``DECODE_BUDGET_S``), not the test's
    wall clock: a deadline on that would also count the round trip to the worker and
    whatever else the machine runs."""
    outcome = worker.decode(schema, body)
    assert outcome is not None, f"the decode did not end within {NEVER_S} s"
    kind, text, spent = outcome
    assert kind == "event" or kind in DeadLetterReason.__members__, text
    assert spent < DECODE_BUDGET_S, f"{spent:.2f} s of CPU: {text}"
    try:
        avro_bounds.check(json.loads(schema))
    except avro_bounds.UnboundedSchema:
        assert kind == DeadLetterReason.INCOMPATIBLE_SCHEMA.value and "bounded work" in text, text


NULLS = {"type": "record", "name": "Nulls", "fields": [{"name": f"z{i}", "type": "null"} for i in range(8)]}


@pytest.mark.parametrize("field, why", [
    ({"name": "x", "type": {"type": "array", "items": "null"}, "default": []}, "zero bytes"),
    ({"name": "x", "type": {"type": "map", "values": NULLS}, "default": {}}, "steps per byte"),
    ({"name": "next", "type": ["null", "PackageReady"], "default": None}, "contains itself"),
    ({"name": "d", "type": ["null", {"type": "bytes", "logicalType": "decimal", "precision": 9}],
      "default": None}, "decimal on bytes"),
], ids=["array-of-nulls", "map-of-null-records", "recursive", "bytes-decimal"])
def test_a_hostile_v2_of_the_contract_is_dead_lettered_at_once(worker: Worker, field: dict[str, Any],
                                                               why: str) -> None:
    """Each new field has a default, so each v2 is BACKWARD-compatible; the value declares
    2^62 items after the contract's own fields, which fastavro would skip one by one."""
    outcome = worker.decode(with_fields(field), avro(GOOD) + varint(2**62))
    assert outcome is not None, f"the decode did not end within {NEVER_S} s"
    kind, text, spent = outcome
    assert kind == DeadLetterReason.INCOMPATIBLE_SCHEMA.value, text
    assert "cannot be decoded in bounded work" in text and why in text, text
    assert spent < DECODE_BUDGET_S


def test_a_v2_with_an_ordinary_array_stops_at_the_end_of_the_value() -> None:
    registry = StandInRegistry()
    decoder = Decoder(PackageReady, "package.ready", registry)
    v2 = registry.register(with_fields({"name": "tags", "type": {"type": "array", "items": "string"},
                                        "default": []}))
    assert decoder(framed(v2, avro(GOOD) + varint(0))) == GOOD
    outcome = decode_or_classify(decoder, framed(v2, avro(GOOD) + varint(2**62) + b"\x02a" * 100))
    assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.UNDECODABLE


def test_the_ops_tools_show_a_hostile_dead_letter_without_decoding_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops dlq show``, ``trace`` and ``rebuild-state`` read dead letters too: the schema that
    put one there is refused to them as well, at once, and a good one still reads."""
    registry = StandInRegistry()
    monkeypatch.setattr(records, "registry_client", lambda: registry)
    body = records.BodyDecoder()
    started = time.monotonic()
    shown = body("package.ready", framed(HOSTILE, avro(GOOD) + varint(2**62)))
    assert isinstance(shown, str) and shown.startswith("<refused: ") and "bounded work" in shown
    assert time.monotonic() - started < 1.0
    decoded = body("package.ready", framed(OURS, avro(GOOD)))
    assert isinstance(decoded, dict) and decoded["package_id"] == GOOD.package_id


def test_an_id_registered_under_another_subject_is_dead_lettered() -> None:
    registry = StandInRegistry()
    decoder = Decoder(PackageReady, "package.ready", registry)
    outcome = decode_or_classify(decoder, framed(FOREIGN, avro(GOOD)))
    assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.INCOMPATIBLE_SCHEMA
    assert str(outcome) == f"schema id {FOREIGN} is not registered under {SUBJECT}"
    assert registry.asked == []  # refused before its schema is fetched
    assert decoder(framed(OURS, avro(GOOD))) == GOOD  # the same schema and bytes, under our id


def test_refusals_are_remembered_for_a_while_and_only_so_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serde, "MAX_REFUSED_SCHEMAS", 2)
    registry = StandInRegistry()
    decoder = Decoder(PackageReady, "package.ready", registry)

    def decode(*ids: int) -> None:
        for schema_id in ids:
            assert isinstance(decode_or_classify(decoder, framed(schema_id, avro(GOOD))), DecodeFailure)

    decode(FOREIGN, 4242, FOREIGN, 4242, 4242)
    assert registry.asked_subjects == [FOREIGN, 4242]  # one question per refused id
    decode(HOSTILE, FOREIGN)  # HOSTILE's refusal pushes out the oldest one, FOREIGN's
    assert registry.asked_subjects == [FOREIGN, 4242, HOSTILE, FOREIGN]
    monkeypatch.setattr(serde, "REFUSAL_TTL_S", 0.0)
    registry.asked_subjects.clear()
    decode(4243, 4243)  # a refusal that has expired is asked about again
    assert registry.asked_subjects == [4243, 4243]


def test_a_schema_id_no_registry_holds_is_refused_without_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry answers a path id past a 32-bit integer with a plain 404 (JAX-RS: no such
    resource), not "schema not found": asked, it would look unavailable, and the record
    would be retried for ever. Four bytes of 0xff are enough to write one."""
    registry = StandInRegistry()
    monkeypatch.setattr(records, "registry_client", lambda: registry)
    decoder, shown = Decoder(PackageReady, "package.ready", registry), records.BodyDecoder()
    for schema_id in (2**31, 2**32 - 1):
        outcome = decode_or_classify(decoder, framed(schema_id, avro(GOOD)))
        assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.UNKNOWN_SCHEMA
        assert str(outcome) == f"schema id {schema_id} is no registry's"
        assert shown.read("package.ready", framed(schema_id, avro(GOOD))) == f"<refused: {outcome}>"
    assert registry.asked == [] and registry.asked_subjects == []


DENIED = SchemaRegistryError(403, 40301, "User is denied operation Read")


class DenyingRegistry(StandInRegistry):
    """A registry with per-subject read permissions (Confluent's RBAC): every id in ``denied``
    is refused this login; the topic's subject holds the ids ``own`` (version n the n-th),
    or answers ``own`` when it is an error."""

    def __init__(self, own: list[int] | Exception, denied: tuple[int, ...] = (FOREIGN,)) -> None:
        super().__init__()
        self.own, self.denied = own, denied
        self.asked_own: list[int | None] = []
        self.asked_elsewhere: list[str] = []  # other subjects whose versions were asked

    def get_subjects_by_schema_id(self, schema_id: int, subject_name: str | None = None,
                                  deleted: bool = False, offset: int = 0, limit: int = -1) -> list[str]:
        if schema_id in self.denied:
            raise DENIED
        return super().get_subjects_by_schema_id(schema_id, subject_name, deleted, offset, limit)

    def get_schema(self, schema_id: int, subject_name: str | None = None,  # type: ignore[override]
                   fmt: str | None = None) -> Schema:
        if schema_id in self.denied:
            raise DENIED
        return super().get_schema(schema_id, subject_name, fmt)

    def get_versions(self, subject_name: str, deleted: bool = False, deleted_only: bool = False,
                     offset: int = 0, limit: int = -1) -> list[int]:
        if subject_name != SUBJECT:
            self.asked_elsewhere.append(subject_name)
            raise SchemaRegistryError(404, 40401, "Subject not found")
        self.asked_own.append(None if deleted else -1)  # -1: a wrong question
        if isinstance(self.own, Exception):
            raise self.own
        return list(range(1, len(self.own) + 1))

    def get_version(self, subject_name: str, version: int | str = "latest",  # type: ignore[override]
                    deleted: bool = False, fmt: str | None = None) -> RegisteredSchema:
        if subject_name != SUBJECT:
            return super().get_version(subject_name, version, deleted, fmt)
        if not (isinstance(version, int) and isinstance(self.own, list) and deleted):
            self.asked_own.append(-1)  # a wrong question, told apart from what the code swallows
            raise SchemaRegistryError(400, 400, "wrong question")
        self.asked_own.append(version)
        return RegisteredSchema(SUBJECT, version, self.own[version - 1], None,
                                Schema(PackageReady.avro_schema(), "AVRO", []))


@pytest.mark.parametrize("own", [[OURS, OTHER], SchemaRegistryError(404, 40401, "Subject not found")])
def test_an_id_the_registry_denies_and_the_topics_subject_does_not_hold_is_dead_lettered(
        own: list[int] | SchemaRegistryError) -> None:
    """Read as an outage, a denied id held its partition for ever: whoever may register under
    a subject the consumers may not read, and write to their topic, stopped it. The topic's
    subject, read version by version, shows the id is not its."""
    registry = DenyingRegistry(own)
    decoder = Decoder(PackageReady, "package.ready", registry)
    outcome = decode_or_classify(decoder, framed(FOREIGN, avro(GOOD)))
    assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.INCOMPATIBLE_SCHEMA
    assert str(outcome) == f"schema id {FOREIGN} is not registered under {SUBJECT}"
    assert registry.asked_own == ([None, 1, 2] if isinstance(own, list) else [None]) and registry.asked == []
    assert decoder(framed(OURS, avro(GOOD))) == GOOD


@pytest.mark.parametrize(("own", "denied"), [
    ([OTHER, OURS], (OURS,)),  # a denial of an id the subject holds: a proxy's, a binding not yet there
    ([OTHER] * (serde.MAX_OWN_VERSIONS + 1), (FOREIGN,)),  # more versions than are read
    (DENIED, (FOREIGN,)),  # this login may not read its own subject
    (SchemaRegistryError(401, 401, "Unauthorized"), (FOREIGN,)),
    (ConnectionRefusedError(), (FOREIGN,)),
])
def test_a_denial_the_topics_subject_does_not_explain_is_an_outage(
        own: list[int] | Exception, denied: tuple[int, ...]) -> None:
    """Nothing tells the id is not the topic's: the record waits and is read again, as in an
    outage, never dead-lettered."""
    registry = DenyingRegistry(own, denied)
    outcome = decode_or_classify(Decoder(PackageReady, "package.ready", registry), framed(denied[0], avro(GOOD)))
    assert isinstance(outcome, RegistryUnavailable), outcome
    assert registry.asked_own[0] is None and -1 not in registry.asked_own


def test_a_denial_past_the_subject_check_is_an_outage() -> None:
    """The id is the topic's (its subjects say so) and its schema is denied: a login's or a
    proxy's fault, which no dead letter mends; the subject's versions are not asked."""
    registry = DenyingRegistry([OURS], denied=())
    registry.get_schema = lambda *_, **__: (_ for _ in ()).throw(DENIED)  # type: ignore[method-assign]
    outcome = decode_or_classify(Decoder(PackageReady, "package.ready", registry), framed(OURS, avro(GOOD)))
    assert isinstance(outcome, RegistryUnavailable) and registry.asked_own == []


def test_the_ops_tools_refuse_a_denied_id_the_topics_subject_does_not_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rebuild-state`` reads every body on the side topics, which every service principal
    may write: a denied id read as an outage would stop it after its wait. Refused when the
    record's topic's subject does not hold it, once a while per id and subject; one the
    subject holds waits as an outage; under another subject the same id is asked apart."""
    registry = DenyingRegistry([OTHER, OURS], denied=(FOREIGN, OURS))
    monkeypatch.setattr(records, "registry_client", lambda: registry)
    denials: list[int] = []
    denying = registry.get_schema

    def get_schema(schema_id: int, *args: Any, **kwargs: Any) -> Schema:
        denials.append(schema_id)
        return denying(schema_id, *args, **kwargs)

    registry.get_schema = get_schema  # type: ignore[method-assign]
    body = records.BodyDecoder()
    refused = f"<refused: schema id {FOREIGN} (or a schema it references) is denied and not registered under {{}}>"
    for _ in range(3):
        assert body.read("package.ready", framed(FOREIGN, avro(GOOD))) == refused.format(SUBJECT)
    assert registry.asked_own == [None, 1, 2] and denials == [FOREIGN]  # the refusal stands: asked once
    with pytest.raises(RegistryUnavailable):
        body.read("package.ready", framed(OURS, avro(GOOD)))
    assert str(body("package.ready", framed(OURS, avro(GOOD)))).startswith("<registry unavailable: ")
    assert body.read("drone.scheduled", framed(FOREIGN, avro(GOOD))) == refused.format("drone.scheduled-value")
    assert registry.asked_elsewhere == ["drone.scheduled-value"]


@pytest.mark.parametrize(("code", "what"), [(40401, "subject"), (40402, "version")])
def test_a_reference_the_registry_no_longer_has_is_a_dead_letter_not_an_outage(code: int, what: str) -> None:
    """A writer schema whose reference was deleted for good can never be read: retried as an
    outage, its record would hold its partition for ever."""
    def gone() -> None:
        raise SchemaRegistryError(404, code, "Not found")

    with pytest.raises(DecodeFailure, match=f"references a {what} the registry does not have") as refused:
        serde._ask(7, gone)
    assert refused.value.reason is DeadLetterReason.UNKNOWN_SCHEMA
    with pytest.raises(RegistryUnavailable):  # a 404 of something else than the registry: a wrong URL
        serde._ask(7, lambda: (_ for _ in ()).throw(SchemaRegistryError(404, 404, "Not Found")))


# -- the envelope ------------------------------------------------------------------------

HEADER_NAMES = st.sampled_from(["event_id", "correlation_id", "causation_id", "traceparent", "attempt",
                                "deadline_ms", "hops", "event_type", "producer", "produced_at_ms"]) | st.text(max_size=20)
HEADER_VALUES = st.none() | st.binary(max_size=300) | st.text(max_size=300) | \
    st.integers(-10**30, 10**30).map(lambda n: str(n).encode())


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=15))
def test_any_headers_give_an_envelope_or_none(headers: list[tuple[str, bytes | str | None]]) -> None:
    env = Envelope.from_headers(headers)
    assert env is None or (env.event_id and env.correlation_id and len(env.event_id) <= 200
                           and len(env.correlation_id) <= 200 and len(env.traceparent) <= 100)
    if env is not None:  # an outcome is dated by it
        datetime.fromtimestamp(env.produced_at_ms / 1000, UTC)
    assert Envelope.from_headers(dict(headers)) is None or isinstance(Envelope.from_headers(dict(headers)), Envelope)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=200).filter(str.strip), st.text(min_size=1, max_size=200).filter(str.strip),
       st.integers(1, MAX_ATTEMPT), st.integers(0, 1000))
def test_envelopes_survive_their_own_headers(event_id: str, correlation_id: str, attempt: int, hops: int) -> None:
    env = Envelope(event_id=event_id, correlation_id=correlation_id, attempt=attempt, hops=hops)
    assert Envelope.from_headers(env.to_headers()) == env


def test_forged_counters_are_refused() -> None:
    base = [("event_id", b"e"), ("correlation_id", b"d")]
    assert Envelope.from_headers([*base, ("hops", b"-1000000")]) is None
    assert Envelope.from_headers([*base, ("attempt", b"0")]) is None
    assert Envelope.from_headers([*base, ("attempt", str(MAX_ATTEMPT + 1).encode())]) is None


def test_times_no_date_holds_are_refused() -> None:
    """The outcome of a decision is dated by its input's production time: past year 9999 (or
    1 followed by 400 zeros) the webhooks service stopped on it, at every restart."""
    base = [("event_id", b"e"), ("correlation_id", b"d")]
    for name, value in (("produced_at_ms", b"9" * 17), ("produced_at_ms", b"1" + b"0" * 400),
                        ("produced_at_ms", b"-1"), ("deadline_ms", b"9" * 17)):
        assert Envelope.from_headers([*base, (name, value)]) is None, (name, value[:20])
    assert Envelope.from_headers([*base, ("produced_at_ms", str(MAX_TIME_MS).encode())]) is not None


# -- the HTTP body -------------------------------------------------------------------------

class ParsingSubmitter:
    """The real validation and event construction, no Redis or Kafka behind it: the HTTP edge
    is what is fuzzed. Whatever the parser accepts must also make a valid Avro event (else
    the real submitter would fail after validation: a 500)."""

    def __init__(self) -> None:
        self.schema = fastavro.parse_schema(json.loads(DeliveryRequested.avro_schema()))
        self.accepted = 0

    async def submit_async(self, data: Any, idempotency_key: str | None = None, **_: Any) -> Accepted:
        request = parse_request(data)
        event = request.to_event("00000000-0000-4000-8000-000000000000", datetime.now(UTC))
        fastavro.schemaless_writer(io.BytesIO(), self.schema, event.to_avro())
        self.accepted += 1
        return Accepted(event.delivery_id, "e", "t")

    def ready(self) -> dict[str, bool]:
        return {"fake": True}

    def status(self, delivery_id: str) -> None:
        return None

    def close(self, *_: Any) -> None:
        pass

    def start(self) -> ParsingSubmitter:
        return self

    @property
    def pending(self) -> int:
        return 0


@pytest.fixture(scope="module")
def http() -> Any:
    app = create_app(IngestionSettings(), submitter=ParsingSubmitter())  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=15), inner, max_size=6),
    max_leaves=30,
)
LOCATION = st.fixed_dictionaries({"lat": st.floats(-100, 100) | st.integers() | st.text(max_size=5),
                                  "lon": st.floats(-200, 200) | st.integers(),
                                  "address": st.text(max_size=520)})
NEAR_VALID = st.fixed_dictionaries(
    {"owner_id": st.text(max_size=140), "pickup": LOCATION | JSON, "dropoff": LOCATION,
     "package_size": st.sampled_from(["SMALL", "MEDIUM", "LARGE", "HUGE", ""]) | JSON,
     "weight_kg": st.floats(allow_nan=False) | st.integers() | JSON},
    optional={"deadline": st.text(max_size=40) | st.datetimes().map(lambda d: d.isoformat()),
              "reply_topic": st.text(max_size=260) | st.none(), "extra": JSON},
)


def assert_clear(response: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert response.status_code in (202, 400, 413, 415, 422), response.status_code
    if response.status_code != 202:
        body = response.json()
        assert body["error"] and body["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(JSON | NEAR_VALID)
def test_any_json_body_is_202_or_a_clear_4xx(http: Any, body: Any) -> None:
    assert_clear(http.post("/deliveries", content=json.dumps(body),
                           headers={"Content-Type": "application/json"}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2048), st.sampled_from(["application/json", "application/json; charset=utf-8",
                                                  "text/plain", "application/json; charset=latin-1"]),
       st.none() | st.binary(max_size=300))
def test_any_bytes_and_headers_are_a_clear_answer(http: Any, raw: bytes, content_type: str,
                                                  key: bytes | None) -> None:
    headers: dict[str, str | bytes] = {"Content-Type": content_type}
    if key is not None:  # any bytes a client could put on the wire (no line breaks)
        headers["Idempotency-Key"] = key.replace(b"\r", b"").replace(b"\n", b"").strip() or b"k"
    assert_clear(http.post("/deliveries", content=raw, headers=headers))


def test_a_writer_schema_with_references_is_resolved_through_the_registry() -> None:
    """A writer schema that uses a type registered in another subject decodes (the referenced
    schema is fetched and parsed first), and the bounds judge the resolved schema: a referenced
    type harmless on its own is refused where the referring schema makes an array of it."""
    registry = StandInRegistry()
    decoder = Decoder(PackageReady, "package.ready", registry)
    writer = json.loads(registry.schemas[REFERRING])
    writer["fields"][-1]["type"] = REFERENCED_LOCATION  # the same schema, self-contained, to encode with
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(writer), {**GOOD.to_avro(), "at": {"lat": 1.5, "lon": 2.0}})
    assert decoder(framed(REFERRING, out.getvalue())) == GOOD
    outcome = decode_or_classify(decoder, framed(REFERRING_HOSTILE, avro(GOOD) + b"\x02"))
    assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.INCOMPATIBLE_SCHEMA
    assert "bounded work" in str(outcome)


def test_a_writer_schema_it_cannot_read_is_incompatible_and_asked_for_once_when_good() -> None:
    """Other schema types, references that form a cycle, data-contract rules (an encrypted
    field would decode as ciphertext) and broken schemas are dead-lettered; a good writer
    schema is fetched once per decoder, however many messages carry its id."""
    registry = StandInRegistry()
    decoder = Decoder(PackageReady, "package.ready", registry)
    for schema_id in (PROTOBUF, WITH_REFERENCES, NOT_AVRO, WITH_RULES):
        outcome = decode_or_classify(decoder, framed(schema_id, avro(GOOD)))
        assert isinstance(outcome, DecodeFailure) and outcome.reason is DeadLetterReason.INCOMPATIBLE_SCHEMA
    registry.asked.clear()
    assert [decoder(framed(OURS, avro(GOOD))) for _ in range(3)] == [GOOD] * 3
    assert registry.asked == [OURS]


def test_writer_schemas_keep_the_ones_in_use_past_a_thousand_others() -> None:
    """Past a thousand schemas the least used goes: a cache that stopped taking schemas would
    let a thousand versions registered under a subject, each met once, make every later one
    (a new version of the pipeline's own) cost a registry request and a parse per record."""
    admitted: list[int] = []

    def admit(schema_id: int) -> str:
        admitted.append(schema_id)
        return f"parsed {schema_id}"

    schemas = serde.WriterSchemas(admit)
    assert schemas.get(1) == "parsed 1"
    for schema_id in range(1_000, 1_000 + 3 * serde.MAX_WRITER_SCHEMAS):
        schemas.get(schema_id)
        schemas.get(1)  # in use all along
    schemas.get(7)
    assert [schemas.get(7), schemas.get(7)] == ["parsed 7"] * 2
    assert admitted.count(1) == 1 and admitted.count(7) == 1
    assert len(schemas.parsed) == serde.MAX_WRITER_SCHEMAS
