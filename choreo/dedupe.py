"""Consumer-side deduplication on stable event ids, in the step's begin.

An event id (with its attempt: a supervisor requeue is a new attempt) is remembered per
service with the input position (topic|partition|offset) that first carried it. The same
position again is a *replay* after an aborted transaction and must run again (its outputs
were never committed); another position is a *duplicate* (a producer retry, a redrive, a
copy) whose outputs were already committed from the first position: it is skipped.

A workflow service also skips every event of a *released* delivery (``choreo.release``): its
dedupe entries are gone with the rest of its state, and the tombstone left in its step table
says it is finished.

The check is the first part of the begin script (``choreo.state``): one script item per
input does both, for a batch in one round trip. An input outside any step, or one about to
be dead-lettered, runs the check alone (a begin with no step).
"""

from __future__ import annotations

import base64
import re
import uuid

from choreo import keys
from choreo.state import Sighting


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


# how the runtime writes ids: read by ``bytes.fromhex`` in a third of ``uuid.UUID``'s time (its
# parse was about a tenth of a service's CPU), to the same bytes
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def compact_id(event_id: str) -> str:
    """An event id as it is written into Redis field names: a UUID's 16 bytes in URL-safe
    base64 (22 characters instead of 36: a delivery's dedupe entries and effect answers name
    about a dozen events, bench/README.md); any other id as it is."""
    if _CANONICAL_UUID.fullmatch(event_id):
        raw = bytes.fromhex(event_id.replace("-", ""))
    else:
        try:
            raw = uuid.UUID(event_id).bytes
        except ValueError:
            return event_id
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def sighting(service: str, delivery_id: str, event_id: str, position: str) -> Sighting:
    """Where ``service`` deduplicates the event read at ``position``."""
    return Sighting(seen_key(delivery_id), seen_prefix(service, event_id), position)
