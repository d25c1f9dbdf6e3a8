"""Consumer-side deduplication on stable event ids, one Redis round trip per batch.

An event id (with its attempt: a supervisor requeue is a new attempt) is remembered per
service with the input position (topic|partition|offset) that first carried it. The same
position again is a *replay* after an aborted transaction and must run again (its outputs
were never committed); another position is a *duplicate* (a producer retry, a redrive, a
copy) whose outputs were already committed from the first position: it is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

_SEEN = """
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous and previous ~= ARGV[2] then return 0 end
if not previous then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return 1
"""


def seen_key(delivery_id: str) -> str:
    return f"seen:{{{delivery_id}}}"


class Deduper:
    def __init__(self, client: redis.Redis, service: str, ttl_s: int) -> None:
        self.client = client
        self.service = service
        self.ttl_s = ttl_s
        self._script = client.register_script(_SEEN)

    def fresh(self, items: Sequence[tuple[str, str, int, str]]) -> list[bool]:
        """For (delivery id, event id, attempt, position) items: True unless a duplicate."""
        if not items:
            return []
        pipe = self.client.pipeline(transaction=False)
        for delivery_id, event_id, attempt, position in items:
            self._script(keys=[seen_key(delivery_id)],
                         args=[f"{self.service}:{event_id}:{attempt}", position, self.ttl_s],
                         client=pipe)
        return [bool(r) for r in pipe.execute()]
