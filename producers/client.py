"""The Python producer API: submit deliveries from code, straight to Kafka (no HTTP hop).

    with DeliveryClient() as client:
        delivery_id = client.submit({"owner_id": "acme", "pickup": {...}, ...})
        ids = client.submit_many(requests)

It is the HTTP endpoint's submit path without HTTP: the same validation, the same admission
control (``AdmissionRefused`` carries ``retry_after_s``), the same idempotency keys, and a
delivery counts as submitted only once the broker confirmed it (``PublishError`` otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

from producers.errors import AdmissionRefused, DeliveryPublishError, PublishError
from producers.model import DeliveryRequestIn, InvalidRequest
from producers.settings import IngestionSettings
from producers.submit import Submission, Submitter

RequestLike = DeliveryRequestIn | dict[str, Any] | bytes | str

__all__ = ["AdmissionRefused", "DeliveryClient", "InvalidRequest", "PublishError"]


class DeliveryClient:
    """Submits delivery requests; one per process is enough (it is thread-safe)."""

    def __init__(self, settings: IngestionSettings | None = None,
                 submitter: Submitter | None = None) -> None:
        self._owned = submitter is None
        self.submitter = (submitter or Submitter(settings, entry="api")).start()

    def submit(self, request: RequestLike, idempotency_key: str | None = None,
               timeout_s: float | None = None) -> str:
        """Submit one request and return its delivery id once the broker confirmed it.

        Raises InvalidRequest, AdmissionRefused, IdempotencyConflict, IdempotencyInProgress
        or PublishError (``PublishTimeout`` when unconfirmed in time).
        """
        return self.confirm(self.start(request, idempotency_key), timeout_s)

    def start(self, request: RequestLike, idempotency_key: str | None = None) -> Submission:
        """Hand one request to the producer without waiting (pair with ``confirm``)."""
        return self.submitter.submit(request, idempotency_key)

    def confirm(self, submission: Submission, timeout_s: float | None = None) -> str:
        """Wait for the broker's confirmation of a started submission; its delivery id."""
        return self.submitter.wait(submission, timeout_s).delivery_id

    def submit_many(self, requests: Iterable[RequestLike], timeout_s: float | None = None) -> list[str]:
        """Submit many without waiting for each: confirmations are collected in windows.

        All are validated one by one as they are submitted; on the first error the ones
        already handed to the producer are still awaited, and the error is raised with
        ``accepted`` set to every id the broker confirmed, in submission order (a failed
        publish is absent from it; a refusal stops the batch, so a caller resumes after them).
        An ``InvalidRequest`` is raised as is (validate first with ``parse_request`` if
        partial submission is unwanted).
        """
        window = max(1, self.submitter.cfg.max_pending // 2)
        accepted: list[str] = []
        in_window: list[Submission] = []
        try:
            for request in requests:
                in_window.append(self.start(request))
                if len(in_window) >= window:
                    accepted.extend(self._confirm(in_window, timeout_s))
                    in_window = []
            accepted.extend(self._confirm(in_window, timeout_s))
        except (AdmissionRefused, DeliveryPublishError) as exc:
            exc.accepted = accepted + self._confirm(in_window, timeout_s, partial=True)
            raise
        return accepted

    def _confirm(self, submissions: list[Submission], timeout_s: float | None,
                 partial: bool = False) -> list[str]:
        """Wait for a window; with ``partial`` keep going past failures (best effort)."""
        confirmed = []
        for submission in submissions:
            try:
                confirmed.append(self.confirm(submission, timeout_s))
            except DeliveryPublishError:
                if not partial:
                    raise
        return confirmed

    def close(self) -> None:
        """Wait for outstanding confirmations and stop the background threads."""
        if self._owned:
            self.submitter.close()

    def __enter__(self) -> DeliveryClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
