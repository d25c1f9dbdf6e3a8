"""Whether an Avro writer schema can be decoded in bounded work, checked before it is used.

A writer schema is input: whoever can register a schema (or run the registry) writes it, and
fastavro trusts it. A few bytes can then demand unbounded work: an array declares its item
count up front and fastavro reads that many items one by one, so with items that take zero
bytes (``null``, an empty record, a ``fixed`` of size 0, a record of such fields) a 10-byte
value declares 2^62 items and never finishes, reading or skipping. Skipping (a writer field
the reader lacks) has a second hole: fastavro skips a ``boolean``, ``float``, ``double`` or
``fixed`` without noticing that the input has ended, so items made only of those loop as
well. ``check`` refuses every schema that allows either, and bounds the rest:

* Every array item reads at least one varint (a number, an enum, a length, a union branch,
  a block count), which fails at the end of the input. So a block that declares more items
  than there are bytes left ends there, after at most that many items and one more. A map
  entry always does: its key is a string, whose length is a varint even when it is empty,
  so a map is never refused for its values' size, only for their cost (below).
* An item may not cost more than ``MAX_STEPS_PER_BYTE`` decoding steps (one schema node
  visited) per byte it takes, so an item of one ``int`` and a thousand ``null`` fields is
  refused too. Steps outside arrays and maps visit each node of the expanded schema at
  most once, so decoding ``n`` bytes takes at most about ``MAX_NODES + MAX_STEPS_PER_BYTE
  * n`` steps.
* No recursive types: every nesting level of a value is a C stack frame in fastavro's
  reader, and a 10 KB value of a self-referencing record nested 10,000 deep crashes the
  process. The expanded schema (named types substituted) is at most ``MAX_DEPTH`` deep and
  ``MAX_NODES`` large; its text at most ``MAX_SCHEMA_CHARS`` long.
* A decimal on ``bytes`` has no size bound and converting n bytes to a ``Decimal`` takes
  O(n²) (18 s for 512 KB): only a decimal on a ``fixed`` of at most ``MAX_DECIMAL_BYTES``.
* A record has at most ``MAX_FIELDS`` fields: avro's parser, which the registry runs on
  every schema it checks, is quadratic in them.

A schema with references (Confluent's schema references: named types defined by other
registered schemas) is judged as the schema it resolves to: ``resolve`` collects what it
references (no cycles, at most ``MAX_REFERENCES`` schemas, ``MAX_REFERENCE_DEPTH`` levels),
and the size, depth and cost limits apply to all of it together, so splitting a schema into
references gets around none of them.

Nothing else is judged here: a node of a schema the Avro parsers refuse counts as an ordinary
one-byte value, and the parser refuses the schema next.
No dependencies, so the registry and the decoder share it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

MAX_SCHEMA_CHARS = 256 * 1024  # a schema's JSON text
MAX_DEPTH = 32  # nesting levels of the expanded schema
MAX_NODES = 10_000  # types in the expanded schema, each use of a named type counted again
MAX_STEPS_PER_BYTE = 4  # nodes an array item or map entry may visit per byte it takes
MAX_DECIMAL_BYTES = 64  # the largest fixed a decimal may use (153 digits)
MAX_FIELDS = 1_000  # fields of one record: avro's parser checks each name against the others
MAX_REFERENCES = 64  # schemas one schema references, directly or through others
MAX_REFERENCE_DEPTH = 8  # levels of references below a schema

K = TypeVar("K")

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_PRIMITIVE_BYTES = {"null": 0, "boolean": 1, "int": 1, "long": 1, "float": 4, "double": 8,
                    "bytes": 1, "string": 1}  # the fewest bytes a value takes (a length is one)
_VARINTS = frozenset({"int", "long", "bytes", "string"})  # read as a varint (bytes, string: their length)


class UnboundedSchema(ValueError):
    """The schema lets a small value demand unbounded decoding work; the message says where."""


def fullname(name: str, namespace: str | None) -> str:
    """A name as Avro resolves it: dotted names are full, others live in the namespace."""
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def namespace_of(name: str) -> str | None:
    return name.rsplit(".", 1)[0] if "." in name else None


def check_size(text: str, dependencies: Sequence[str] = ()) -> None:
    """Refuse a schema text too long to parse and walk cheaply (before ``json.loads``); the
    texts of the schemas it references count towards the same limit."""
    total = len(text) + sum(len(t) for t in dependencies)
    if total > MAX_SCHEMA_CHARS:
        raise UnboundedSchema(f"the schema text is {total} characters, over {MAX_SCHEMA_CHARS}")


def check(schema: Any, dependencies: Sequence[Any] = ()) -> None:
    """Raise ``UnboundedSchema`` if decoding with ``schema`` (parsed JSON) is not bounded
    by the size of the value (the module docstring says how it is bounded). ``dependencies``
    are the schemas it references (as ``resolve`` orders them): their named types are defined
    first and each use of one in ``schema`` is costed as a use of a type defined in it."""
    walk = _Walk()
    for dependency in dependencies:
        walk.cost(dependency, None, 1)
    walk.cost(schema, None, 1)


def resolve(references: Sequence[K], fetch: Callable[[K], tuple[Hashable, str, Sequence[K]]]) -> list[str]:
    """The texts of the schemas ``references`` name, directly or through others, each once and
    after the schemas it references itself (the order their named types must be defined in).

    ``fetch`` turns a reference into (the referenced schema's identity, e.g. its id; its text;
    its own references) and raises if there is none. Refused with ``UnboundedSchema``: a cycle,
    more than ``MAX_REFERENCES`` schemas (or references of one schema), more than
    ``MAX_REFERENCE_DEPTH`` levels. Each schema is fetched at most once per reference to it.
    """
    order: list[str] = []
    done: set[Hashable] = set()

    def visit(reference: K, path: tuple[Hashable, ...]) -> None:
        handle, text, children = fetch(reference)
        if handle in path:
            raise UnboundedSchema("the schema references form a cycle")
        if handle in done:
            return
        if len(path) >= MAX_REFERENCE_DEPTH:
            raise UnboundedSchema(f"the schema references are nested deeper than {MAX_REFERENCE_DEPTH} levels")
        if len(children) > MAX_REFERENCES:
            raise UnboundedSchema(f"a schema has more than {MAX_REFERENCES} references")
        for child in children:
            visit(child, (*path, handle))
        done.add(handle)
        order.append(text)
        if len(order) > MAX_REFERENCES:
            raise UnboundedSchema(f"the schema references more than {MAX_REFERENCES} schemas")

    if len(references) > MAX_REFERENCES:
        raise UnboundedSchema(f"a schema has more than {MAX_REFERENCES} references")
    for reference in references:
        visit(reference, ())
    return order


@dataclass(frozen=True)
class _Cost:
    """What decoding one value of a type may take.

    ``min_varints``: the fewest varints a value reads (each fails at the end of the input).
    ``excess`` is the largest ``steps - MAX_STEPS_PER_BYTE * bytes`` over the type's values,
    the items of nested arrays and maps left out (each is charged on its own); it is
    additive, so a union takes its worst branch and a record sums its fields.
    """

    nodes: int
    depth: int
    min_bytes: int
    min_varints: int
    excess: int


_ONE_VARINT = _Cost(1, 1, 1, 1, 1 - MAX_STEPS_PER_BYTE)


class _Walk:
    """One pass over a schema; named types are costed once, where they are defined."""

    def __init__(self) -> None:
        self.named: dict[str, _Cost] = {}
        self.open: set[str] = set()  # named types being defined (a use inside one is recursion)

    def cost(self, node: Any, namespace: str | None, depth: int) -> _Cost:
        if depth > MAX_DEPTH:
            raise UnboundedSchema(f"the schema is nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, str):
            found = self._primitive(node) if node in PRIMITIVES else self._reference(node, namespace)
        elif isinstance(node, list):
            found = self._union(node, namespace, depth)
        elif isinstance(node, dict):
            found = self._complex(node, namespace, depth)
        else:
            found = _ONE_VARINT
        if found.nodes > MAX_NODES:
            raise UnboundedSchema(f"the schema expands to more than {MAX_NODES} types")
        if found.depth + depth - 1 > MAX_DEPTH:
            raise UnboundedSchema(f"the schema is nested deeper than {MAX_DEPTH} levels")
        return found

    @staticmethod
    def _primitive(kind: str) -> _Cost:
        size = _PRIMITIVE_BYTES[kind]
        return _Cost(1, 1, size, int(kind in _VARINTS), 1 - MAX_STEPS_PER_BYTE * size)

    def _reference(self, name: str, namespace: str | None) -> _Cost:
        candidates = (fullname(name, namespace), name)  # fastavro's resolution first
        if self.open.intersection(candidates):
            raise UnboundedSchema(f"the type {name!r} contains itself (recursive types are refused)")
        for candidate in candidates:
            if candidate in self.named:
                return self.named[candidate]
        return _ONE_VARINT  # an undefined name: the Avro parser refuses it

    def _union(self, branches: list[Any], namespace: str | None, depth: int) -> _Cost:
        costs = [self.cost(branch, namespace, depth + 1) for branch in branches] or [_ONE_VARINT]
        return _Cost(1 + sum(c.nodes for c in costs), 1 + max(c.depth for c in costs),
                     1 + min(c.min_bytes for c in costs),  # the branch index, then one branch
                     1 + min(c.min_varints for c in costs),
                     1 - MAX_STEPS_PER_BYTE + max(c.excess for c in costs))

    def _complex(self, node: dict[str, Any], namespace: str | None, depth: int) -> _Cost:
        kind = node.get("type")
        if isinstance(kind, (list, dict)):
            inner = self.cost(kind, namespace, depth + 1)
            return _Cost(inner.nodes, inner.depth + 1, inner.min_bytes, inner.min_varints, inner.excess)
        if not isinstance(kind, str):
            return _ONE_VARINT
        if node.get("logicalType") == "decimal":
            self._check_decimal(node, kind)
        if kind in PRIMITIVES:
            return self._primitive(kind)
        if kind in ("record", "error", "enum", "fixed"):
            return self._named(node, kind, namespace, depth)
        if kind == "array":
            items = self.cost(node.get("items"), namespace, depth + 1)
            self._check_repeated(items, "an array's items")
            return _Cost(1 + items.nodes, 1 + items.depth, 1, 1, 1 - MAX_STEPS_PER_BYTE)
        if kind == "map":
            values = self.cost(node.get("values"), namespace, depth + 1)
            key = self._primitive("string")
            self._check_repeated(_Cost(0, 0, key.min_bytes + values.min_bytes, key.min_varints + values.min_varints,
                                       key.excess + values.excess), "a map's entries")
            return _Cost(1 + values.nodes, 1 + values.depth, 1, 1, 1 - MAX_STEPS_PER_BYTE)
        return self._reference(kind, namespace)

    def _named(self, node: dict[str, Any], kind: str, namespace: str | None, depth: int) -> _Cost:
        name = node.get("name")
        if not isinstance(name, str):
            return _ONE_VARINT  # the Avro parser refuses a nameless named type
        explicit = node.get("namespace")
        if explicit is not None and not isinstance(explicit, str):
            # fastavro names the type by the value's text ("True.R"), other parsers take it as
            # absent: a reference to that text would be costed as another type than it decodes as
            raise UnboundedSchema("a namespace that is not a string, which Avro parsers read differently")
        full = fullname(name, explicit if isinstance(explicit, str) else namespace)
        if kind == "enum":
            found = _ONE_VARINT
        elif kind == "fixed":
            size = node.get("size")
            size = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0
            found = _Cost(1, 1, size, 0, 1 - MAX_STEPS_PER_BYTE * size)
        else:
            self.open.add(full)
            inner = namespace_of(full)
            fields = node.get("fields")
            if isinstance(fields, list) and len(fields) > MAX_FIELDS:
                # parsing is quadratic in them: 8,700 fields fit in 256 KiB and cost a second
                # of the registry's CPU per parse, and every check parses again
                raise UnboundedSchema(f"record {full[:100]!r} has {len(fields)} fields, over {MAX_FIELDS}")
            costs = [self.cost(f.get("type"), inner, depth + 1)
                     for f in (fields if isinstance(fields, list) else []) if isinstance(f, dict)]
            self.open.discard(full)
            found = _Cost(1 + sum(c.nodes for c in costs), 1 + max((c.depth for c in costs), default=0),
                          sum(c.min_bytes for c in costs), sum(c.min_varints for c in costs),
                          1 + sum(c.excess for c in costs))
        self.named[full] = found
        return found

    @staticmethod
    def _check_repeated(one: _Cost, what: str) -> None:
        if one.min_bytes == 0:
            raise UnboundedSchema(f"{what} can take zero bytes, so a few bytes can declare billions of them")
        if one.min_varints == 0:
            raise UnboundedSchema(f"{what} can be fixed-width values only, which fastavro skips without "
                                  "noticing the end of the input, so a few bytes can declare billions of them")
        if one.excess > 0:
            raise UnboundedSchema(f"{what} cost more than {MAX_STEPS_PER_BYTE} decoding steps per byte "
                                  "(zero-size fields)")

    @staticmethod
    def _check_decimal(node: dict[str, Any], kind: str) -> None:
        if kind == "bytes":
            raise UnboundedSchema("a decimal on bytes has no size bound (converting n bytes takes O(n²)): "
                                  f"use a fixed of at most {MAX_DECIMAL_BYTES} bytes")
        size = node.get("size")
        if kind == "fixed" and isinstance(size, int) and size > MAX_DECIMAL_BYTES:
            raise UnboundedSchema(f"a decimal on a fixed of {size} bytes (at most {MAX_DECIMAL_BYTES})")
