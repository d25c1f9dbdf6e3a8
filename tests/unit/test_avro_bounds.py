"""``choreo.avro_bounds``: which writer schemas decode in work bounded by the value's size.

Each refusal is one way a few bytes make fastavro loop (or recurse) without end; each
acceptance is a shape our contracts or an ordinary evolution of them uses. The last tests
check the module's claim itself: with what it accepts, a hostile item count fails at the end
of the input, and the worst accepted schema reads a maximal value in well under a second.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from choreo.avro_bounds import (
    MAX_DECIMAL_BYTES, MAX_DEPTH, MAX_FIELDS, MAX_NODES, MAX_SCHEMA_CHARS, MAX_STEPS_PER_BYTE, UnboundedSchema,
    check, check_size,
)
from choreo.serde import MAX_VALUE_BYTES
from registry import errors
from registry.avro_schema import parse

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def record(name: str, *types: Any, namespace: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"type": "record", "name": name,
                             "fields": [{"name": f"f{i}", "type": t} for i, t in enumerate(types)]}
    if namespace is not None:
        found["namespace"] = namespace
    return found


def array(items: Any) -> dict[str, Any]:
    return {"type": "array", "items": items}


def refused(schema: Any, why: str) -> None:
    with pytest.raises(UnboundedSchema, match=why):
        check(schema)


def varint(n: int) -> bytes:
    """An Avro long, which is how an array or map block declares its count."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    return out.getvalue()


@pytest.mark.parametrize("path", sorted(SCHEMAS.glob("*.avsc")), ids=lambda p: p.stem)
def test_every_contract_passes(path: Path) -> None:
    check(json.loads(path.read_text()))


def test_ordinary_shapes_pass() -> None:
    optional = ["null", record("Opt", *[["null", "string"]] * 30)]
    for schema in (
        record("A", array("string"), array(["null", "long"]), array(optional)),
        record("B", {"type": "map", "values": "null"}, {"type": "map", "values": record("Empty")}),
        record("C", record("Loc", "double", "string"), "Loc", array("Loc")),  # a named type used again
        record("D", array(array(array("int")))),
        record("E", {"type": "fixed", "name": "Money", "size": 16, "logicalType": "decimal", "precision": 30}),
        record("F", array(record("Wrapped", record("Inner", "int")))),  # 3 steps for its one byte
        record("G", array(record("Point", "double", "double", "string")), {"type": "map", "values": "double"}),
    ):
        check(schema)


@pytest.mark.parametrize("items", [
    "null",
    record("Empty"),
    {"type": "fixed", "name": "Nothing", "size": 0},
    record("Nulls", "null", "null"),
    record("Nested", record("Empty"), record("AlsoEmpty", "null")),
    array(record("Empty")),  # the inner array's items
], ids=["null", "empty-record", "fixed-0", "record-of-nulls", "nested-empty", "inner-array"])
def test_array_items_that_take_zero_bytes_are_refused(items: Any) -> None:
    refused(record("R", array(items)), "can take zero bytes")


@pytest.mark.parametrize("items", [
    "boolean", "float", "double",
    {"type": "fixed", "name": "Three", "size": 3},
    record("Point", "double", "double"),
    record("Flags", "boolean", "null"),
], ids=["boolean", "float", "double", "fixed-3", "record-of-doubles", "record-of-boolean-and-null"])
def test_array_items_of_fixed_width_values_only_are_refused(items: Any) -> None:
    """fastavro skips these without noticing the end of the input (a writer-only field)."""
    refused(record("R", array(items)), "fixed-width values only")


def test_zero_size_items_are_found_through_names_namespaces_and_maps() -> None:
    refused(record("R", record("Empty", namespace="a.b"), array("a.b.Empty")), "zero bytes")
    refused(record("R", record("Empty"), array("Empty"), namespace="ns"), "zero bytes")  # ns.Empty
    refused(record("R", {"type": "map", "values": array("null")}), "zero bytes")


def test_items_that_cost_too_many_steps_per_byte_are_refused() -> None:
    """An ``int`` (1 byte, 1 step), the record itself (1 step) and zero-size fields (1 step
    each): ``MAX_STEPS_PER_BYTE - 2`` nulls are the most one item may carry."""
    fits = ["int", *["null"] * (MAX_STEPS_PER_BYTE - 2)]
    check(record("R", array(record("Item", *fits))))
    refused(record("R", array(record("Item", *fits, "null"))), "decoding steps per byte")
    refused(record("R", {"type": "map", "values": record("V", *["null"] * MAX_STEPS_PER_BYTE)}),
            "a map's entries cost more")


@pytest.mark.parametrize("schema", [
    {"type": "record", "name": "List", "fields": [{"name": "next", "type": ["null", "List"]}]},
    {"type": "record", "name": "Tree", "fields": [{"name": "kids", "type": array("Tree")}]},
    {"type": "record", "name": "M", "fields": [{"name": "m", "type": {"type": "map", "values": "M"}}]},
    {"type": "record", "name": "N", "namespace": "x", "fields": [{"name": "n", "type": ["null", "x.N"]}]},
    record("A", record("B", ["null", "A"])),  # through another type
], ids=["union", "array", "map", "full-name", "mutual"])
def test_recursive_types_are_refused(schema: Any) -> None:
    refused(schema, "contains itself")


