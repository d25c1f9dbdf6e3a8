"""The one submit path behind HTTP, the Python API and the CLI.

validate → idempotency key → admission → publish → broker confirmation. A delivery counts
as accepted only when the broker confirmed the write (acks=all, idempotent producer): the
caller is answered from the delivery report, which a background thread serves by polling
the producer; nothing flushes per request.

Idempotency (IETF draft "The Idempotency-Key HTTP Header Field"): the key, scoped by
owner, is claimed with one atomic script that also fixes the delivery id and the
``requested_at`` of the request. A retry of a confirmed request is answered with the same
delivery without publishing; the same key with a different request is a conflict; a retry
while the first is still unconfirmed is told to wait, unless the first is older than the
publish timeout (its process died): then the same delivery is published again, with the
same event id, which consumers dedupe.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import redis
from confluent_kafka import KafkaError, Message

from choreo.config import settings as choreo_settings
from choreo.envelope import derived_id
from choreo.keys import of_delivery
from choreo.logs import get_logger
from choreo.outcomes import told_in_state
from choreo.publisher import Publish, Publisher
from choreo.redis_client import NodePipelines, ReplicationLag, connect, raise_first, write_waited
from choreo.state import delivery_key, parse_steps
from choreo.workflow import Workflow
from producers import metrics
from producers.admission import Admission
from producers.errors import (
    AdmissionRefused, DeliveryPublishError, IdempotencyConflict, IdempotencyInProgress,
    PublishTimeout, StoreUnavailable,
)
from producers.group import GroupCommit
from producers.model import DeliveryRequestIn, InvalidRequest, parse_request
from producers.settings import IngestionSettings
from schemas.models import DeliveryRequested

TOPIC = DeliveryRequested.topic
PRODUCER_NAME = "ingestion"
# why one request of a batch was not accepted (each carries ``accepted``: see DeliveryClient)
SubmitError = InvalidRequest | AdmissionRefused | DeliveryPublishError | StoreUnavailable

# KEYS[1] the key's hash. ARGV: fingerprint, new delivery id, requested_at ms, now ms, ttl s.
# Returns {} when this call claimed the key, else the stored {id, fingerprint, requested_at,
# claimed_at, confirmed}.
_CLAIM = """
local stored = redis.call('HMGET', KEYS[1], 'd', 'f', 'r', 'c', 'ok')
if stored[1] then return stored end
redis.call('HSET', KEYS[1], 'd', ARGV[2], 'f', ARGV[1], 'r', ARGV[3], 'c', ARGV[4], 'ok', '0')
redis.call('EXPIRE', KEYS[1], ARGV[5])
return {}
"""
# Free a claim this request made and never used: its delivery id, still unconfirmed and
# still this request's (claimed_at: another instance may have taken it over meanwhile).
_FREE = """
local stored = redis.call('HMGET', KEYS[1], 'd', 'ok', 'c')
if stored[1] == ARGV[1] and stored[2] == '0' and stored[3] == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Confirm a claim's request, only while the claim still names its delivery (a claim freed or
# expired meanwhile is not made again, without its id and TTL).
_CONFIRM = """
if redis.call('HGET', KEYS[1], 'd') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'ok', '1')
return 1
"""
# Take over a stale claim only if nobody else did meanwhile (compare claimed_at).
_TAKE_OVER = """
if redis.call('HGET', KEYS[1], 'c') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'c', ARGV[2])
return 1
"""


class OwnerMismatch(Exception):
    """An authenticated caller submitted a delivery for another owner (nothing was accepted)."""


def owner_redis_key(delivery_id: str) -> str:
    """Who owns a delivery (kept when owner tokens are on): the status endpoint checks it.
    In the delivery's hash slot like the rest of its state."""
    return of_delivery("owner", delivery_id)


