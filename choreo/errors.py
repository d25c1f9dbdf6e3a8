"""How a handler says what kind of failure it met; the runtime decides what follows."""

from __future__ import annotations

from enum import StrEnum


class DeadLetterReason(StrEnum):
    """Reason codes on dead letters (header ``dlq.reason``): stable, for filtering and redrive."""

    UNDECODABLE = "UNDECODABLE"  # not Confluent wire format, or truncated / corrupt Avro
    UNKNOWN_SCHEMA = "UNKNOWN_SCHEMA"  # schema id the registry does not know
    INCOMPATIBLE_SCHEMA = "INCOMPATIBLE_SCHEMA"  # the writer schema cannot be read as ours
    INVALID_PAYLOAD = "INVALID_PAYLOAD"  # decoded, but fails validation
    MISSING_HEADERS = "MISSING_HEADERS"  # no usable envelope
    HOP_LIMIT = "HOP_LIMIT"  # event-storm guard
    ATTEMPT_LIMIT = "ATTEMPT_LIMIT"  # an attempt past choreo.envelope.MAX_ATTEMPT (forged)
    REJECTED = "REJECTED"  # the handler said it can never succeed
    HANDLER_ERROR = "HANDLER_ERROR"  # the handler raised what is neither a retry nor a refusal
    OVERSIZED = "OVERSIZED"  # larger than the service accepts


class HandlerError(Exception):
    """Base of the errors a handler raises on purpose."""


class Retryable(HandlerError):
    """A transient failure: retry with back-off within the step's deadline and budget."""


class AttemptDropped(Exception):
    """An effect of this attempt was not run, and the runtime drops the attempt: its delivery
    ended and its state was released while it ran (``why`` = ``released``, ``choreo.release``),
    or its step went to a newer attempt or was closed meanwhile (``stale``, ``choreo.effects``)."""

    def __init__(self, delivery_id: str, why: str) -> None:
        super().__init__(f"{delivery_id}: {why}")
        self.why = why


class Rejected(HandlerError):
    """The event can never succeed: dead-letter it at once with this reason, retry nothing."""

    def __init__(self, message: str, reason: DeadLetterReason = DeadLetterReason.REJECTED) -> None:
        super().__init__(message)
        self.reason = reason
