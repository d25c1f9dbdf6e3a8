"""The ingestion HTTP service: ``POST /deliveries`` turns a request into ``DeliveryRequested``.

It answers 202 as soon as the broker confirmed the event (not when the workflow is done),
with the delivery id and a ``Location`` to poll. Every failure is a clear JSON 4xx/5xx, never
a stack trace; errors never echo the request's values (they may be customer data).

Status codes:
  202 accepted (also for an idempotent retry of an accepted request: same delivery id)
  400 malformed JSON (syntax, bad UTF-8, nesting too deep) or a malformed Idempotency-Key
  408 the request's head or body did not arrive in time (``choreo.http_serving``)
  409 a retry while the first request with the same Idempotency-Key is still unconfirmed
  413 body over the limit (checked on Content-Length, and while streaming chunked bodies)
  415 content type other than application/json
  431 request head (request line and headers) over 16 KB (``choreo.http_serving``)
  422 invalid fields (with the field errors); Idempotency-Key reused for another request;
      a malformed delivery id in GET
  429 admission control: too many deliveries in flight, this owner's share of them, or the
      backlog is past its limit; or more connections from one address than allowed
      (``choreo.http_serving``)
  503 this instance's producer queue is full, or the broker refused the write (a generic
      message: the cause is logged, never answered)
  504 no broker confirmation in time (the write may still land: GET the Location)

Owner tokens (on when ``INGESTION_TOKENS`` or ``INGESTION_TOKENS_FILE`` is set): every
``/deliveries`` call needs ``Authorization: Bearer <token>``; the token maps to one owner id.
  401 no token, or an unknown one (``WWW-Authenticate: Bearer``)
  403 a POST for another ``owner_id`` than the token's
  404 GET of another owner's delivery (indistinguishable from an unknown delivery)
A delivery's state stays in Redis for a while after it ended; then ``GET /deliveries/{id}``
answers from Kafka (``producers.history``, ``"source": "kafka"``), still only to its owner
(the request's ``owner_id``); 503 with ``Retry-After`` while every Kafka lookup slot is busy,
or the caller's own.
``GET /deliveries/{id}/events`` streams its status changes (server-sent events,
``producers.stream``), authorised like the status; 429 past the streams a client may hold.
``/metrics``, ``/docs`` and ``/openapi.json`` need a valid token too (401 without);
``/readyz`` without one answers its status code and ``status`` only (probes keep working),
its checks and figures go to token holders; ``/healthz`` stays open.
Tokens are kept only as SHA-256 digests and compared in constant time; neither they nor
the request's fields are ever logged.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from choreo.http_serving import client_key
from choreo.logs import get_logger
from choreo.tokens import BearerTokens
from choreo.tokens import parse_tokens as parse_bearer_tokens
from choreo.memory import settle_garbage_collector
from choreo.publisher import PublishError
from producers import metrics
from producers.errors import (
    AdmissionRefused, IdempotencyConflict, IdempotencyInProgress, PublishTimeout,
)
from producers.history import History, HistoryBusy, HistoryTooLong, KafkaHistory
from producers.model import OWNER_ID_PATTERN, DeliveryRequestIn, InvalidRequest
from producers.settings import IngestionSettings
from producers.stream import StreamSlots, delivery_events
from producers.submit import OwnerMismatch, Submitter

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
log = get_logger(component="ingestion-http")


def parse_tokens(text: str) -> dict[str, str]:
    """``<token>=<owner_id>`` entries or ``{"<token>": "<owner_id>"}`` (``choreo.tokens``)."""
    return parse_bearer_tokens(text, "owner", re.compile(OWNER_ID_PATTERN))


class OwnerTokens(BearerTokens):
    """Bearer token -> owner id."""

    @classmethod
    def from_settings(cls, cfg: IngestionSettings) -> OwnerTokens | None:
        if not cfg.auth_enabled:
            return None
        found = parse_tokens(cfg.tokens)
        if cfg.tokens_file is not None:
            found.update(parse_tokens(cfg.tokens_file.read_text()))
        if not found:
            raise ValueError("owner tokens are configured but none were found")
        return cls(found)


def error(status: int, code: str, message: str, headers: Mapping[str, str] | None = None,
          **extra: Any) -> JSONResponse:
    """The one error shape: ``{"error": code, "message": ..., ...}``."""
    return JSONResponse({"error": code, "message": message, **extra}, status_code=status,
                        headers=headers)


class TokenHolders:
    """In token mode, what tells how the service runs (metrics, readiness figures, the API's
    own documents) is for token holders only: every path but the probes' needs a valid
    token. ``/deliveries`` and ``/readyz`` check it themselves (the owner it names; the
    probe's bare answer)."""

    OPEN = ("/healthz", "/readyz")
    SELF_CHECKED = "/deliveries"

    def __init__(self, app: ASGIApp, tokens: OwnerTokens, refuse: Callable[[], Response]) -> None:
        self.app = app
        self.tokens = tokens
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and path not in self.OPEN and not path.startswith(self.SELF_CHECKED):
            header = dict(scope.get("headers") or []).get(b"authorization")
            if self.tokens.bearer(header.decode("latin-1") if header is not None else None) is None:
                await self.refuse()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """The request body passed the limit while it was being received."""


class BodyLimit:
    """Refuse oversized bodies before anything parses them.

    A declared Content-Length over the limit is refused without reading; a chunked body is
    counted as it streams in and refused the moment it passes the limit, so no route (and
    no framework parser) ever holds more than ``max_bytes`` of a request in memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await error(400, "bad_request", "invalid Content-Length")(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                metrics.REJECTED.labels("too_large").inc()
                await self._too_large(scope, receive, send)
                return
        received = 0
        started = False

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracking)
        except BodyTooLarge:
            if started:
                raise
            metrics.REJECTED.labels("too_large").inc()
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error(413, "payload_too_large",
                         f"request body is larger than {self.max_bytes} bytes",
                         headers={"Connection": "close"})
        await response(scope, receive, send)


def is_json(content_type: str | None) -> bool:
    """application/json, optionally with charset=utf-8 (JSON is UTF-8 by definition)."""
    if not content_type:
        return False
    media, _, params = content_type.partition(";")
    if media.strip().lower() != "application/json":
        return False
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def canonical_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def _document_body(app: FastAPI) -> None:
    """The body is read by hand (size limit, strict parsing): put its schema in the OpenAPI
    document all the same, so /docs shows what to send."""
    schema = DeliveryRequestIn.model_json_schema(ref_template="#/components/schemas/{model}")
    defs: dict[str, Any] = schema.pop("$defs", {})
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = generate()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        components.update(defs)
        components["DeliveryRequestIn"] = schema
        doc["paths"]["/deliveries"]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DeliveryRequestIn"}}},
        }
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(settings: IngestionSettings | None = None,
               submitter: Submitter | None = None, settle_gc: bool = False) -> FastAPI:
    """The app; it starts its own ``Submitter`` (producer, poll thread, admission monitor)
    on startup unless one is given, and flushes it on shutdown. ``settle_gc``: the process
    is the app's alone (``choreo serve``): settle its garbage collector once started
    (``choreo.memory``), never in a process that hosts other work, such as a test run."""
    cfg = settings or IngestionSettings()
    tokens = OwnerTokens.from_settings(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sub = submitter or Submitter(cfg, entry="http")
        await run_in_threadpool(sub.start)
        app.state.submitter = sub
        publisher = getattr(sub, "publisher", None)  # a stand-in submitter may have none
        if publisher is not None and publisher.workflow is not None:
            app.state.history = KafkaHistory(publisher.workflow, sub.redis, cfg.history_concurrency,
                                             cfg.history_per_caller, cfg.max_body_bytes)
        if settle_gc:  # the process is ours (``choreo serve``), its start-up done
            settle_garbage_collector()
        try:
            yield
        finally:
            if submitter is None:
                await run_in_threadpool(sub.close)

    app = FastAPI(title="Drone delivery ingestion", version="1", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)

    def sub_of(request: Request) -> Submitter:
        found: Submitter = request.app.state.submitter
        return found

    def unauthorized() -> Response:
        metrics.REJECTED.labels("unauthorized").inc()
        log.warning("request.unauthorized")  # never the header: it may hold a valid token
        return error(401, "unauthorized", "a valid owner token is required (Authorization: Bearer)",
                     headers={"WWW-Authenticate": 'Bearer realm="deliveries"'})

    if tokens is not None:
        app.add_middleware(TokenHolders, tokens=tokens, refuse=unauthorized)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_: Request, __: Exception) -> Response:
        metrics.REJECTED.labels("too_large").inc()
        return error(413, "payload_too_large",
                     f"request body is larger than {cfg.max_body_bytes} bytes",
                     headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, __: Exception) -> Response:
        # the client left, or the body deadline cut it off (408 already sent): nobody reads this
        return Response(status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error(exc.status_code, code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = [{"field": ".".join(str(p) for p in e["loc"]), "message": e["msg"],
                   "type": e["type"]} for e in exc.errors()]
        return error(422, "invalid_request", "the request is invalid", errors=errors)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.error("unexpected error", error_type=type(exc).__name__)
        return error(500, "internal_error", "an internal error occurred; it has been logged")

    @app.post("/deliveries", status_code=202,
              summary="Request a delivery (202 once the request is durably accepted)")
    async def submit(request: Request) -> Response:
        owner: str | None = None
        if tokens is not None:
            owner = tokens.bearer(request.headers.get("authorization"))
            if owner is None:
                return unauthorized()
        if not is_json(request.headers.get("content-type")):
            metrics.REJECTED.labels("content_type").inc()
            return error(415, "unsupported_media_type", "Content-Type must be application/json")
        key = request.headers.get("idempotency-key")
        if key is not None and not IDEMPOTENCY_KEY.fullmatch(key):
            metrics.REJECTED.labels("idempotency_key").inc()
            return error(400, "invalid_idempotency_key",
                         "Idempotency-Key must be 1-255 visible ASCII characters")
        body = await request.body()
        try:
            accepted = await sub_of(request).submit_async(body, key, owner=owner)
        except InvalidRequest as exc:
            if exc.malformed:
                metrics.REJECTED.labels("malformed").inc()
                return error(400, "malformed_json", "the body is not valid JSON: "
                             + "; ".join(e["message"] for e in exc.errors))
            metrics.REJECTED.labels("invalid").inc()
            return error(422, "invalid_request", f"{exc.total} invalid field(s)"
                         + (f", the first {len(exc.errors)} told" if exc.total > len(exc.errors) else ""),
                         errors=exc.errors)
        except OwnerMismatch as exc:
            metrics.REJECTED.labels("forbidden").inc()
            log.warning("request.forbidden", why="owner_mismatch")
            return error(403, "forbidden", str(exc))
        except IdempotencyConflict as exc:
            metrics.REJECTED.labels("idempotency_conflict").inc()
            return error(422, "idempotency_key_reused", str(exc))
        except IdempotencyInProgress as exc:
            return error(409, "request_in_progress", str(exc), headers={"Retry-After": "1"},
                         delivery_id=exc.delivery_id)
        except AdmissionRefused as exc:
            retry = {"Retry-After": str(exc.retry_after_s)}
            if exc.status == 429:
                return error(429, "overloaded", exc.detail, headers=retry, reason=exc.reason,
                             retry_after_s=exc.retry_after_s)
            log.warning("request.unavailable", reason=exc.reason, detail=exc.detail)
            return error(exc.status, "unavailable", "this instance cannot take the request now; retry",
                         headers=retry, reason=exc.reason, retry_after_s=exc.retry_after_s)
        except PublishTimeout as exc:
            return error(504, "confirmation_timeout", exc.detail, delivery_id=exc.delivery_id,
                         headers={"Location": f"/deliveries/{exc.delivery_id}"})
        except PublishError as exc:
            # its text may name a broker, a store or a serializer's complaint: types only
            log.warning("request.publish_failed", error_type=type(exc).__name__,
                        cause=type(exc.__cause__).__name__ if exc.__cause__ else "",
                        delivery_id=getattr(exc, "delivery_id", ""))
            return error(503, "publish_failed", "the request could not be stored; retry",
                         headers={"Retry-After": "1"})
        headers = {"Location": f"/deliveries/{accepted.delivery_id}"}
        if accepted.replayed:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse({"delivery_id": accepted.delivery_id, "status": "accepted"},
                            status_code=202, headers=headers)

    streams = StreamSlots(cfg.sse_per_client, cfg.sse_max_streams, cfg.sse_max_s)

    async def from_kafka(request: Request, delivery_id: str, caller: str) -> History | None:
        """The delivery's story from Kafka (its state expired); HistoryBusy when no slot is free
        (for this caller or at all)."""
        history: KafkaHistory | None = getattr(request.app.state, "history", None)
        if history is None:
            return None
        return await run_in_threadpool(history.lookup, delivery_id, caller)

    async def find(request: Request, delivery_id: str) -> tuple[dict[str, Any] | None, str, Response | None]:
        """The delivery's status for this caller and who the caller is (the owner, or its
        address without tokens), or the response that refuses it. Another owner's delivery
        answers exactly like an unknown one: no oracle."""
        owner: str | None = None
        if tokens is not None:
            owner = tokens.bearer(request.headers.get("authorization"))
            if owner is None:
                return None, "", unauthorized()
        if not canonical_uuid(delivery_id):
            return None, "", error(422, "invalid_delivery_id", "a delivery id is a UUID")
        delivery_id = delivery_id.lower()
        caller = owner if owner is not None else client_key(request.client.host if request.client else "")
        unknown = error(404, "not_found", f"no delivery {delivery_id}")
        recorded: str | None = None
        if owner is not None:
            recorded = await run_in_threadpool(sub_of(request).owner_of, delivery_id)
            if recorded is not None and not hmac.compare_digest(recorded.encode(), owner.encode()):
                return None, caller, unknown
        found = await run_in_threadpool(sub_of(request).status, delivery_id)
        if found is not None and (owner is None or recorded is not None):
            return found, caller, None
        # the state expired, or (with tokens) the owner record did: the request on Kafka
        # says whose the delivery is
        try:
            told = await from_kafka(request, delivery_id, caller)
        except HistoryBusy:
            return None, caller, error(503, "busy", "the delivery's history cannot be read now; retry",
                                       headers={"Retry-After": "1"})
        except HistoryTooLong:
            return None, caller, error(503, "history_too_long",
                                       "the delivery's history is longer than a status lookup reads")
        if told is None or (owner is not None
                            and not hmac.compare_digest(told.owner_id.encode(), owner.encode())):
            return None, caller, unknown
        return (found if found is not None else told.status), caller, None

    @app.get("/deliveries/{delivery_id}", summary="A delivery's status and step states")
    async def status(delivery_id: str, request: Request) -> Response:
        found, _, refused = await find(request, delivery_id)
        return refused if refused is not None else JSONResponse(found)

    @app.get("/deliveries/{delivery_id}/events",
             summary="Server-sent events: the delivery's status changes, then its outcome")
    async def events(delivery_id: str, request: Request) -> Response:
        _, caller, refused = await find(request, delivery_id)
        if refused is not None:
            return refused
        delivery_id = delivery_id.lower()
        slot = streams.take(caller)
        if slot is None:
            metrics.REJECTED.labels("streams").inc()
            return error(429, "too_many_streams", "too many open event streams; close one or retry later",
                         headers={"Retry-After": "5"})
        sub = sub_of(request)
        ends = time.monotonic() + cfg.sse_max_s  # the stream's own end (``delivery_events``)

        async def state() -> dict[str, Any] | None:
            return await run_in_threadpool(sub.status, delivery_id)

        async def story() -> dict[str, Any] | None:
            # the caller's own lookup slot may be taken by its other lookups: wait for it
            # within the stream's time, since giving up would tell an "unknown" delivery
            while True:
                try:
                    told = await from_kafka(request, delivery_id, caller)
                    return told.status if told is not None else None
                except HistoryBusy:
                    if time.monotonic() >= ends or await request.is_disconnected():
                        return None
                    await asyncio.sleep(0.5)
                except HistoryTooLong:
                    return None

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in delivery_events(delivery_id, state, story, request.is_disconnected,
                                                   poll_s=cfg.sse_poll_s, max_s=cfg.sse_max_s):
                    yield chunk
            finally:
                streams.give_back(caller, slot)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/healthz", summary="Liveness: the process serves requests")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: Redis reachable, backlog measured, producer polled")
    async def readyz(request: Request) -> Response:
        sub = sub_of(request)
        checks = sub.ready()
        ok = all(checks.values())
        status: dict[str, Any] = {"status": "ready" if ok else "not_ready"}
        if tokens is None or tokens.bearer(request.headers.get("authorization")) is not None:
            status |= {"checks": checks, **sub.admission.snapshot(), "pending": sub.pending}
        return JSONResponse(status, status_code=200 if ok else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    _document_body(app)
    return app
