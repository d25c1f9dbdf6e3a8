"""Parsing an Avro schema as the registry needs it: validated, comparable, and resolvable.

Identity is decided on a *normalized* form, not on the raw string (clients send the text as
the user typed it) and not on Avro's Parsing Canonical Form either: PCF drops defaults,
aliases and docs, so a v2 that only adds a default (a real, compatibility-relevant change)
would collapse onto v1's id. The normalized form keeps every attribute but removes what
carries no meaning: whitespace, key order, ``{"type": "int"}`` versus ``"int"``, and
namespaces (names are fully qualified instead), so equivalent spellings get one id.

A schema whose decoding work is not bounded by the value's size (``choreo.avro_bounds``:
arrays whose items can take no bytes, recursive types, too large or too deep) is refused like
an invalid one: every consumer of the subject would decode with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import avro.schema
import fastavro

from choreo import avro_bounds
from choreo.avro_bounds import PRIMITIVES, fullname, namespace_of
from registry import errors

NAMED = frozenset({"record", "error", "enum", "fixed"})


@dataclass(frozen=True)
class ParsedSchema:
    """A schema that passed both parsers; ``identity`` is what equal schemas share."""

    text: str
    identity: str
    avro: avro.schema.Schema = field(compare=False, repr=False)


def normalize(node: Any, namespace: str | None = None) -> Any:
    """The meaning-preserving normal form described in the module docstring."""
    if isinstance(node, str):
        return node if node in PRIMITIVES else fullname(node, namespace)
    if isinstance(node, list):
        return [normalize(branch, namespace) for branch in node]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if isinstance(kind, (list, dict)):
        inner = normalize(kind, namespace)
        rest = {k: v for k, v in node.items() if k != "type"}
        return inner if not rest else {**rest, "type": inner}
    if kind in PRIMITIVES and set(node) == {"type"}:
        return kind
    out: dict[str, Any] = {k: v for k, v in node.items() if k != "namespace"}
    if kind in NAMED and isinstance(node.get("name"), str):
        explicit = node.get("namespace")
        # an explicit namespace wins, and an explicit "" means "no namespace" (the spec's rule)
        full = fullname(node["name"], explicit if isinstance(explicit, str) else namespace)
        out["name"] = full
        namespace = namespace_of(full)
        if isinstance(node.get("aliases"), list):
            out["aliases"] = [fullname(a, namespace) if isinstance(a, str) else a for a in node["aliases"]]
    elif "namespace" in node:
        out["namespace"] = node["namespace"]
    if kind in ("record", "error") and isinstance(node.get("fields"), list):
        out["fields"] = [
            {**f, "type": normalize(f.get("type"), namespace)} if isinstance(f, dict) else f
            for f in node["fields"]
        ]
    elif kind == "array" and "items" in node:
        out["items"] = normalize(node["items"], namespace)
    elif kind == "map" and "values" in node:
        out["values"] = normalize(node["values"], namespace)
    return out


def parse(text: Any) -> ParsedSchema:
    """Validate with avro (names, structure) and fastavro (defaults); raise 42201 on any flaw.

    Two parsers because each misses something the other catches: avro accepts a default of
    the wrong type, fastavro accepts invalid names.
    """
    if not isinstance(text, str) or not text.strip():
        raise errors.invalid_schema("Empty schema")
    try:
        avro_bounds.check_size(text)
        document = json.loads(text)
        avro_bounds.check(document)
    except avro_bounds.UnboundedSchema as exc:
        raise errors.invalid_schema(f"the schema cannot be decoded in bounded work: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_schema(f"the schema is not valid JSON ({exc.__class__.__name__})") from None
    try:
        parsed = avro.schema.parse(json.dumps(document))
        fastavro.parse_schema(document)
        normal = normalize(document)
    except RecursionError:
        raise errors.invalid_schema("the schema is nested too deeply") from None
    except Exception as exc:  # the parsers raise a zoo of types; any of them means "invalid"
        raise errors.invalid_schema(str(exc) or exc.__class__.__name__) from None
    compact = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    identity = json.dumps(normal, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return ParsedSchema(text=compact, identity=identity, avro=parsed)
