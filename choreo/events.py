"""The base of every event model: a pydantic mirror of one ``.avsc`` contract.

The ``.avsc`` file is the source of truth (it is what the registry checks for
compatibility); the model is what code touches. A test keeps the two in step.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

E = TypeVar("E", bound="Event")


@cache
def _read_schema(path: Path) -> str:
    text = path.read_text()
    json.loads(text)  # fail at import time on a broken contract, not on the first message
    return text


class Event(BaseModel):
    """An event: subclasses name their contract file and the topic they are published to."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_file: ClassVar[Path]
    topic: ClassVar[str]

    @classmethod
    def avro_schema(cls) -> str:
        return _read_schema(cls.schema_file)

    def to_avro(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_avro(cls: type[E], record: dict[str, Any]) -> E:
        # a v1 reader of a v2 record only gets the fields it knows (Avro resolution drops the rest)
        return cls.model_validate(record)

    @property
    def key(self) -> str:
        """The partition key: every event of a delivery shares one, so its order is kept."""
        return str(getattr(self, "delivery_id"))
