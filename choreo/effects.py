"""Idempotent Redis effects that give the same answer when replayed.

A consumer's Redis write is not part of its Kafka transaction. If the transaction aborts
after Redis recorded an effect, the replay must be told the same outcome (e.g. "ship",
"drone-7"), or the output of the aborted transaction is lost forever. So every effect
runs inside one Lua script that first looks up the outcome remembered for this event id,
and otherwise applies the effect and remembers its outcome, atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

ONCE_TEMPLATE = """
local remembered = redis.call('GET', KEYS[1])
if remembered then return remembered end
local once_ttl = tonumber(ARGV[1])
local outcome = (function(KEYS, ARGV)
%s
end)({select(2, unpack(KEYS))}, {select(2, unpack(ARGV))})
if not outcome then return false end
redis.call('SET', KEYS[1], outcome, 'EX', once_ttl)
return outcome
"""


class OnceEffect:
    """A Lua body run at most once per (event, effect); its string result is replayed after.

    The body sees its own ``KEYS``/``ARGV`` (without the runtime's bookkeeping) and
    returns a string (``cjson.encode`` for structure), or ``false`` when it did nothing
    (a transient "not now"): that is not remembered, so a retry asks again.
    """

    def __init__(self, name: str, body: str) -> None:
        self.name = name
        self.source = ONCE_TEMPLATE % body
        self._scripts: dict[int, Any] = {}

    def run(
        self,
        client: redis.Redis,
        once_key: str,
        keys: Sequence[str],
        args: Sequence[str | int | float],
        ttl_s: int,
    ) -> str | None:
        script = self._scripts.get(id(client))
        if script is None:
            script = self._scripts[id(client)] = client.register_script(self.source)
        result = script(keys=[once_key, *keys], args=[ttl_s, *args])
        if result is None:
            return None
        return result.decode() if isinstance(result, bytes) else str(result)
