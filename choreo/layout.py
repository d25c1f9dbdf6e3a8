"""The state's layout version in Redis, and the check that keeps apart versions that could
not read each other's records.

**Within a layout, versions run side by side.** Every change to what the runtime keeps in
Redis that does not bump ``keys.LAYOUT`` only adds: a value appended to a step record, a new
field in a hash, a new key with a TTL. Every version keeps what it does not know (a step
record is written back with the values past its own ``STEP_FIELDS``, through Redis's cjson:
so an appended value is a string or an integer below 10^14, which survive that unchanged,
never an array, an object or a float), and treats a field it does not know as absent. The
n-th effect of a kind for one event has its own remembered answer, and a remembered
answer's form only grows at its end, so each version reads the other's. So a service
upgraded one instance at a time needs no drain: the new instances continue the deliveries
the old ones began, and the old ones those the new ones began
(``tests/integration/test_rolling_upgrade.py``). A service's own records
(``service.record``) and its events follow the same rule: fields are added, never renamed
or given a new meaning, and an event's new field is optional (the registry's BACKWARD check).

**Across layouts, they do not.** A change an older version would misread (a key's form, a
field's meaning, a new step status) is a new layout. The store names its layout in one key,
set by the first process that runs on it (and again by the first after a FLUSHALL, or by
``choreo ops rebuild-state``). A process refuses to start on a store of another layout,
naming both, rather than write records beside ones it cannot read, and a running service
checks again every few seconds and stops if the store changed under it: drain the old
version (or rebuild the state from Kafka after a FLUSHALL) before the new layout runs.
"""

from __future__ import annotations

import redis

from choreo import keys

LAYOUT_KEY = keys.tagged("layout")


class LayoutMismatch(RuntimeError):
    """The store holds state of a layout this version does not read."""


def claim(client: redis.Redis) -> int:
    """The store's layout, set to this version's when it names none. Raises
    ``LayoutMismatch`` when it names another."""
    before = client.set(LAYOUT_KEY, keys.LAYOUT, nx=True, get=True)  # the value it had, if any
    if before is None:
        return keys.LAYOUT
    text = before.decode(errors="replace") if isinstance(before, bytes) else str(before)
    if text != str(keys.LAYOUT):
        raise LayoutMismatch(
            f"Redis holds state of layout {text[:20]!r} and this version reads layout {keys.LAYOUT}: "
            "stop the other version's processes and drain (or rebuild the state from Kafka) first")
    return keys.LAYOUT