def test_a_namespace_that_is_no_string_is_refused() -> None:
    """fastavro names ``{"namespace": true}``'s type "True.R", where a parser that takes it as
    absent resolves a reference to "True.R" to another type: a recursion the walk would not
    see (with a harmless ``True.R`` among the references, a deep value crashed fastavro)."""
    harmless = {"type": "record", "name": "R", "namespace": "True", "fields": []}
    for namespace in (True, 1, [], {}):
        recursive = {"type": "record", "name": "R", "namespace": namespace,
                     "fields": [{"name": "next", "type": ["null", "True.R"]}]}
        with pytest.raises(UnboundedSchema, match="namespace that is not a string"):
            check(recursive, [harmless])


def test_depth_is_bounded_also_through_named_types() -> None:
    def nested(levels: int, leaf: Any = "int") -> Any:
        schema: Any = leaf
        for _ in range(levels - 1):
            schema = array(schema)
        return schema

    check(nested(MAX_DEPTH))
    refused(nested(MAX_DEPTH + 1), "deeper than")
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    refused(deep, "deeper than")  # the walk stops at the bound: no RecursionError
    # Half is 16 levels deep; Top > Again > 15 arrays > "Half" is 18 levels as written, 33
    # with Half in place
    half = record("Half", nested(MAX_DEPTH // 2 - 1))
    check(record("Top", half, record("Again", nested(MAX_DEPTH // 2 - 1, "int"))))
    refused(record("Top", half, record("Again", nested(MAX_DEPTH // 2, "Half"))), "deeper than")


def test_size_is_bounded_in_nodes_and_text() -> None:
    doubling: list[Any] = [record("T0", "int")]
    for i in range(1, 20):  # each type holds the previous twice: 2^20 types expanded
        doubling.append(record(f"T{i}", f"T{i - 1}", f"T{i - 1}"))
    refused(record("Top", *doubling), f"more than {MAX_NODES} types")
    check(record("Wide", *[record(f"W{i}", *["int"] * (MAX_FIELDS - 2)) for i in range(10)]))  # 9,981 types
    check_size(" " * MAX_SCHEMA_CHARS)
    with pytest.raises(UnboundedSchema, match="characters"):
        check_size(" " * (MAX_SCHEMA_CHARS + 1))


def test_decimals_need_a_bounded_fixed() -> None:
    refused(record("R", {"type": "bytes", "logicalType": "decimal", "precision": 10}), "decimal on bytes")
    big = {"type": "fixed", "name": "Big", "size": MAX_DECIMAL_BYTES + 1, "logicalType": "decimal",
           "precision": 10}
    refused(record("R", big), "decimal on a fixed")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["null", "int", "record", "array", "map", "fixed", "enum", "R", "decimal"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "name", "namespace", "fields", "items", "values", "size", "logicalType"])
        | st.text(max_size=5), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_any_json_is_judged_without_crashing(document: Any) -> None:
    try:
        check(document)
    except UnboundedSchema as exc:
        assert str(exc)


def test_the_registry_refuses_what_the_checks_refuse() -> None:
    hostile = record("R", array("null"))
    with pytest.raises(errors.RegistryError) as refusal:
        parse(json.dumps(hostile))
    assert refusal.value.body()["error_code"] == 42201
    assert "bounded work" in refusal.value.body()["message"]
    with pytest.raises(errors.RegistryError, match="characters"):
        parse(json.dumps(record("R", "int")) + " " * MAX_SCHEMA_CHARS)


@pytest.mark.parametrize("skipped", [False, True], ids=["read", "skipped"])
def test_with_a_varint_in_each_item_a_count_beyond_the_input_ends_at_its_end(skipped: bool) -> None:
    """Read, and skipped as a writer-only field, which is where fixed-width values are blind
    to the end of the input (2^62 items of an accepted type, then 1000 bytes)."""
    for field in (array("int"), {"type": "map", "values": "null"}, array(record("P", "double", "string"))):
        writer = record("R", field)
        check(writer)
        reader = fastavro.parse_schema(record("R") if skipped else writer)
        started = time.perf_counter()
        with pytest.raises((EOFError, IndexError)):  # fastavro's skipping says IndexError
            fastavro.schemaless_reader(io.BytesIO(varint(2**62) + b"\x00" * 1000),
                                       fastavro.parse_schema(writer), reader)
        assert time.perf_counter() - started < 0.5


def test_the_costliest_accepted_items_read_a_maximal_value_in_well_under_a_second() -> None:
    item = record("Item", "int", *["null"] * (MAX_STEPS_PER_BYTE - 2))
    writer = record("R", array(item))
    check(writer)
    count = MAX_VALUE_BYTES - 16
    value = varint(count) + b"\x00" * count + b"\x00"
    parsed = fastavro.parse_schema(writer)
    started = time.perf_counter()
    decoded = fastavro.schemaless_reader(io.BytesIO(value), parsed, parsed)
    elapsed = time.perf_counter() - started
    assert isinstance(decoded, dict) and len(decoded["f0"]) == count
    assert elapsed < 3.0, elapsed  # ~0.25 s here; a refused schema's 7 bytes never finish


def test_a_record_of_more_fields_than_a_parse_can_afford_is_refused() -> None:
    check(record("R", *["int"] * MAX_FIELDS))
    refused(record("R", *["int"] * (MAX_FIELDS + 1)), f"over {MAX_FIELDS}")
