"""The Python producer API: submit deliveries from code, straight to Kafka (no HTTP hop).

    with DeliveryClient() as client:
        delivery_id = client.submit({"owner_id": "acme", "pickup": {...}, ...})
        ids = client.submit_many(requests)

It is the HTTP endpoint's submit path without HTTP: the same validation, the same admission
control (``AdmissionRefused`` carries ``retry_after_s``), the same idempotency keys, and a
delivery counts as submitted only once the broker confirmed it (``PublishError`` otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from types import TracebackType
from typing import Any

from producers.errors import AdmissionRefused, DeliveryPublishError, PublishError
from producers.model import DeliveryRequestIn, InvalidRequest, parse_request
from producers.settings import IngestionSettings
from producers.submit import SubmitError, Submission, Submitter

RequestLike = DeliveryRequestIn | dict[str, Any] | bytes | str
# requests per batch of ``submit_many``: one admission script and one state-table pipeline
# each: two round trips a request were what bounded a single submitting thread
SUBMIT_BATCH = 200

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

    def start_many(self, requests: list[RequestLike]) -> list[Submission | SubmitError]:
        """Hand a batch to the producer without waiting: each request's Submission, or the
        error that refused it (``Submitter.submit_batch``)."""
        return self.submitter.submit_batch(requests)

    def confirm(self, submission: Submission, timeout_s: float | None = None) -> str:
        """Wait for the broker's confirmation of a started submission; its delivery id."""
        return self.submitter.wait(submission, timeout_s).delivery_id

    def submit_many(self, requests: Iterable[RequestLike], timeout_s: float | None = None) -> list[str]:
        """Submit many, in batches (``Submitter.submit_batch``: two Redis round trips per
        batch instead of two per request), each confirmed before the next is sent.

        Returns every delivery id, in submission order. On an error, the batch it is in is
        still confirmed and no later batch is sent; the first error (in submission order) is
        raised with ``accepted`` set to every id the broker confirmed, in submission order.
        An invalid request is caught before its batch is sent: the requests before it are
        submitted, it and the rest are not. Refusals (admission, a full local queue) are
        always the tail of a batch, so after one a caller resumes after the last accepted.
        """
        size = max(1, min(SUBMIT_BATCH, self.submitter.cfg.max_pending // 2))
        accepted: list[str] = []
        for part in _batches(requests, size):
            valid: list[RequestLike] = []
            failure: SubmitError | None = None
            for request in part:
                try:
                    valid.append(parse_request(request))
                except InvalidRequest as invalid:
                    failure = invalid
                    break
            confirmed, first_error = self._confirm_all(self.start_many(valid), timeout_s)
            accepted.extend(confirmed)
            failure = first_error or failure
            if failure is not None:
                failure.accepted = accepted
                raise failure
        return accepted

    def _confirm_all(self, results: list[Submission | SubmitError], timeout_s: float | None
                     ) -> tuple[list[str], SubmitError | None]:
        """The ids confirmed, in order, and the first error (refused or not confirmed)."""
        confirmed: list[str] = []
        first: SubmitError | None = None
        for result in results:
            if not isinstance(result, Submission):
                first = first or result
                continue
            try:
                confirmed.append(self.confirm(result, timeout_s))
            except DeliveryPublishError as exc:
                first = first or exc
        return confirmed, first

    def close(self) -> None:
        """Wait for outstanding confirmations and stop the background threads."""
        if self._owned:
            self.submitter.close()

    def __enter__(self) -> DeliveryClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _batches(items: Iterable[RequestLike], size: int) -> Iterator[list[RequestLike]]:
    iterator = iter(items)
    while batch := list(islice(iterator, size)):
        yield batch
