"""Parsing an Avro schema as the registry needs it: validated, comparable, and resolvable.

Identity is decided on a *normalized* form, not on the raw string (clients send the text as
the user typed it) and not on Avro's Parsing Canonical Form either: PCF drops defaults,
aliases and docs, so a v2 that only adds a default (a real, compatibility-relevant change)
would collapse onto v1's id. The normalized form keeps every attribute but removes what
carries no meaning: whitespace, key order, ``{"type": "int"}`` versus ``"int"``, and
namespaces (names are fully qualified instead), so equivalent spellings get one id.

A schema may reference named types registered in other subjects (``Reference``: Confluent's
schema references). The referenced schemas are parsed first, in dependency order, so the
schema may use their type names; its identity is its normalized form *and* its references
(the same text resolving to other types is another schema), and the bounds apply to the
whole resolved schema.

A schema whose decoding work is not bounded by the value's size (``choreo.avro_bounds``:
arrays whose items can take no bytes, recursive types, too large or too deep) is refused like
an invalid one: every consumer of the subject would decode with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import avro.name
import avro.schema
import fastavro

from choreo import avro_bounds
from choreo.avro_bounds import PRIMITIVES, fullname, namespace_of
from registry import errors

NAMED = frozenset({"record", "error", "enum", "fixed"})


LATEST = -1  # a reference's version as a request may give it: the subject's latest
MAX_NAME_CHARS = 1024  # a subject's name, and a reference's


@dataclass(frozen=True)
class Reference:
    """A named type this schema uses from another subject's version (Confluent's
    ``{"name", "subject", "version"}``). ``name`` is a label (Confluent does not match it
    against the types the referenced schema defines); subject and version say where."""

    name: str
    subject: str
    version: int

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "subject": self.subject, "version": self.version}


def references_of(raw: Any, requested: bool = False) -> tuple[Reference, ...]:
    """The ``references`` of a request or record (absent or null: none); ``ValueError`` says
    what is wrong. ``requested``: a request's, which may give version -1 (resolved before
    storing) and names of at most ``MAX_NAME_CHARS``; a record of the log is read as it was
    written, whatever an earlier version let in."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ValueError("references must be a list")
    found = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError("a reference must be an object with name, subject and version")
        name, subject, version = item.get("name"), item.get("subject"), item.get("version")
        if not isinstance(name, str) or not name or not isinstance(subject, str) or not subject:
            raise ValueError("a reference needs a non-empty name and subject")
        if requested and (len(name) > MAX_NAME_CHARS or len(subject) > MAX_NAME_CHARS):
            raise ValueError(f"a reference's name and subject are at most {MAX_NAME_CHARS} characters")
        if type(version) is not int or not (0 < version <= 2**31 - 1 or (requested and version == LATEST)):
            raise ValueError(f"the version of reference {name[:80]!r} must be a positive 32-bit integer"
                             + (" or -1 (latest)" if requested else ""))
        found.append(Reference(name, subject, version))
    if len({r.name for r in found}) != len(found):
        raise ValueError("two references have the same name")
    return tuple(found)


@dataclass(frozen=True)
class ParsedSchema:
    """A schema that passed both parsers; ``identity`` is what equal schemas share.

    ``dependencies`` are the texts of every schema it references, directly or not, in the
    order their types are defined (``avro_bounds.resolve``). A referenced type is used by its
    full name (or, inside the same namespace, its short one): neither avro nor fastavro looks
    a short name up outside the enclosing namespace."""

    text: str
    identity: str
    avro: avro.schema.Schema = field(compare=False, repr=False)
    references: tuple[Reference, ...] = ()
    dependencies: tuple[str, ...] = field(default=(), compare=False, repr=False)


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


def identity_of(document: Any, references: Sequence[Reference]) -> str:
    """What equal schemas share: the normalized form, and the references if there are any
    (a schema without them keeps the identity it always had). It does not depend on what
    the references resolve to, so the log's reader computes it without resolving them."""
    normal = normalize(document)
    if references:
        normal = {"schema": normal, "references": [r.as_json() for r in references]}
    return json.dumps(normal, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _avro_parsed(documents: Sequence[Any]) -> avro.schema.Schema:
    """The last of ``documents`` parsed by avro after the others, so it may use their names."""
    names = avro.name.Names()
    parsed: avro.schema.Schema | None = None
    for document in documents:
        parsed = avro.schema.make_avsc_object(document, names)
    assert parsed is not None
    return parsed


def checker_form(schema: ParsedSchema) -> avro.schema.Schema:
    """The schema as avro parses it from its normalized form (every alias fully qualified)
    after its dependencies, for the compatibility checker."""
    return _avro_parsed([normalize(json.loads(text)) for text in (*schema.dependencies, schema.text)])


def parse(text: Any, references: Sequence[Reference] = (), dependencies: Sequence[str] = ()) -> ParsedSchema:
    """Validate with avro (names, structure) and fastavro (defaults); raise 42201 on any flaw.

    Two parsers because each misses something the other catches: avro accepts a default of
    the wrong type, fastavro accepts invalid names. ``dependencies``: the texts of the
    schemas ``references`` resolve to (``avro_bounds.resolve``), parsed first.
    """
    if not isinstance(text, str) or not text.strip():
        raise errors.invalid_schema("Empty schema")
    try:
        avro_bounds.check_size(text, dependencies)
        document = json.loads(text)
        before = [json.loads(dependency) for dependency in dependencies]
        avro_bounds.check(document, before)
    except avro_bounds.UnboundedSchema as exc:
        raise errors.invalid_schema(f"the schema cannot be decoded in bounded work: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_schema(f"the schema is not valid JSON ({exc.__class__.__name__})") from None
    try:
        parsed = _avro_parsed([*before, document])
        named: dict[str, Any] = {}
        for each in (*before, document):
            fastavro.parse_schema(each, named_schemas=named)
        identity = identity_of(document, references)
    except RecursionError:
        raise errors.invalid_schema("the schema is nested too deeply") from None
    except Exception as exc:  # the parsers raise a zoo of types; any of them means "invalid"
        raise errors.invalid_schema(str(exc) or exc.__class__.__name__) from None
    compact = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    return ParsedSchema(text=compact, identity=identity, avro=parsed, references=tuple(references),
                        dependencies=tuple(dependencies))