def idempotency_redis_key(owner_id: str, key: str) -> str:
    """Scoped by owner; the client's key is hashed so its length and bytes never matter."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"idem:{owner_id}:{digest}"


def new_delivery_id() -> str:
    return str(uuid.uuid4())


def event_id_for(delivery_id: str) -> str:
    """Deterministic: a republished request (stale idempotent retry) keeps its event id."""
    return derived_id(delivery_id, TOPIC)


@dataclass(frozen=True)
class Accepted:
    delivery_id: str
    event_id: str
    trace_id: str
    replayed: bool = False  # answered from the idempotency key, nothing published


@dataclass
class Submission:
    """A publish handed to the producer; ``confirmed`` resolves on the broker's report."""

    accepted: Accepted
    confirmed: Future[None]

    @property
    def delivery_id(self) -> str:
        return self.accepted.delivery_id


@dataclass(frozen=True)
class _Item:
    """A request on its way to the producer, with the id and time it will carry."""

    request: DeliveryRequestIn
    delivery_id: str
    requested_at_ms: int
    claim: _Claim | None
    owner_recorded: bool = False  # its owner was recorded for status reads (owner tokens on)


@dataclass(frozen=True)
class _Claim:
    key: str
    delivery_id: str
    requested_at_ms: int
    owned: bool  # this call holds the claim: it publishes, and gives the claim up if that fails
    claimed_at_ms: int = 0  # when this call made or took over the claim (its ``c``)
    taken_over: bool = False  # an earlier request's publish under it may have reached the broker


def _freed(claim: _Claim, handed_over: bool) -> bool:
    """A claim given up is freed only when nothing was ever handed to a producer under it."""
    return not handed_over and not claim.taken_over


