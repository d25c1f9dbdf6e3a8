"""One Lua script run for many items in one call, each item as if it were its own call.

The runtime runs a script per event several times per hop (dedupe, begin, finish, the
steps an output opens, effects). Sent one command per item in a redis-py pipeline, each
cost the service about 10 µs of Python (building, packing and parsing the command) and
Redis a command of its own; one call for the batch costs about 4 µs of Redis per item for
its arguments (bench/README.md, "Rate: CPU, spread thin").

Each item gets its own ``KEYS`` and ``ARGV``, and the body runs once per item exactly as
it would alone, so a script reads the same either way; ``after_each`` (say, writing back
the step records an item changed) runs after each item. The answers come back in order,
``None`` for an item whose body returned nothing or ``false``.

One call names the keys of many deliveries. On a Redis Cluster a script may touch one hash
slot only, so ``run_together`` sends one call per slot (a delivery's keys carry its shard's
tag, ``choreo.keys``: a batch splits into at most one call per shard), pipelined per node.
Each round trip is one ``redis batch`` span when tracing is on (``choreo.tracing``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import redis

from choreo import metrics, tracing
from choreo.config import settings
from choreo.redis_client import NodePipelines, is_cluster, slot_of

# ARGV: the item count n, n key counts, n arg counts, then every item's args; KEYS: every
# item's keys, in item order
BATCH_TEMPLATE = """
%(prelude)s
local function each(KEYS, ARGV)
%(body)s
end
local n = tonumber(ARGV[1])
local answers, key_at, arg_at = {}, 1, 2 * n + 2
for i = 1, n do
  local key_count, arg_count = tonumber(ARGV[1 + i]), tonumber(ARGV[1 + n + i])
  local answer = each({unpack(KEYS, key_at, key_at + key_count - 1)},
                      {unpack(ARGV, arg_at, arg_at + arg_count - 1)})
  %(after_each)s
  if answer == nil then answer = false end
  answers[i] = answer
  key_at, arg_at = key_at + key_count, arg_at + arg_count
end
return answers
"""

# items per call: a call holds Redis for its whole run (a step transition takes Redis
# about 20 µs per item)
CHUNK = 200

Item = tuple[Sequence[str], Sequence[str | int | float]]


def batched(body: str, prelude: str = "", after_each: str = "") -> str:
    return BATCH_TEMPLATE % {"prelude": prelude, "body": body, "after_each": after_each}


_shared: dict[tuple[int, str], BatchScript] = {}


class BatchScript:
    """A script body registered to run over many (keys, args) items per call; ``name``
    labels its items in ``choreo_redis_script_items_total``."""

    def __init__(self, client: redis.Redis, name: str, body: str, prelude: str = "",
                 after_each: str = "") -> None:
        self.client = client
        self.name = name
        self._script = client.register_script(batched(body, prelude, after_each))

    @classmethod
    def of(cls, client: redis.Redis, name: str, body: str) -> BatchScript:
        """The one ``BatchScript`` of ``body`` for ``client`` (made on first use)."""
        script = _shared.get((id(client), body))
        if script is None:
            script = _shared[(id(client), body)] = cls(client, name, body)
        return script

    @property
    def sha(self) -> str:
        return str(self._script.sha)

    def run(self, items: Sequence[Item]) -> list[Any]:
        """Every item's answer, in order: one round trip (one call per ``CHUNK`` items)."""
        return run_together(self.client, [(self, items)])[0]

    def queue(self, items: Sequence[Item], client: Any) -> Any:
        """Call the script for ``items`` on ``client`` (a pipeline: queued, answered by it)."""
        keys = [key for item_keys, _ in items for key in item_keys]
        args: list[str | int | float] = [len(items)]
        args += [len(item_keys) for item_keys, _ in items]
        args += [len(item_args) for _, item_args in items]
        args += [arg for _, item_args in items for arg in item_args]
        return self._script(keys=keys, args=args, client=client)


Call = tuple[int, BatchScript, list[int], list[Item]]  # batch, script, item positions, items


def run_together(client: redis.Redis, batches: Sequence[tuple[BatchScript, Sequence[Item]]]
                 ) -> list[list[Any]]:
    """Several scripts' batches in one round trip: each batch's answers, in order."""
    calls: list[Call] = []
    for b, (script, items) in enumerate(batches):
        for positions in by_slot(client, items):
            for i in range(0, len(positions), CHUNK):
                chunk = positions[i:i + CHUNK]
                calls.append((b, script, chunk, [items[p] for p in chunk]))
    answers: list[list[Any]] = [[None] * len(items) for _, items in batches]
    item_count = 0
    for _, script, _, items in calls:
        metrics.SCRIPT_ITEMS.labels(script.name).inc(len(items))
        item_count += len(items)
    span = tracing.start_redis_batch(len(calls), item_count) if tracing.enabled() else None
    with tracing.spanning(span):
        replies = _send(client, calls)
    for (b, _, positions, _), reply in zip(calls, replies):
        if isinstance(reply, Exception):  # the whole call refused (MOVED, NOSCRIPT, ...)
            raise reply
        for answer in reply:  # an item's error reply comes nested, where redis-py leaves it
            if isinstance(answer, Exception):
                raise answer
        for position, answer in zip(positions, reply):
            answers[b][position] = answer
    return answers


def run_in_order(client: redis.Redis, items: Iterable[tuple[BatchScript, Item]]) -> list[Any]:
    """Items of several scripts in one round trip, run in the order given (consecutive items
    of one script share a call); each item's answer, in that order."""
    runs: list[tuple[BatchScript, list[Item]]] = []
    for script, item in items:
        if runs and runs[-1][0] is script:
            runs[-1][1].append(item)
        else:
            runs.append((script, [item]))
    return [answer for run in run_together(client, runs) for answer in run]


def by_slot(client: redis.Redis, items: Sequence[Item]) -> list[list[int]]:
    """The items' positions grouped by the hash slot of their keys (one group on a single
    node, where any keys may go together)."""
    if not is_cluster(client):
        return [list(range(len(items)))] if items else []
    groups: dict[int | None, list[int]] = {}  # None: items without keys, run on any node
    for position, (keys, _) in enumerate(items):
        groups.setdefault(slot_of(client, keys[0]) if keys else None, []).append(position)
    return list(groups.values())


def _send(client: redis.Redis, calls: Sequence[Call]) -> list[Any]:
    """Every call's reply: one call alone, or one pipeline per node (``NodePipelines``)."""
    if len(calls) == 1 and not is_cluster(client) and not settings().redis_wait_replicas:
        _, script, _, items = calls[0]
        return [script.queue(items, client)]
    pipes = NodePipelines(client)
    for _, script, _, items in calls:
        keys = items[0][0]
        script.queue(items, pipes.on(keys[0] if keys else None))
    return pipes.execute()
