"""The registry's pure logic: Avro compatibility levels, schema identity, log replay, parsing."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import pytest

from registry import api, errors
from registry.avro_schema import ParsedSchema, Reference, parse, references_of
from registry.compat import Level, problems, reader_writer_problems
from registry import leader
from registry.registry import LATEST, Registry, check_subject, parse_schema_id, parse_version
from registry.state import State, config_record, mode_record, schema_id_record, version_record
from registry.store import KafkaStore


def record(*fields: dict[str, Any], name: str = "Delivery", namespace: str = "drone") -> ParsedSchema:
    return parse(json.dumps({"type": "record", "name": name, "namespace": namespace, "fields": list(fields)}))


ID = {"name": "id", "type": "string"}
OPTIONAL_NOTE = {"name": "note", "type": ["null", "string"], "default": None}
REQUIRED_NOTE = {"name": "note", "type": "string"}


def compatible(new: ParsedSchema, old: ParsedSchema, level: Level) -> bool:
    return not problems(new, [(1, old)], level)


# -- the checker's Avro resolution rules ---------------------------------------------------

def test_adding_optional_field_is_fully_compatible() -> None:
    v1, v2 = record(ID), record(ID, OPTIONAL_NOTE)
    for level in Level:
        assert compatible(v2, v1, level), level


def test_adding_required_field_breaks_backward_only() -> None:
    v1, v2 = record(ID), record(ID, REQUIRED_NOTE)
    assert not compatible(v2, v1, Level.BACKWARD)
    assert compatible(v2, v1, Level.FORWARD)  # old readers ignore the new field
    assert not compatible(v2, v1, Level.FULL)
    assert compatible(v2, v1, Level.NONE)
    assert any("READER_FIELD_MISSING_DEFAULT_VALUE" in m for m in problems(v2, [(1, v1)], Level.BACKWARD))


def test_removing_field_without_default_breaks_forward_only() -> None:
    v1, v2 = record(ID, REQUIRED_NOTE), record(ID)
    assert compatible(v2, v1, Level.BACKWARD)
    assert not compatible(v2, v1, Level.FORWARD)


@pytest.mark.parametrize(
    ("writer", "reader", "ok"),
    [
        ("int", "long", True), ("int", "float", True), ("int", "double", True), ("long", "double", True),
        ("float", "double", True), ("string", "bytes", True), ("bytes", "string", True),
        ("long", "int", False), ("double", "float", False), ("string", "int", False),
    ],
)
def test_type_promotions(writer: str, reader: str, ok: bool) -> None:
    w = record({"name": "n", "type": writer})
    r = record({"name": "n", "type": reader})
    assert (not reader_writer_problems(reader=r, writer=w)) is ok


def test_unions() -> None:
    narrow, wide = record({"name": "v", "type": ["null", "string"]}), record({"name": "v", "type": ["null", "string", "int"]})
    assert not reader_writer_problems(reader=wide, writer=narrow)
    assert reader_writer_problems(reader=narrow, writer=wide)  # the int branch cannot be read
    plain = record({"name": "v", "type": "string"})
    assert not reader_writer_problems(reader=narrow, writer=plain)  # a union reader takes a matching branch


def test_enums_and_enum_default() -> None:
    def enum(symbols: list[str], default: str | None = None) -> ParsedSchema:
        spec: dict[str, Any] = {"type": "enum", "name": "Status", "symbols": symbols}
        if default:
            spec["default"] = default
        return record({"name": "s", "type": spec})

    assert reader_writer_problems(reader=enum(["A", "B"]), writer=enum(["A", "B", "C"]))
    assert not reader_writer_problems(reader=enum(["A", "B", "U"], "U"), writer=enum(["A", "B", "C"]))
    assert not reader_writer_problems(reader=enum(["A", "B", "C"]), writer=enum(["A", "B"]))


def test_arrays_maps_and_fixed() -> None:
    ints = record({"name": "xs", "type": {"type": "array", "items": "int"}})
    longs = record({"name": "xs", "type": {"type": "array", "items": "long"}})
    assert not reader_writer_problems(reader=longs, writer=ints)
    assert reader_writer_problems(reader=ints, writer=longs)
    m_int = record({"name": "m", "type": {"type": "map", "values": "int"}})
    m_str = record({"name": "m", "type": {"type": "map", "values": "string"}})
    assert reader_writer_problems(reader=m_str, writer=m_int)
    f4 = record({"name": "f", "type": {"type": "fixed", "name": "F", "size": 4}})
    f8 = record({"name": "f", "type": {"type": "fixed", "name": "F", "size": 8}})
    assert reader_writer_problems(reader=f8, writer=f4)


def test_renames_through_aliases_relative_and_qualified() -> None:
    """avro's checker compares aliases as written; we qualify them, as the spec says."""
    old = record({"name": "a", "type": "int"}, name="Old")
    for alias in ("Old", "drone.Old"):
        renamed = parse(json.dumps({"type": "record", "name": "New", "namespace": "drone", "aliases": [alias],
                                    "fields": [{"name": "b", "aliases": ["a"], "type": "int"}]}))
        assert not reader_writer_problems(reader=renamed, writer=old), alias
    stranger = record({"name": "a", "type": "int"}, name="Other")
    assert reader_writer_problems(reader=stranger, writer=old)