class Submitter:
    """Owns the producer, the poll thread and the admission monitor of one process."""

    def __init__(self, cfg: IngestionSettings | None = None, *, workflow: Workflow | None = None,
                 redis_client: redis.Redis | None = None, publisher: Publisher | None = None,
                 admission: Admission | None = None, entry: str = "api") -> None:
        if workflow is None:
            from consumers.workflow import WORKFLOW

            workflow = WORKFLOW
        self.cfg = cfg or IngestionSettings()
        self.entry = entry
        self.redis = redis_client or connect(choreo_settings().redis_url,
                                                          socket_timeout=5)
        self.publisher = publisher or Publisher(PRODUCER_NAME, workflow, redis_client=self.redis)
        self.admission = admission or Admission(self.cfg, self.redis, workflow, TOPIC)
        self._claim = self.redis.register_script(_CLAIM)
        self._take_over = self.redis.register_script(_TAKE_OVER)
        self._confirm = self.redis.register_script(_CONFIRM)
        self._free = self.redis.register_script(_FREE)
        self._pending = 0
        self._admitting = 0  # let in by the backlog, not yet handed to the producer
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._group: GroupCommit[_Item, Submission | SubmitError] | None = None
        self._closing = False
        self.log = get_logger(component="ingestion", entry=entry)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Submitter:
        if self._poller is None:
            self._closing = False
            self.admission.start()
            self._stop.clear()
            self._poller = threading.Thread(target=self._poll, name="producer-poll", daemon=True)
            self._poller.start()
        return self

    def _poll(self) -> None:
        """Serve delivery reports: this is what resolves every caller's confirmation."""
        while not self._stop.is_set():
            self.publisher.poll(0.05)

    def close(self, timeout_s: float = 30.0) -> None:
        """Publish what is queued, wait for outstanding confirmations, then stop the threads."""
        with self._pending_lock:
            self._closing, group = True, self._group
        if group is not None:
            group.close(timeout_s)
        try:
            self.publisher.flush(timeout_s)
        finally:
            self._stop.set()
            if self._poller is not None:
                self._poller.join(timeout=5)
                self._poller = None
            self.admission.stop()
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None

    def ready(self) -> dict[str, bool]:
        return {**self.admission.ready(),
                "producer_poll": self._poller is not None and self._poller.is_alive()}

    @property
    def pending(self) -> int:
        return self._pending

    # -- submit ------------------------------------------------------------------------

    def submit(self, data: DeliveryRequestIn | dict[str, Any] | bytes | str,
               idempotency_key: str | None = None, *, owner: str | None = None) -> Submission:
        """Validate, admit and hand the event to the producer; returns before confirmation.

        ``owner`` is the authenticated caller's owner id (owner tokens on): the request must
        be for that owner, and the delivery's owner is recorded for status reads.

        Raises InvalidRequest, OwnerMismatch, IdempotencyConflict, IdempotencyInProgress,
        AdmissionRefused, StoreUnavailable or DeliveryPublishError; on any of them nothing
        was accepted.
        """
        prepared = self._prepare(data, idempotency_key, owner)
        if isinstance(prepared, Submission):
            return prepared
        return _raised(self._admit_and_publish_all([prepared])[0])

    def submit_batch(self, data: Sequence[DeliveryRequestIn | dict[str, Any] | bytes | str]
                     ) -> list[Submission | SubmitError]:
        """``submit`` for many requests at once: one admission script and one state-table
        round trip for all of them, where ``submit`` takes two per request (what bounds a
        single submitting thread).

        Each request's result, in order, is its Submission or the error that refused it
        (``InvalidRequest``, ``AdmissionRefused``, ``StoreUnavailable``,
        ``DeliveryPublishError``), and nothing was accepted for a refused one. Places in
        flight go to the requests in order: past the cap the rest are refused, past its
        owner's share an owner's. No
        idempotency keys or owner checks here: those go through ``submit``.
        """
        results: list[Submission | SubmitError | None] = [None] * len(data)
        items: list[tuple[int, _Item]] = []
        now = int(time.time() * 1000)
        for i, raw in enumerate(data):
            try:
                items.append((i, _Item(parse_request(raw), new_delivery_id(), now, None)))
            except InvalidRequest as exc:
                results[i] = exc
        done = self._admit_and_publish_all([item for _, item in items])
        for (i, _), result in zip(items, done):
            results[i] = result
        return [r for r in results if r is not None]

    def _prepare(self, data: DeliveryRequestIn | dict[str, Any] | bytes | str,
                 idempotency_key: str | None, owner: str | None) -> _Item | Submission:
        """A request made ready for admission: validated, its key claimed, its owner recorded
        (Redis round trips only with a key or an owner). A Submission when its key's first
        request was already confirmed: nothing is published again."""
        request = parse_request(data)
        if owner is not None and not hmac.compare_digest(request.owner_id.encode(), owner.encode()):
            raise OwnerMismatch("the request's owner_id is not the authenticated owner")
        claim: _Claim | None = None
        try:
            claim = self._claim_key(request, idempotency_key) if idempotency_key else None
            if claim is not None and not claim.owned and claim.requested_at_ms < 0:
                done: Future[None] = Future()
                done.set_result(None)
                metrics.REPLAYED.inc()
                return Submission(Accepted(claim.delivery_id, event_id_for(claim.delivery_id), "",
                                           replayed=True), done)
            delivery_id = claim.delivery_id if claim else new_delivery_id()
            if owner is not None:  # before the event exists, so its status is never readable by others
                okey = owner_redis_key(delivery_id)
                write_waited(self.redis, okey, lambda pipe: pipe.set(okey, request.owner_id, ex=self.cfg.owner_ttl_s))
        except redis.RedisError as exc:
            if claim is not None and claim.owned:  # the owner record failed after the claim
                self._give_up([claim], handed_over=False)
            raise StoreUnavailable(f"state store unreachable: {type(exc).__name__}") from exc
        requested_at_ms = claim.requested_at_ms if claim else int(time.time() * 1000)
        return _Item(request, delivery_id, requested_at_ms, claim, owner_recorded=owner is not None)

    def _commit_group(self, items: list[_Item]) -> list[Submission | SubmitError]:
        metrics.GROUP_COMMIT_SIZE.observe(len(items))
        return self._admit_and_publish_all(items)

    def _admit_and_publish_all(self, items: list[_Item]) -> list[Submission | SubmitError]:
        """``_admit_and_publish``, every item refused as ``StoreUnavailable`` if Redis fails."""
        try:
            return self._admit_and_publish(items)
        except redis.RedisError as exc:
            failure = StoreUnavailable(f"state store unreachable: {type(exc).__name__}")
            failure.__cause__ = exc
            return [failure] * len(items)

    def _admit_and_publish(self, items: list[_Item]) -> list[Submission | SubmitError]:
        """Admit the items, publish the admitted ones; a refused or failed item leaves
        nothing behind (its place, its idempotency claim, its owner record)."""
        with self._letting_in(len(items)) as let_in:
            try:
                refusals = self._admit(items, let_in)
            except redis.RedisError:  # the script may have run, only its reply lost: undo it all
                self.admission.release([item.delivery_id for item in items])
                self._leave_nothing(items)
                raise
            admitted = [item for item, refusal in zip(items, refusals) if refusal is None]
            try:
                published = iter(self._publish(admitted))
            except BaseException:  # raised before anything was produced (Publisher.publish_many)
                self.admission.release([item.delivery_id for item in admitted])
                self._leave_nothing(items)
                raise
        results = [refusal if refusal is not None else next(published) for refusal in refusals]
        failed = [item for item, refusal, result in zip(items, refusals, results)
                  if refusal is None and not isinstance(result, Submission)]
        self.admission.release([item.delivery_id for item in failed])
        self._leave_nothing([*failed, *(item for item, refusal in zip(items, refusals) if refusal)])
        return results

    @contextmanager
    def _letting_in(self, count: int) -> Iterator[tuple[int, AdmissionRefused | None]]:
        """``_let_in``, its count given back on leaving (by then the producer has them)."""
        let_in = self._let_in(count)
        try:
            yield let_in
        finally:
            with self._pending_lock:
                self._admitting -= let_in[0]

    def _let_in(self, count: int) -> tuple[int, AdmissionRefused | None]:
        """How many of ``count`` requests the producer queue's room and the backlog let in,
        and the refusal of the rest. Those let in count as pending until they are handed to
        the producer: callers on other threads meet them at the door."""
        with self._pending_lock:
            pending = self._pending + self._admitting
            room = min(count, max(0, self.cfg.max_pending - pending))
            allowed, refused = self.admission.check_backlog(pending, room) if room else (0, None)
            self._admitting += allowed
        if refused is None and room < count:
            refused = AdmissionRefused("producer_queue", f"{pending} publishes await the broker's "
                                      "confirmation", self.cfg.retry_after_s, status=503)
        return allowed, refused

    def _admit(self, items: list[_Item], let_in: tuple[int, AdmissionRefused | None]
               ) -> list[AdmissionRefused | None]:
        """Each item's refusal, None for those that got a place: the first ``let_in`` (room
        in the producer queue and the backlog), then within the in-flight cap and each
        owner's share of it (``Admission.reserve``)."""
        allowed, refused = let_in
        refusals: list[AdmissionRefused | None] = [refused] * len(items)
        if allowed:
            refusals[:allowed] = self.admission.reserve(
                [(item.delivery_id, item.request.owner_id) for item in items[:allowed]])
        for reason, count in Counter(r.reason for r in refusals if r is not None).items():
            metrics.REFUSED.labels(reason).inc(count)
        return refusals

    def _publish(self, items: list[_Item]) -> list[Submission | SubmitError]:
        """Hand the admitted items to the producer; each resolves on its broker report."""
        started = time.monotonic()
        results: list[Submission | SubmitError | None] = [None] * len(items)
        sends: list[tuple[int, Publish, Future[None]]] = []
        for i, item in enumerate(items):
            try:
                event = item.request.to_event(item.delivery_id,
                                              datetime.fromtimestamp(item.requested_at_ms / 1000, UTC))
            except Exception as exc:
                results[i] = self._publish_failure(item.delivery_id, exc)
                continue
            send = Publish(event, event_id_for(item.delivery_id), deadline_ms=item.request.deadline_ms)
            # the envelope (its trace id) is known before the report, which may come at once
            send = replace(send, envelope=self.publisher.envelope(send))
            future: Future[None] = Future()
            sends.append((i, replace(send, on_delivery=self._reporter(item, send, future, started)), future))
        with self._pending_lock:
            self._pending += len(sends)
        metrics.PENDING.set(self._pending)
        try:
            sent = self.publisher.publish_many([send for _, send, _ in sends])
        except BaseException:
            for _ in sends:
                self._unpend()
            raise
        for (i, send, future), outcome in zip(sends, sent):
            if isinstance(outcome, Exception):
                self._unpend()
                results[i] = self._publish_failure(items[i].delivery_id, outcome)
            else:
                results[i] = Submission(Accepted(items[i].delivery_id, send.event_id, outcome.trace_id), future)
        return [r for r in results if r is not None]

    def _reporter(self, item: _Item, send: Publish, future: Future[None],
                  started: float) -> Callable[[KafkaError | None, Message | None], None]:
        trace_id = send.envelope.trace_id if send.envelope else ""

        def on_delivery(err: KafkaError | None, _: Message | None) -> None:
            self._done(item, send.event_id, trace_id, err, future, started)

        return on_delivery

    def _publish_failure(self, delivery_id: str, exc: Exception) -> SubmitError:
        """What the caller is told when the producer did not take a publish."""
        failure: SubmitError
        if isinstance(exc, BufferError):
            metrics.REFUSED.labels("producer_queue").inc()
            failure = AdmissionRefused("producer_queue", f"local producer queue full: {exc}",
                                       self.cfg.retry_after_s, status=503)
        elif isinstance(exc, (redis.RedisError, OSError)):
            metrics.PUBLISH_FAILED.inc()
            failure = DeliveryPublishError(delivery_id, f"state store: {type(exc).__name__}")
        else:  # registry unreachable, serialization, KafkaException
            metrics.PUBLISH_FAILED.inc()
            failure = DeliveryPublishError(delivery_id, f"{type(exc).__name__}: {exc}"[:300])
        failure.__cause__ = exc
        return failure

    def _done(self, item: _Item, event_id: str, trace_id: str, err: KafkaError | None,
              future: Future[None], started: float) -> None:
        """Delivery report (poll thread): settle the caller, the key and the in-flight place."""
        delivery_id, claim = item.delivery_id, item.claim
        if err is None:  # counted as published before it leaves the pending: always in one
            self.admission.published(1)
        self._unpend()
        if err is not None:
            metrics.PUBLISH_FAILED.inc()
            self.admission.release([delivery_id])
            try:
                self.publisher.abandon_steps([(delivery_id, DeliveryRequested.topic)])
            except redis.RedisError:  # the supervisor then finds steps with no source: it fails them
                pass
            # a report of failure (a timeout) does not prove the record was not written
            self._leave_nothing([item], handed_over=True)
            self.log.warning("publish not confirmed", delivery_id=delivery_id, event_id=event_id,
                             error=str(err))
            _settle(future, exc=DeliveryPublishError(delivery_id, str(err)))
            return
        metrics.CONFIRM_SECONDS.observe(time.monotonic() - started)
        metrics.ACCEPTED.labels(self.entry).inc()
        if claim is not None:
            try:
                self._confirm(keys=[claim.key], args=[delivery_id])
            except redis.RedisError as exc:  # a retry republishes the same event id: harmless
                self.log.warning("could not confirm idempotency key", delivery_id=delivery_id,
                                 error=str(exc))
        self.log.info("delivery accepted", delivery_id=delivery_id, event_id=event_id,
                      trace_id=trace_id)
        _settle(future)

    def _unpend(self) -> None:
        with self._pending_lock:
            self._pending -= 1
        metrics.PENDING.set(self._pending)

    # -- idempotency -------------------------------------------------------------------

    def _claim_key(self, request: DeliveryRequestIn, key: str) -> _Claim:
        """Claim ``key`` for this request, or find who holds it.

        A claim whose request was confirmed comes back with ``requested_at_ms = -1``
        (answer from it, publish nothing).
        """
        rkey = idempotency_redis_key(request.owner_id, key)
        fingerprint = hashlib.sha256(request.fingerprint().encode()).hexdigest()
        now = int(time.time() * 1000)
        fresh_id = new_delivery_id()
        # waited for (CHOREO_REDIS_WAIT_REPLICAS): a claim a failover lost would let a retry
        # of the same key publish a second delivery
        try:
            stored = write_waited(self.redis, rkey, lambda pipe: self._claim(
                keys=[rkey], args=[fingerprint, fresh_id, now, now, self.cfg.idempotency_ttl_s], client=pipe))
        except ReplicationLag:
            self._give_up([_Claim(rkey, fresh_id, now, owned=True, claimed_at_ms=now)], handed_over=False)
            raise
        if not stored:
            return _Claim(rkey, fresh_id, now, owned=True, claimed_at_ms=now)
        delivery_id, held_fp, requested_at, claimed_at, confirmed = (
            v.decode() if v is not None else "" for v in stored)
        if held_fp != fingerprint:
            raise IdempotencyConflict("this Idempotency-Key was already used for a different request")
        if confirmed == "1":
            return _Claim(rkey, delivery_id, -1, owned=False)
        if now - int(claimed_at or "0") < self.cfg.publish_timeout_s * 1000:
            raise IdempotencyInProgress(delivery_id)
        claim = _Claim(rkey, delivery_id, int(requested_at), owned=True, claimed_at_ms=now, taken_over=True)
        try:
            taken = write_waited(self.redis, rkey, lambda target: self._take_over(
                keys=[rkey], args=[claimed_at, now], client=target))
        except ReplicationLag:  # not to be trusted: given up at once, not held for the timeout
            self._give_up([claim], handed_over=False)
            raise
        if not taken:
            raise IdempotencyInProgress(delivery_id)
        self.log.info("republishing a stale idempotent request", delivery_id=delivery_id)
        return claim

    def _give_up(self, claims: Sequence[_Claim], handed_over: bool) -> None:
        """Claims whose request was not accepted (one round trip). One under which nothing
        reached the producer, this call's or an earlier one's, is freed, so a retry starts
        afresh. Any other stays, with its delivery id, and may be taken over at once: a
        record handed to the producer, now or by the request taken over, may have reached
        the broker although no report said so, so a retry must publish the same delivery
        again (consumers drop the copy by its event id), never a new one. Either way only
        while the claim is still this call's (its claimed-at)."""
        if not claims:
            return
        pipes = NodePipelines(self.redis)
        for claim in claims:
            if _freed(claim, handed_over):
                self._free(keys=[claim.key], args=[claim.delivery_id, claim.claimed_at_ms],
                           client=pipes.on(claim.key))
            else:
                self._take_over(keys=[claim.key], args=[claim.claimed_at_ms, 0], client=pipes.on(claim.key))
        try:
            raise_first(pipes.execute())
        except redis.RedisError as exc:  # they expire by TTL; a retry takes a stale one over
            self.log.warning("could not give up idempotency claims", error=str(exc))

    def _leave_nothing(self, items: Sequence[_Item], handed_over: bool = False) -> None:
        """The requests were not accepted: give their claims up (``_give_up``), and drop the
        owner records of the deliveries whose claims are freed, or that had no claim."""
        self._give_up([item.claim for item in items if item.claim is not None and item.claim.owned],
                      handed_over)
        owners = [owner_redis_key(item.delivery_id) for item in items if item.owner_recorded
                  and (item.claim is None or _freed(item.claim, handed_over))]
        if not owners:
            return
        try:
            self.redis.delete(*owners)
        except redis.RedisError as exc:  # they expire by TTL
            self.log.warning("could not drop owner records", error=str(exc))

    # -- waiting -----------------------------------------------------------------------

    def wait(self, submission: Submission, timeout_s: float | None = None) -> Accepted:
        """Block until the broker's report (for synchronous callers)."""
        timeout = self.cfg.publish_timeout_s if timeout_s is None else timeout_s
        try:
            submission.confirmed.result(timeout)
            return submission.accepted
        except TimeoutError:
            raise PublishTimeout(submission.delivery_id,
                                 f"no broker confirmation within {timeout}s") from None

    async def submit_async(self, data: bytes | str | dict[str, Any] | DeliveryRequestIn,
                           idempotency_key: str | None = None, *,
                           owner: str | None = None) -> Accepted:
        """``submit`` for an event loop's callers: admitted and published together with the
        other callers' requests (``producers.group``), then the broker's report awaited.

        A request without key or owner is validated on the loop (no I/O); one with either
        claims its key and records its owner on a worker thread first (Redis round trips)."""
        if idempotency_key is None and owner is None:
            prepared = self._prepare(data, None, None)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="submit")
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._executor, functools.partial(self._prepare, data, idempotency_key, owner))
        deadline = time.monotonic() + self.cfg.publish_timeout_s
        if isinstance(prepared, Submission):
            submission = prepared
        else:
            try:  # a group held up (Redis slow to answer) must not hold its callers without end
                result = await self._grouped().submit(prepared, self.cfg.publish_timeout_s)
            except TimeoutError:  # the group may still publish it: the caller is told to look
                raise PublishTimeout(prepared.delivery_id, "not admitted within "
                                     f"{self.cfg.publish_timeout_s}s") from None
            submission = _raised(result)
        waiter = asyncio.wrap_future(submission.confirmed)
        done, _ = await asyncio.wait({waiter}, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise PublishTimeout(submission.delivery_id,
                                 f"no broker confirmation within {self.cfg.publish_timeout_s}s")
        waiter.result()  # raises DeliveryPublishError when the broker refused
        return submission.accepted

    def _grouped(self) -> GroupCommit[_Item, Submission | SubmitError]:
        """The group commit, started with the first request; none once closing."""
        with self._pending_lock:
            if self._closing:
                raise AdmissionRefused("shutting_down", "this instance is shutting down",
                                       self.cfg.retry_after_s, status=503)
            if self._group is None:
                self._group = GroupCommit(self._commit_group, name="submit-group")
            return self._group

    # -- reading -----------------------------------------------------------------------

    def owner_of(self, delivery_id: str) -> str | None:
        """The owner recorded at submission (owner tokens on), or None."""
        raw = self.redis.get(owner_redis_key(delivery_id))
        return raw.decode() if isinstance(raw, bytes) else None

    def status(self, delivery_id: str) -> dict[str, Any] | None:
        """The delivery's outcome and step states from the state table; None if unknown."""
        stored: dict[bytes, bytes] = self.redis.hgetall(delivery_key(delivery_id))  # type: ignore[assignment]
        raw = {k.decode(): v.decode() for k, v in stored.items()}
        if not raw:
            return None
        steps = parse_steps(raw)
        outcome = told_in_state(raw)
        if outcome:
            status = outcome
        elif raw.get("outcome"):
            status = "compensating"  # failed: told once its compensation ends (choreo.outcomes)
        elif all(s.status == "pending" for s in steps.values()):
            status = "accepted"
        else:
            status = "in_progress"
        return {
            "delivery_id": delivery_id,
            "status": status,
            "outcome": outcome,
            "steps": {
                name: {"status": s.status, "attempt": s.attempt, "tries": s.tries,
                       "failures": s.failures, "complete_by_ms": s.complete_by,
                       "updated_ms": s.updated, **({"error": s.error} if s.error else {})}
                for name, s in sorted(steps.items())
            },
        }


def _raised(result: Submission | SubmitError) -> Submission:
    """The submission, or its error raised. One error object may answer a whole group: its
    traceback is reset on each raise, or every caller's frames would pile up on it."""
    if isinstance(result, Exception):
        raise result.with_traceback(None)
    return result


def _settle(future: Future[None], exc: BaseException | None = None) -> None:
    """Resolve once; a caller that gave up (cancelled) must not break the poll thread."""
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(None)
    except Exception:  # InvalidStateError: cancelled concurrently
        pass
