"""Consumer-side deduplication on stable event ids, one Redis call per batch.

An event id (with its attempt: a supervisor requeue is a new attempt) is remembered per
service with the input position (topic|partition|offset) that first carried it. The same
position again is a *replay* after an aborted transaction and must run again (its outputs
were never committed); another position is a *duplicate* (a producer retry, a redrive, a
copy) whose outputs were already committed from the first position: it is skipped.

A workflow service also skips every event of a *released* delivery (``choreo.release``): its
dedupe entries are gone with the rest of its state, and the tombstone left in its step table
says it is finished.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Sequence
from enum import StrEnum

import redis

from choreo import keys
from choreo.batch import BatchScript
from choreo.state import Sighting, delivery_key

# KEYS: the dedupe hash, the step table. ARGV: field, position, ttl s, '1' to refuse released.
_SEEN = """
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[2], 'done') == 1 then return 2 end
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous and previous ~= ARGV[2] then return 0 end
if not previous then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return 1
"""


def seen_key(delivery_id: str) -> str:
    return keys.of_delivery("seen", delivery_id)


def seen_field(service: str, event_id: str, attempt: int) -> str:
    """``<service>:<event id>:<attempt>``: the service's own prefix lets the release take only
    the workflow's entries (``choreo.release``)."""
    return f"{seen_prefix(service, event_id)}{attempt}"


def seen_prefix(service: str, event_id: str) -> str:
    """An event's field without its attempt: a fan-in half that joins a newer attempt claims
    the event at that attempt (``choreo.state`` ``_BEGIN``)."""
    return f"{service}:{compact_id(event_id)}:"


def compact_id(event_id: str) -> str:
    """An event id as it is written into Redis field names: a UUID's 16 bytes in URL-safe
    base64 (22 characters instead of 36: a delivery's dedupe entries and effect answers name
    about a dozen events, bench/README.md); any other id as it is."""
    try:
        return base64.urlsafe_b64encode(uuid.UUID(event_id).bytes).rstrip(b"=").decode()
    except ValueError:
        return event_id


class Seen(StrEnum):
    FRESH = "fresh"  # first sighting, or a replay at the same position: run it
    DUPLICATE = "duplicate"  # already handled from another position
    RELEASED = "released"  # its delivery is finished and its state released


_VERDICTS = {0: Seen.DUPLICATE, 1: Seen.FRESH, 2: Seen.RELEASED}


class Deduper:
    def __init__(self, client: redis.Redis, service: str, ttl_s: int,
                 refuse_released: bool = False) -> None:
        self.client = client
        self.service = service
        self.ttl_s = ttl_s
        # only a workflow's own services: the releaser waits for their groups, not for others
        self.refuse_released = refuse_released
        self._script = BatchScript(client, _SEEN)

    def sighting(self, delivery_id: str, event_id: str, position: str) -> Sighting:
        """Where this service deduplicates the event read at ``position``."""
        return Sighting(seen_key(delivery_id), seen_prefix(self.service, event_id), position)

    def verdicts(self, items: Sequence[tuple[str, str, int, str]]) -> list[Seen]:
        """For (delivery id, event id, attempt, position) items: whether each is to run."""
        refuse = "1" if self.refuse_released else "0"
        answers = self._script.run([
            ([seen_key(delivery_id), delivery_key(delivery_id)],
             [seen_field(self.service, event_id, attempt), position, self.ttl_s, refuse])
            for delivery_id, event_id, attempt, position in items])
        return [_VERDICTS[int(r)] for r in answers]