def test_transitive_levels_check_every_version() -> None:
    v1 = record(ID)
    v2 = record(ID, {"name": "note", "type": "string", "default": "x"})
    v3 = record(ID, REQUIRED_NOTE)  # compatible with v2 (has the field) but not with v1
    history = [(1, v1), (2, v2)]
    assert not problems(v3, history, Level.BACKWARD)
    assert problems(v3, history, Level.BACKWARD_TRANSITIVE)
    assert problems(v3, history, Level.FULL_TRANSITIVE)


def test_level_parsing() -> None:
    assert Level.parse("backward_transitive") is Level.BACKWARD_TRANSITIVE
    for bad in ("SIDEWAYS", "", None, 3):
        with pytest.raises(errors.RegistryError) as info:
            Level.parse(bad)
        assert info.value.error_code == 42203


# -- identity ------------------------------------------------------------------------------

def test_equivalent_spellings_share_an_identity() -> None:
    a = parse('{"type":"record","name":"R","namespace":"n","fields":[{"name":"x","type":"int"}]}')
    b = parse('{ "fields": [ {"type": {"type": "int"}, "name": "x"} ],\n "name": "n.R", "type": "record" }')
    assert a.identity == b.identity


def test_defaults_and_docs_are_part_of_identity() -> None:
    plain = record({"name": "x", "type": "int"})
    defaulted = record({"name": "x", "type": "int", "default": 1})
    assert plain.identity != defaulted.identity


@pytest.mark.parametrize(
    "text",
    ["", "   ", "not json", "{", '{"type":"record","name":"R"}', '{"type":"nope"}', '"Undefined"',
     '{"type":"record","name":"1R","fields":[]}', '{"type":"enum","name":"E","symbols":["A","A"]}',
     '{"type":"record","name":"R","fields":[{"name":"a","type":"int","default":"x"}]}',
     "[" * 5000 + "]" * 5000],
)
def test_invalid_schemas_are_42201(text: str) -> None:
    with pytest.raises(errors.RegistryError) as info:
        parse(text)
    assert (info.value.status, info.value.error_code) == (422, 42201)


# -- replay ----------------------------------------------------------------------------------

def test_replay_builds_state_and_tombstones_remove() -> None:
    state = State()
    text = record(ID).text
    for key, value in [
        schema_id_record(7, text), version_record("s", 1, 7), version_record("t", 1, 7),
        config_record(None, {"compatibilityLevel": "FULL"}), mode_record("s", "READONLY"),
        version_record("t", 1, 7, deleted=True), version_record("s", 1, None), mode_record("s", None),
    ]:
        assert state.apply(key, value)
    assert "s" not in state.subjects
    assert state.versions("t") == [] and state.versions("t", include_deleted=True)[0].deleted
    assert state.max_id == 7 and state.schemas[7].text == text
    assert state.configs[None] == {"compatibilityLevel": "FULL"} and state.modes == {}


def test_replay_skips_garbage_without_failing() -> None:
    state = State()
    for key, value in [(b"not json", b"{}"), (b'{"keytype":"WHAT"}', b"{}"), (None, None), (b"[]", b"1"),
                       (b'{"keytype":"SCHEMA","subject":"s","version":"x"}', b'{"id":1}')]:
        assert not state.apply(key, value)
    assert state.skipped == 5 and not state.subjects


# -- path parameters ------------------------------------------------------------------------

def test_versions() -> None:
    assert parse_version("latest") == LATEST and parse_version("-1") == LATEST
    assert parse_version("1") == 1 and parse_version(str(2**31 - 1)) == 2**31 - 1
    for bad in ("0", "-2", "abc", str(2**31), "99999999999999999999", "1.5", "", "\u00b2", "\u0661", "--1"):
        with pytest.raises(errors.RegistryError) as info:
            parse_version(bad)
        assert info.value.error_code == 42202


def test_schema_ids() -> None:
    assert parse_schema_id("12") == 12
    for bad in ("x", "1.0", str(2**40), "", "\u00b2", "\u0661", "--1"):  # digits to isdigit, not to int
        with pytest.raises(errors.RegistryError) as info:
            parse_schema_id(bad)
        assert (info.value.status, info.value.error_code) == (404, 404)


def test_subject_names() -> None:
    assert check_subject("orders-value") == "orders-value"
    assert check_subject("../config") == "../config"  # just a name: routing never sees it decoded
    # dots only: a client's URL ``subjects/..`` is ``/`` once its path is normalised
    for bad in ("", "  ", "a\x00b", "line\nbreak", "x" * 5000, "__GLOBAL", ".", "..", "..."):
        with pytest.raises(errors.RegistryError) as info:
            check_subject(bad)
        assert info.value.error_code == 42208


