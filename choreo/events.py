"""The base of every event model: a pydantic mirror of one ``.avsc`` contract.

The ``.avsc`` file is the source of truth (it is what the registry checks for
compatibility); the model is what code touches. A test keeps the two in step.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import is_dataclass
from functools import cache, partial
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin

from annotated_types import Len, MaxLen
from pydantic import BaseModel, ConfigDict

from choreo.envelope import Envelope

E = TypeVar("E", bound="Event")
# The most items a list in an event may hold. Each declares it (``Field(max_length=...)``):
# an array of empty strings is a byte an item in Avro and a pointer an item in Python, so an
# unbounded one would let a record a consumer takes (512 KiB) hold some ten megabytes for
# its batch's life.
MAX_ITEMS = 100


UNBOUNDED = "every list an event carries declares its most length (Field(max_length=...))"
# pydantic's models do not pass their config to the models in them
TAKES_NAN = "every model an event carries refuses NaN and infinity as Event does (allow_inf_nan=False)"
# a dataclass takes a config of its own and its fields are not walked; Any is not checked at all
NOT_A_RECORD = "every record an event carries is a pydantic model, as an Avro record is (no dataclass, no Any)"


def _undeclared(model: type[BaseModel], seen: frozenset[type[BaseModel]] = frozenset()) -> list[tuple[str, str]]:
    """Where in ``model`` (and in the models in it), at any depth, a collection declares no
    most length (``UNBOUNDED``), a model or a field takes NaN (``TAKES_NAN``) or a record is
    no model (``NOT_A_RECORD``): (where, which)."""
    found: list[tuple[str, str]] = []
    for name, info in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        if any(getattr(meta, "allow_inf_nan", None) for meta in info.metadata):
            found.append((where, TAKES_NAN))
        found += _open(where, info.annotation, _declares_most(info), seen | {model})
    return found


def _open(where: str, tp: Any, bounded: bool, seen: frozenset[type[BaseModel]]) -> list[tuple[str, str]]:
    """``_undeclared`` of ``tp``, the type at ``where`` (``bounded``: ``tp``'s own most length
    is declared)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or is_dataclass(tp):
        return [(where, NOT_A_RECORD)]
    if origin is Annotated:
        return _open(where, args[0], bounded or any(_declares_most(m) for m in args[1:]), seen)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp in seen:
            return []
        lenient = [] if tp.model_config.get("allow_inf_nan") is False else [(where, TAKES_NAN)]
        return lenient + _undeclared(tp, seen)
    if origin in (Union, UnionType):  # ``list[str] | None``: the field's bound is the list's
        return [f for arg in args for f in _open(where, arg, bounded, seen)]
    if _collection(origin or tp):
        fixed = origin is tuple and bool(args) and Ellipsis not in args  # tuple[str, str]: two
        if not (bounded or fixed):
            return [(where, UNBOUNDED)]
        where += "[]"
    return [f for arg in args for f in _open(where, arg, False, seen)]


def _collection(tp: Any) -> bool:
    """Whether ``tp`` holds any number of items (a list, a mapping, a sequence...), text aside."""
    return isinstance(tp, type) and issubclass(tp, Collection) and not issubclass(tp, (str, bytes, bytearray))


def _declares_most(meta: Any) -> bool:
    """Whether ``meta`` (a field's, or an ``Annotated`` argument) declares a most length:
    ``max_length=`` gives ``MaxLen``, ``conlist`` and ``Len`` a ``Len``."""
    found = [meta, *getattr(meta, "metadata", ())]
    return any(isinstance(m, (MaxLen, Len)) and m.max_length is not None for m in found)


@cache
def _read_schema(path: Path) -> str:
    text = path.read_text()
    json.loads(text)  # fail at import time on a broken contract, not on the first message
    return text


class Event(BaseModel):
    """An event: subclasses name their contract file and the topic they are published to."""

    # no NaN or infinity: JSON has neither (a join keeps its parts as JSON, which wrote NaN
    # as null and then could not read the part back), and no business value is one
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    schema_file: ClassVar[Path]
    topic: ClassVar[str]

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """An event model with a list not bounded, a model or field that takes NaN, or a record
        that is no model (``_undeclared``) is refused where it is declared; so is one whose
        types are not all known there, since pydantic would complete it later, past this check."""
        super().__pydantic_init_subclass__(**kwargs)
        if not cls.__pydantic_complete__:
            raise TypeError(f"{cls.__name__} names a type not yet defined (or defers its build): declare "
                            f"the models an event carries before it")
        by_rule: dict[str, list[str]] = {}
        for where, rule in dict.fromkeys(_undeclared(cls)):
            by_rule.setdefault(rule, []).append(where)
        if by_rule:
            raise TypeError("; ".join(f"{', '.join(wheres)}: {rule}" for rule, wheres in by_rule.items()))

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


def disagrees_with(event: Event | Mapping[str, Any], envelope: Envelope) -> str:
    """Why ``event``'s body is not what its envelope says it is, or ``""`` when it is. The
    runtime keys a delivery's steps, dedupe and effect answers by the envelope's delivery, and
    tells an outcome to the envelope's owner (``choreo.outcomes``), while a handler acts on
    its body: a record whose two disagree would let one delivery's input change another's
    records and pools, or one owner's request be told to another. So it is refused before any
    handler reads it (``Runner``; ``choreo.testing.run`` does the same, and ``rebuild-state``
    takes nothing from such a record)."""
    field = event.get if isinstance(event, Mapping) else partial(getattr, event)  # a decoded body too
    named = field("delivery_id", None)
    # no value of the body in the text: it reaches the dead letter's headers and the logs
    if isinstance(named, str) and named != envelope.correlation_id:
        return f"its body names another delivery than its envelope ({len(named)} characters)"
    owner = field("owner_id", None)
    if envelope.owner and isinstance(owner, str) and owner != envelope.owner:
        return "its body names another owner than its envelope"
    return ""
