"""What a submitter can be told, as exceptions each entry point maps to its own answer
(an HTTP status, a CLI message, a Python exception the caller can act on)."""

from __future__ import annotations

from choreo.publisher import PublishError


class AdmissionRefused(Exception):
    """The pipeline is past a limit; nothing was published. Retry after ``retry_after_s``.

    ``reason`` is ``in_flight`` (too many deliveries accepted and not finished),
    ``owner_share`` (this owner holds its share of that cap, ``INGESTION_OWNER_SHARE``),
    ``backlog`` (the step consumers lag too far behind) or ``producer_queue`` (this
    process has too many publishes awaiting the broker's confirmation).
    ``accepted`` (here and on the other errors a batch submit raises) lists the ids it had
    confirmed before the error.
    """

    def __init__(self, reason: str, detail: str, retry_after_s: int, status: int = 429) -> None:
        super().__init__(f"admission refused ({reason}): {detail}")
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.status = status
        self.accepted: list[str] = []


class DeliveryPublishError(PublishError):
    """The broker did not confirm the write of ``delivery_id``; the delivery was not accepted."""

    def __init__(self, delivery_id: str, detail: str) -> None:
        super().__init__(f"delivery {delivery_id} was not accepted: {detail}")
        self.delivery_id = delivery_id
        self.detail = detail
        self.accepted: list[str] = []


class StoreUnavailable(PublishError):
    """Redis (idempotency keys, in-flight places, the state table) cannot be reached."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.accepted: list[str] = []


class PublishTimeout(DeliveryPublishError):
    """No broker report in time: the write may still land; ask for the delivery's status."""


class IdempotencyConflict(Exception):
    """The idempotency key was already used (by this owner) for a different request."""


class IdempotencyInProgress(Exception):
    """The first request with this idempotency key is still awaiting confirmation."""

    def __init__(self, delivery_id: str) -> None:
        super().__init__(f"the request with this key (delivery {delivery_id}) is still in progress")
        self.delivery_id = delivery_id


__all__ = [
    "AdmissionRefused", "DeliveryPublishError", "IdempotencyConflict", "IdempotencyInProgress",
    "PublishError", "PublishTimeout", "StoreUnavailable",
]