def test_a_lease_no_instance_wrote_reads_as_none() -> None:
    """Whoever can write the lease key must not stop the election (its tick raised)."""
    for raw in ('{"id":"x","url":"u","token":1e400}', '{"id":"x","url":"u","token":"t"}', "[]", "{", b"\xff"):
        assert leader._parse(raw) is None
    assert leader._parse('{"id":"x","url":"u","token":3}') == leader.Lease("x", "u", 3, "")


# -- listing every schema --------------------------------------------------------------------

def _listing(state: State, **query: str) -> list[dict[str, Any]]:
    registry = Registry(state, cast(KafkaStore, None), cast(leader.LeaderElection, None))
    return api._all_schemas(api.Call(registry, {}, query))


def test_every_schema_is_listed_a_bounded_page_at_a_time() -> None:
    """At most ``MAX_SCHEMAS_PAGE`` schemas and about ``MAX_SCHEMAS_PAGE_CHARS`` of text a
    call, paged by ``offset``: never the whole store in one answer."""
    state = State()
    text = record(ID).text
    state.apply(*schema_id_record(1, text))
    for n in range(1, 1_201):
        assert state.apply(*version_record(f"s{n:05d}-value", 1, 1))
    first = _listing(state)
    assert len(first) == api.MAX_SCHEMAS_PAGE == len(_listing(state, limit="-1")) == len(_listing(state, limit="5000"))
    assert [s["subject"] for s in _listing(state, offset="1000")] == [f"s{n:05d}-value" for n in range(1_001, 1_201)]
    assert [s["subject"] for s in _listing(state, offset="2", limit="2")] == ["s00003-value", "s00004-value"]
    assert _listing(state, offset="1200") == []
    big = json.dumps({"type": "record", "name": "Big", "fields": [ID], "doc": "x" * 3_000_000})
    state.apply(*schema_id_record(2, big))
    for n in range(1, 6):
        state.apply(*version_record(f"big{n}-value", 1, 2))
    assert len(_listing(state, subjectPrefix="big")) == 3  # 9 MB of text: the page ends past 8 MiB
    names = [Reference(f"n{i}" + "x" * 1_000, "base", 1) for i in range(64)]  # 64 KB of references, "string"
    state.apply(*schema_id_record(3, '"string"', names))
    for n in range(1, 201):
        state.apply(*version_record(f"refs{n:03d}-value", 1, 3))
    assert len(_listing(state, subjectPrefix="refs")) == 131  # the references count: 8 MiB passed at the 131st
    long_name = [{"name": "n" + "x" * 14_000, "subject": "base", "version": 1}]
    with pytest.raises(ValueError, match="at most 1024 characters"):
        references_of(long_name, requested=True)
    assert len(references_of(long_name)[0].name) == 14_001  # the log is read as it was written
    for bad in ("x", "1.5", "", "\u00b2", "--1", "9" * 12):
        with pytest.raises(errors.RegistryError) as info:
            _listing(state, offset=bad)
        assert info.value.status == 400


def test_uses_and_referrers_are_indexed_and_follow_every_change() -> None:
    """A lookup by id and a referenced version's referrers cost what they find: as walks over
    every version (once per referrer), 5,000 subjects naming one base take seconds under the
    state's lock."""
    state = State()
    state.apply(*schema_id_record(1, record(ID).text))
    state.apply(*version_record("base", 1, 1))
    base = [Reference("drone.Delivery", "base", 1)]
    for n in range(2, 5_002):
        state.apply(*schema_id_record(n, record(ID, name="R" + str(n)).text, base))
        state.apply(*version_record(f"s{n}", 1, n))
    started = time.perf_counter()
    with state.lock:
        assert len(state.referrers("base", 1)) == 5_000
        assert [(sv.subject, sv.version) for sv in state.usages(2)] == [("s2", 1)]
    assert time.perf_counter() - started < 2
    state.apply(*version_record("s2", 1, 2, deleted=True))  # soft-deleted: a use still, not a live one
    state.apply(*version_record("t", 1, 3))  # a second subject of schema 3
    with state.lock:
        assert state.usages(2) == [] and [sv.deleted for sv in state.usages(2, include_deleted=True)] == [True]
        assert 2 not in state.referrers("base", 1) and 2 in state.referrers("base", 1, include_deleted=True)
        assert [sv.subject for sv in state.usages(3)] == ["s3", "t"]
    state.apply(*version_record("s2", 1, None))  # hard-deleted
    state.apply(*version_record("s3", 1, 4))  # a version record naming another schema replaces it
    with state.lock:
        assert state.usages(2, include_deleted=True) == [] and 2 not in state.referrers("base", 1, True)
        assert [sv.subject for sv in state.usages(3)] == ["t"] and [sv.subject for sv in state.usages(4)] == ["s3", "s4"]
