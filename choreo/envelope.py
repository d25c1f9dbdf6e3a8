"""The envelope every event carries in Kafka headers.

Stable ids make redelivery harmless; the correlation id, causation id and W3C trace
context make one delivery's story visible across services with no coordinator; the
hop count bounds feedback loops.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from dataclasses import dataclass, replace
from collections.abc import Mapping, Sequence

from choreo.errors import DeadLetterReason

ID_NAMESPACE = uuid.UUID("6f1c1a52-5b7e-4c33-9a55-3c3f0d2a9e10")
_NAMESPACE_BYTES = ID_NAMESPACE.bytes

H_EVENT_ID = "event_id"
H_CORRELATION_ID = "correlation_id"
H_CAUSATION_ID = "causation_id"
H_TRACEPARENT = "traceparent"
H_ATTEMPT = "attempt"
H_DEADLINE = "deadline_ms"
H_HOPS = "hops"
H_EVENT_TYPE = "event_type"
H_PRODUCER = "producer"
H_PRODUCED_AT = "produced_at_ms"
# Where the submitter asked the outcome to be copied, and who owns the delivery: set once by
# the entry point and carried by every later hop. Any hop may forge them, so whoever acts on
# them checks them again (``choreo.outcomes``).
H_REPLY_TO = "reply_to"
H_OWNER = "owner_id"
MAX_TOPIC_CHARS = 249  # Kafka's own limit on a topic name
MAX_OWNER_CHARS = 128
MAX_ID_CHARS = 200  # an id header (event, correlation, causation) is cut to this, not refused

# The highest attempt an envelope may carry. Retry budgets are a few dozen at most; a
# forged huge attempt would outrank every supervisor token, and past 2**31 it no longer
# fits the Avro ``int`` of a recovery report, so the event could never be reported.
MAX_ATTEMPT = 1000
MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, the last instant a datetime holds

HeaderList = list[tuple[str, str | bytes | None]]
Headers = Sequence[tuple[str, bytes | str | None]] | Mapping[str, bytes | str | None]


def derived_id(*parts: str) -> str:
    """A deterministic id: the same inputs (a redo) give the same id, so consumers dedupe.

    It is ``str(uuid.uuid5(ID_NAMESPACE, "\x1f".join(parts)))`` (a test holds it to that),
    spelled out because the runtime makes one per output and per retry: 1.4 µs instead of
    3.7 (``uuid.UUID`` checks and converts its input several times)."""
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + "\x1f".join(parts).encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = digest.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Envelope:
    event_id: str
    correlation_id: str
    causation_id: str = ""
    traceparent: str = ""
    attempt: int = 1
    deadline_ms: int = 0  # 0: no deadline
    hops: int = 0
    event_type: str = ""
    producer: str = ""
    produced_at_ms: int = 0
    reply_to: str = ""  # "": no reply topic asked
    owner: str = ""

    @property
    def trace_id(self) -> str:
        parts = self.traceparent.split("-")
        return parts[1] if len(parts) == 4 else ""

    @classmethod
    def first(cls, event_id: str, correlation_id: str, event_type: str, producer: str,
              deadline_ms: int = 0, reply_to: str = "", owner: str = "") -> Envelope:
        """The envelope of an event that starts a story (e.g. a new delivery request)."""
        return cls(
            event_id=event_id, correlation_id=correlation_id, causation_id="",
            traceparent=f"00-{new_trace_id()}-{new_span_id()}-01", deadline_ms=deadline_ms,
            event_type=event_type, producer=producer, produced_at_ms=now_ms(),
            reply_to=reply_to, owner=owner,
        )

    def child(self, event_id: str, event_type: str, producer: str,
              attempt: int | None = None, deadline_ms: int | None = None) -> Envelope:
        """The envelope of an event caused by this one: same trace, one hop further."""
        trace = self.trace_id or new_trace_id()
        return Envelope(
            event_id=event_id, correlation_id=self.correlation_id, causation_id=self.event_id,
            traceparent=f"00-{trace}-{new_span_id()}-01",
            attempt=self.attempt if attempt is None else attempt,
            deadline_ms=self.deadline_ms if deadline_ms is None else deadline_ms,
            hops=self.hops + 1, event_type=event_type, producer=producer,
            produced_at_ms=now_ms(), reply_to=self.reply_to, owner=self.owner,
        )

    def with_attempt(self, attempt: int) -> Envelope:
        return replace(self, attempt=attempt)

    def to_headers(self) -> HeaderList:
        headers: HeaderList = [
            (H_EVENT_ID, self.event_id.encode()),
            (H_CORRELATION_ID, self.correlation_id.encode()),
            (H_CAUSATION_ID, self.causation_id.encode()),
            (H_TRACEPARENT, self.traceparent.encode()),
            (H_ATTEMPT, str(self.attempt).encode()),
            (H_DEADLINE, str(self.deadline_ms).encode()),
            (H_HOPS, str(self.hops).encode()),
            (H_EVENT_TYPE, self.event_type.encode()),
            (H_PRODUCER, self.producer.encode()),
            (H_PRODUCED_AT, str(self.produced_at_ms).encode()),
        ]
        if self.reply_to:
            headers.append((H_REPLY_TO, self.reply_to.encode()))
        if self.owner:
            headers.append((H_OWNER, self.owner.encode()))
        return headers

    @classmethod
    def from_headers(cls, headers: Headers | None) -> Envelope | None:
        """The envelope in ``headers``, or None when they carry no usable one (``parse``)."""
        parsed = cls.parse(headers)
        return parsed if isinstance(parsed, Envelope) else None

    @classmethod
    def parse(cls, headers: Headers | None) -> Envelope | Unusable:
        """The envelope in ``headers``, or why they carry no usable one: the runtime
        dead-letters the event with that reason."""
        values: dict[str, str] = {}
        for name, raw in pairs(headers):
            if raw is None:
                continue
            try:
                values[name] = raw.decode() if isinstance(raw, bytes) else raw
            except UnicodeDecodeError:
                return Unusable(DeadLetterReason.MISSING_HEADERS, f"header {name[:50]!r} is not UTF-8")
        if not values.get(H_EVENT_ID) or not values.get(H_CORRELATION_ID):
            return Unusable(DeadLetterReason.MISSING_HEADERS, "no event_id / correlation_id headers")
        try:
            envelope = cls(
                event_id=values[H_EVENT_ID][:MAX_ID_CHARS],
                correlation_id=values[H_CORRELATION_ID][:MAX_ID_CHARS],
                causation_id=values.get(H_CAUSATION_ID, "")[:MAX_ID_CHARS],
                traceparent=values.get(H_TRACEPARENT, "")[:100],
                attempt=int(values.get(H_ATTEMPT, "1")),
                deadline_ms=int(values.get(H_DEADLINE, "0")),
                hops=int(values.get(H_HOPS, "0")),
                event_type=values.get(H_EVENT_TYPE, "")[:200],
                producer=values.get(H_PRODUCER, "")[:200],
                produced_at_ms=int(values.get(H_PRODUCED_AT, "0")),
                # cut, not refused: an over-long one is then refused where it is used
                reply_to=values.get(H_REPLY_TO, "")[:MAX_TOPIC_CHARS + 1],
                owner=values.get(H_OWNER, "")[:MAX_OWNER_CHARS + 1],
            )
        except ValueError:
            return Unusable(DeadLetterReason.MISSING_HEADERS, "a counter header is not an integer")
        # forged counters would slip past the hop limit or outrank a supervisor's token
        if envelope.hops < 0 or envelope.attempt < 1 or envelope.deadline_ms < 0:
            return Unusable(DeadLetterReason.MISSING_HEADERS,
                            "negative hops or deadline, or an attempt below 1")
        # a time no datetime holds: an outcome dated by it could not be written
        if not (0 <= envelope.produced_at_ms <= MAX_TIME_MS and envelope.deadline_ms <= MAX_TIME_MS):
            return Unusable(DeadLetterReason.MISSING_HEADERS, "a time header before 1970 or after 9999")
        if envelope.attempt > MAX_ATTEMPT:
            return Unusable(DeadLetterReason.ATTEMPT_LIMIT,
                            f"attempt {envelope.attempt} > limit {MAX_ATTEMPT}")
        return envelope


@dataclass(frozen=True)
class Unusable:
    """Why a record's headers carry no usable envelope: the dead letter's reason and text."""

    reason: DeadLetterReason
    detail: str


def pairs(headers: Headers | None) -> Sequence[tuple[str, bytes | str | None]]:
    if headers is None:
        return ()
    if isinstance(headers, Mapping):
        return list(headers.items())
    return headers


def header_value(headers: Headers | None, name: str) -> str | None:
    """The last value of header ``name``, as the envelope (``parse``) and Kafka's
    ``lastHeader`` read it: a record that carries a header twice reads the same to the
    services and to the tools that look at it."""
    found: bytes | str | None = None
    for key, raw in pairs(headers):
        if key == name and raw is not None:
            found = raw
    return found.decode(errors="replace") if isinstance(found, bytes) else found
