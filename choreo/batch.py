"""One Lua script run for many items in one call, each item as if it were its own call.

The runtime runs a script per event several times per hop (dedupe, begin, finish, the
steps an output opens, effects). Sent one command per item in a redis-py pipeline, each
cost the service about 10 µs of Python (building, packing and parsing the command) and
Redis a command of its own; one call for the batch costs about 2 µs per item
(bench/README.md, "Scripts by the batch").

Each item gets its own ``KEYS`` and ``ARGV``, and the body runs once per item exactly as
it would alone, so a script reads the same either way; ``after_each`` (say, writing back
the step records an item changed) runs after each item. The answers come back in order,
``None`` for an item whose body returned nothing or ``false``.

One call names the keys of many deliveries: on Redis Cluster it would have to be split by
hash slot (the delivery id's hash tag), in ``run_together`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

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


class BatchScript:
    """A script body registered to run over many (keys, args) items per call."""

    def __init__(self, client: redis.Redis, body: str, prelude: str = "",
                 after_each: str = "") -> None:
        self.client = client
        self._script = client.register_script(batched(body, prelude, after_each))

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


def run_together(client: redis.Redis, batches: Sequence[tuple[BatchScript, Sequence[Item]]]
                 ) -> list[list[Any]]:
    """Several scripts' batches in one round trip: each batch's answers, in order."""
    calls = [(b, script, items[i:i + CHUNK]) for b, (script, items) in enumerate(batches)
             for i in range(0, len(items), CHUNK)]
    replies: list[Any] = []
    if len(calls) == 1:
        _, script, chunk = calls[0]
        replies = [script.queue(chunk, client)]
    elif calls:
        pipe = client.pipeline(transaction=False)
        for _, script, chunk in calls:
            script.queue(chunk, pipe)
        replies = pipe.execute()
    answers: list[list[Any]] = [[] for _ in batches]
    for (b, _, _), reply in zip(calls, replies):
        for answer in reply:  # an item's error reply comes nested, where redis-py leaves it
            if isinstance(answer, Exception):
                raise answer
        answers[b] += reply
    return answers
