"""``GET /deliveries/{id}/events``: a server-sent event stream of one delivery's status.

Each step's change is one ``step`` event, in the order the steps changed; the stream ends
with the delivery's ``outcome`` (or with ``timeout`` after ``INGESTION_SSE_MAX_S``). Once
the delivery's state is gone from Redis, or released to a tombstone that keeps its outcome
but not its steps, its story comes from Kafka instead (``producers.history``): one
``history`` event per record, then the outcome. A release can come between two polls, so
a stream that saw the first steps live may tell the last ones only in that history; a
released delivery's history is waited for ``RELEASED_STORY_S`` at most, and without it the
tombstone's outcome ends the stream.

The state is polled (``INGESTION_SSE_POLL_S``): one Redis read per stream and period, on a
worker thread, whatever the number of changes. Streams are bounded per client (the owner,
or the address without owner tokens) and per process, so no client can hold the server.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

KEEP_ALIVE_S = 10.0  # a comment line when nothing changed: a gone client shows at once
# how long a released delivery's records are waited for (the lookups are few per process and
# per client): its tombstone tells the outcome without them
RELEASED_STORY_S = 5.0


@dataclass
class StreamSlots:
    """Open streams per client and in all; taken on open, given back on close. Each holds
    its slot until its own end at the latest, so a stream whose clean-up never ran (its
    client left before the first byte) cannot keep the slot."""

    per_client: int
    total: int
    max_s: float
    open: dict[str, list[float]] = field(default_factory=dict)  # client -> each stream's end

    def take(self, client: str) -> float | None:
        """A slot (its token) or None when the client or the process has no room left."""
        now = time.monotonic()
        for name in list(self.open):
            self.open[name] = [end for end in self.open[name] if end > now]
            if not self.open[name]:
                del self.open[name]
        if sum(map(len, self.open.values())) >= self.total or len(self.open.get(client, ())) >= self.per_client:
            return None
        token = now + self.max_s + 5.0
        self.open.setdefault(client, []).append(token)
        return token

    def give_back(self, client: str, token: float) -> None:
        held = self.open.get(client, [])
        if token in held:
            held.remove(token)
        if not held:
            self.open.pop(client, None)


def frame(event: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _changes(before: dict[str, Any], now: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps whose status or attempt changed, oldest change first."""
    changed = []
    for name, step in now.items():
        old = before.get(name)
        if old is None or (old["status"], old["attempt"]) != (step["status"], step["attempt"]):
            changed.append({"step": name, "status": step["status"], "attempt": step["attempt"],
                            "updated_ms": step["updated_ms"]})
    return sorted(changed, key=lambda c: (c["updated_ms"], c["step"]))


async def delivery_events(delivery_id: str, status: Callable[[], Awaitable[dict[str, Any] | None]],
                          history: Callable[[], Awaitable[dict[str, Any] | None]],
                          gone: Callable[[], Awaitable[bool]], *, poll_s: float,
                          max_s: float, released_story_s: float = RELEASED_STORY_S) -> AsyncIterator[bytes]:
    """The stream's frames until the outcome, the time limit, or the client leaves."""
    ends = time.monotonic() + max_s
    steps: dict[str, Any] = {}
    n = 0
    quiet_since = time.monotonic()
    while time.monotonic() < ends:
        if await gone():
            return
        now = await status()
        if now is None or (now.get("outcome") and not now["steps"]):
            # expired, or released (its tombstone keeps the outcome, not the steps), since
            # the last poll: the steps it did not see are in Kafka, with the rest of the story
            try:  # a released delivery's outcome is known: its records are waited for a while only
                told = await asyncio.wait_for(history(), None if now is None else released_story_s)
            except TimeoutError:
                told = None
            for hop in (told or {}).get("history", []):
                n += 1
                yield frame("history", hop, n)
            if told is not None and told.get("outcome"):
                yield frame("outcome", {"delivery_id": delivery_id, "outcome": told["outcome"],
                                        "source": "kafka"}, n + 1)
            elif now is not None:
                yield frame("outcome", {"delivery_id": delivery_id, "outcome": now["outcome"]}, n + 1)
            else:
                yield frame("unknown", {"delivery_id": delivery_id}, n + 1)
            return
        for change in _changes(steps, now["steps"]):
            n += 1
            quiet_since = time.monotonic()
            yield frame("step", change, n)
        steps = now["steps"]
        if now.get("outcome"):
            yield frame("outcome", {"delivery_id": delivery_id, "outcome": now["outcome"]}, n + 1)
            return
        if time.monotonic() - quiet_since > KEEP_ALIVE_S:
            quiet_since = time.monotonic()
            yield b": keep-alive\n\n"
        await asyncio.sleep(poll_s)
    yield frame("timeout", {"delivery_id": delivery_id, "after_s": max_s})
