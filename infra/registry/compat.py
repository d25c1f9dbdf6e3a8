"""Avro compatibility levels on top of avro's own ReaderWriterCompatibilityChecker.

The checker is avro's port of Java's SchemaCompatibility (the rules Confluent runs): field
defaults, numeric and string/bytes promotions, unions, enums (with enum defaults), arrays,
maps, fixed sizes, named types and field aliases. One flaw is corrected here instead of
re-implementing the rules: it compares a reader's *type* aliases as written (``"Old"``)
with the writer's full name (``"ns.Old"``), so a rename through a relative alias was
refused. We hand it schemas whose aliases are fully qualified, which is what the
specification says aliases mean.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum

import avro.schema
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

from infra.registry import errors
from infra.registry.avro_schema import ParsedSchema, normalize


class Level(str, Enum):
    NONE = "NONE"
    BACKWARD = "BACKWARD"
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"
    FORWARD = "FORWARD"
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL = "FULL"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"

    @classmethod
    def parse(cls, value: object) -> Level:
        """Case-insensitive, as Confluent accepts ``backward`` too; anything else is 42203."""
        if isinstance(value, str):
            try:
                return cls(value.strip().upper())
            except ValueError:
                pass
        raise errors.invalid_compatibility_level()

    @property
    def transitive(self) -> bool:
        return self.value.endswith("_TRANSITIVE")

    @property
    def backward(self) -> bool:
        return self.value.startswith(("BACKWARD", "FULL"))

    @property
    def forward(self) -> bool:
        return self.value.startswith(("FORWARD", "FULL"))


DEFAULT_LEVEL = Level.BACKWARD


def _for_checker(schema: ParsedSchema) -> avro.schema.Schema:
    """The schema re-parsed from its normalized form, so every alias is fully qualified."""
    return avro.schema.parse(json.dumps(normalize(json.loads(schema.text))))


def reader_writer_problems(reader: ParsedSchema, writer: ParsedSchema) -> list[str]:
    """Why data written with ``writer`` cannot be read with ``reader`` (empty: it can)."""
    checker = ReaderWriterCompatibilityChecker()  # type: ignore[no-untyped-call]
    result = checker.get_compatibility(_for_checker(reader), _for_checker(writer))
    if result.compatibility is not SchemaCompatibilityType.incompatible:
        return []
    kinds = sorted({kind.name.upper() for kind in result.incompatibilities}) or ["INCOMPATIBLE"]
    return [
        f"{{errorType:'{', '.join(kinds)}', description:'{message}', location:'{', '.join(sorted(result.locations))}'}}"
        for message in sorted(result.messages) or ["incompatible"]
    ]


def problems(new: ParsedSchema, previous: Sequence[tuple[int, ParsedSchema]], level: Level) -> list[str]:
    """Messages explaining why ``new`` may not follow ``previous`` (oldest first) under ``level``.

    Non-transitive levels compare with the latest version only, transitive ones with all,
    exactly as Confluent does; an empty list means compatible.
    """
    if level is Level.NONE or not previous:
        return []
    against = previous if level.transitive else previous[-1:]
    found: list[str] = []
    for version, old in reversed(against):
        issues: list[str] = []
        if level.backward:
            issues += reader_writer_problems(reader=new, writer=old)
        if level.forward:
            issues += reader_writer_problems(reader=old, writer=new)
        if issues:
            found += issues + [f"{{oldSchemaVersion: {version}}}", f"{{compatibility: '{level.value}'}}"]
    return found
