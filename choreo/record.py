"""A record a service owns: one Redis hash per delivery, with a bounded life, written only
through typed operations.

Declared on the service (``service.record(...)``) so that the runtime knows it: the release
deletes a per-delivery record with its finished delivery, and ``rebuild-state`` restores it
from the events its ``rebuilt_from`` rules name, for any service, without knowing the service.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from choreo import keys
from choreo.effects import OnceEffect, Op
from choreo.events import Event
from choreo.state import HashWrite

# ARGV: TTL seconds (0: none), then field/value pairs
_PUT = OnceEffect("record_put", """
for i = 2, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return 'ok'
""")

# ARGV: the field to answer with, then field/value pairs; nothing is created
_UPDATE = OnceEffect("record_update", """
if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
for i = 2, #ARGV - 1, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return redis.call('HGET', KEYS[1], ARGV[1]) or ''
""")

# ARGV: TTL seconds (0: none), field, value. The field is its memo: a replay is answered what
# it holds, as the first run was (unless a put or an update of the same field came between)
_SET_ONCE = OnceEffect("record_set_once", """
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3])
if tonumber(ARGV[1]) > 0 and redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return redis.call('HGET', KEYS[1], ARGV[2])
""", remembers_itself=True)

Fields = Mapping[str, str | int | float]


@dataclass(frozen=True)
class RebuildRule:
    """How one event restores a record: ``fields(event)`` merged into the record of the
    event's delivery. ``when_consumed``: only once the owning service has committed past the
    event (the record is what the service did on reading it, not what the event says)."""

    model: type[Event]
    fields: Callable[[Any], Fields]
    when_consumed: bool = False


@dataclass
class Record:
    """One hash per delivery, ``<name>:{s<n>}<delivery id>``: in the delivery's hash slot, with a
    TTL (restarted by ``put``), and deleted with the delivery's state once it is finished
    when ``released_with_delivery``."""

    name: str
    ttl_s: int
    released_with_delivery: bool = False
    rules: list[RebuildRule] = field(default_factory=list)

    def key(self, delivery_id: str) -> str:
        return keys.of_delivery(self.name, delivery_id)

    def put(self, delivery_id: str, **fields: str | int | float) -> Op[None]:
        """Set these fields (an idempotent upsert) and restart the record's TTL. In a step it is
        applied with the step's completion, so what the handler does after it does not see it."""
        pairs = tuple(_pairs(fields))
        return Op(_PUT, (self.key(delivery_id),), (self.ttl_s, *pairs), lambda _: None,
                  write=HashWrite(self.key(delivery_id), self.ttl_s, pairs))

    def update(self, delivery_id: str, answer: str, **fields: str | int | float) -> Op[str | None]:
        """Set these fields if the record exists; the answer is its ``answer`` field, or
        ``None`` when there is no record (nothing to update)."""
        return Op(_UPDATE, (self.key(delivery_id),), (answer, *_pairs(fields)), lambda raw: raw or None)

    def set_once(self, delivery_id: str, name: str, value: str) -> Op[str]:
        """Set field ``name`` unless it is set; the answer is the value it holds (the first
        writer's)."""
        return Op(_SET_ONCE, (self.key(delivery_id),), (self.ttl_s, name, value), lambda raw: raw or "")

    def rebuilt_from(self, model: type[Event], fields: Callable[[Any], Fields], *,
                     when_consumed: bool = False) -> None:
        """Declare how ``model`` events restore this record after Redis was lost."""
        self.rules.append(RebuildRule(model, fields, when_consumed))


def _pairs(fields: Fields) -> list[str | int | float]:
    return [part for name, value in fields.items() for part in (name, value)]
