"""Avro compatibility levels on top of avro's own ReaderWriterCompatibilityChecker.

The checker is avro's port of Java's SchemaCompatibility (the rules Confluent runs): field
defaults, numeric and string/bytes promotions, unions, enums (with enum defaults), arrays,
maps, fixed sizes, named types and field aliases. One flaw is corrected here instead of
re-implementing the rules: it compares a reader's *type* aliases as written (``"Old"``)
with the writer's full name (``"ns.Old"``), so a rename through a relative alias was
refused. We hand it schemas whose aliases are fully qualified, which is what the
specification says aliases mean. A schema with references is checked as it resolves: the
types it uses from other subjects are compared like its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from enum import Enum

import avro.schema
from avro.compatibility import (
    ReaderWriterCompatibilityChecker,
    SchemaCompatibilityResult,
    SchemaCompatibilityType,
)

from registry import errors
from registry.avro_schema import ParsedSchema, checker_form


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


class CheckTimeout(Exception):
    """The compatibility walk passed its deadline."""


class _DeadlineChecker(ReaderWriterCompatibilityChecker):
    """avro's checker, stopped at a deadline (``time.monotonic``). Its walk costs more than
    the schemas' size (quadratic in a record's fields: 1.3 s for 5,000 of them), and every
    step of it, a field or a branch, goes through ``get_compatibility``."""

    def __init__(self, deadline: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.deadline = deadline

    def get_compatibility(self, reader: avro.schema.Schema, writer: avro.schema.Schema,
                          reference_token: str = ReaderWriterCompatibilityChecker.ROOT_REFERENCE_TOKEN,
                          location: list[str] | None = None) -> SchemaCompatibilityResult:
        if time.monotonic() > self.deadline:
            raise CheckTimeout()
        return super().get_compatibility(reader, writer, reference_token, location)


def reader_writer_problems(reader: ParsedSchema, writer: ParsedSchema,
                           deadline: float = math.inf) -> list[str]:
    """Why data written with ``writer`` cannot be read with ``reader`` (empty: it can);
    ``CheckTimeout`` once ``deadline`` has passed."""
    checker = _DeadlineChecker(deadline)
    result = checker.get_compatibility(checker_form(reader), checker_form(writer))
    if result.compatibility is not SchemaCompatibilityType.incompatible:
        return []
    kinds = sorted({kind.name.upper() for kind in result.incompatibilities}) or ["INCOMPATIBLE"]
    return [
        f"{{errorType:'{', '.join(kinds)}', description:'{message}', location:'{', '.join(sorted(result.locations))}'}}"
        for message in sorted(result.messages) or ["incompatible"]
    ]


def problems(new: ParsedSchema, previous: Sequence[tuple[int, ParsedSchema]], level: Level,
             deadline: float = math.inf) -> list[str]:
    """Messages explaining why ``new`` may not follow ``previous`` (oldest first) under ``level``.

    Non-transitive levels compare with the latest version only, transitive ones with all,
    exactly as Confluent does; an empty list means compatible. ``CheckTimeout`` once
    ``deadline`` (``time.monotonic``) has passed.
    """
    if level is Level.NONE or not previous:
        return []
    against = previous if level.transitive else previous[-1:]
    found: list[str] = []
    for version, old in reversed(against):
        issues: list[str] = []
        if level.backward:
            issues += reader_writer_problems(reader=new, writer=old, deadline=deadline)
        if level.forward:
            issues += reader_writer_problems(reader=old, writer=new, deadline=deadline)
        if issues:
            found += issues + [f"{{oldSchemaVersion: {version}}}", f"{{compatibility: '{level.value}'}}"]
    return found
