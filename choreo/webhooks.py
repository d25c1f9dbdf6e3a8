"""Outcome webhooks: each owner's configured endpoint is told how its deliveries ended.

Run as a service of its own (``choreo run choreo.webhooks:service``): it reads the events
that decide a delivery (the workflow's join outcomes, ``Workflow.outcome_labels``, and the
compensation log, whose last record of a compensation tells how it ended: the same one
outcome per delivery as the reply topic gets, ``choreo.outcomes.told``), looks up
the endpoint of the delivery's owner (the envelope's ``owner_id``, set at ingestion) and
POSTs the outcome as JSON. Endpoints are configured per owner by the operator
(``WEBHOOKS_FILE``), never given per request, so no request can aim the service at an
internal address.

* **Signed**: ``X-Choreo-Signature: sha256=<hex>`` is HMAC-SHA256 with the owner's secret
  over ``<X-Choreo-Timestamp>.<body>``; a receiver recomputes it and refuses an old
  timestamp (replays). Secrets come from a file or an environment variable the
  configuration names, never from the configuration itself, and are never logged.
* **Exactly once for a receiver that dedupes**: ``X-Choreo-Id`` is the deciding event's id,
  the same on every try and every replay of the batch.
* **Bounded**: each try ends within ``WEBHOOK_TIMEOUT_S`` in all (``choreo.bounded_http``:
  a receiver that answers ``100 Continue`` for ever, or its head a byte at a time, cannot
  hold it longer), its connect within ``WEBHOOK_CONNECT_TIMEOUT_S``; a failed try is retried by the
  runner with back-off, ``WEBHOOK_MAX_TRIES`` tries in all, then the event is dead-lettered
  (``dlq.error`` says why: the receiver's status or the network error). After an owner's
  endpoint spent its tries, its next outcomes are dead-lettered at once for
  ``WEBHOOK_COOLDOWN_S`` (``receiver cooling down``), so one dead receiver does not hold the
  consumer for every outcome behind it. Dead letters are redriven once the receiver is back.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx
from prometheus_client import Counter

from choreo.bounded_http import bounded_client, within
from choreo.errors import Rejected, Retryable
from choreo.events import Event
from choreo.outcomes import outcome_of, told
from choreo.runtime_events import CompensationRecord
from choreo.service import Context, Service
from choreo.workflow import Workflow, load_workflow

H_ID = "X-Choreo-Id"
H_TIMESTAMP = "X-Choreo-Timestamp"
H_SIGNATURE = "X-Choreo-Signature"
MAX_TRIES = int(os.environ.get("WEBHOOK_MAX_TRIES", "4"))
CONNECT_TIMEOUT_S = float(os.environ.get("WEBHOOK_CONNECT_TIMEOUT_S", "1"))
TIMEOUT_S = float(os.environ.get("WEBHOOK_TIMEOUT_S", "2"))
COOLDOWN_S = float(os.environ.get("WEBHOOK_COOLDOWN_S", "30"))
# at most batch x (tries x timeout + back-off) per batch, five owners' receivers all timing
# out (the back-off of the three retries is at most 0.1 + 0.2 + 0.4 s: ``Runner._retry``):
# 5 x (4 x 2 + 0.7) s = 44 s, inside the consumer's max.poll.interval (60 s)
BATCH_SIZE = int(os.environ.get("WEBHOOK_BATCH_SIZE", "5"))

POSTS = Counter("choreo_webhook_posts_total", "Webhook tries by result", ["result"])

service = Service("webhooks", batch_size=BATCH_SIZE, in_process_retries=MAX_TRIES - 1)


@dataclass(frozen=True)
class Endpoint:
    url: str
    secret: bytes
    internal: bool = False  # its host may resolve to a loopback, private or link-local address

    def __repr__(self) -> str:  # the secret never reaches a log line
        return f"Endpoint(url={self.url!r})"


def _secret(owner: str, entry: dict[str, Any]) -> bytes:
    if "secret_file" in entry:
        path = Path(str(entry["secret_file"]))
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"webhook secret of {owner}: {path} must be readable by its owner only")
        return path.read_bytes().strip()
    if "secret_env" in entry:
        value = os.environ.get(str(entry["secret_env"]), "")
        if value:
            return value.encode()
    raise ValueError(f"webhook of {owner}: a secret_file or a set secret_env is required")


def load_endpoints(path: Path) -> dict[str, Endpoint]:
    """``{"<owner>": {"url": "https://...", "secret_file": "/run/secrets/x"}}`` (or
    ``"secret_env": "VAR"``): the operator's list of endpoints, one per owner. An endpoint
    reaches public addresses only (``choreo.bounded_http``) unless marked ``"internal": true``."""
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a JSON object of owner -> endpoint")
    endpoints = {}
    for owner, entry in raw.items():
        url = str(entry.get("url", ""))
        if httpx.URL(url).scheme not in ("http", "https"):
            raise ValueError(f"webhook of {owner}: an http(s) URL is required")
        endpoints[str(owner)] = Endpoint(url, _secret(str(owner), entry), entry.get("internal") is True)
    return endpoints


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """What ``X-Choreo-Signature`` holds; a receiver compares it with ``hmac.compare_digest``."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


@dataclass
class _Sender:
    endpoints: dict[str, Endpoint]
    client: httpx.Client
    cooling: dict[str, float]


_sender: _Sender | None = None


def _state() -> _Sender:
    global _sender
    if _sender is None:
        path = os.environ.get("WEBHOOKS_FILE", "")
        _sender = _Sender(
            load_endpoints(Path(path)) if path else {},
            bounded_client(httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S)),
            {})
    return _sender


def _post(flow: Workflow) -> Any:
    def post(event: Event, ctx: Context) -> None:
        label = told(event, flow)
        if label is None:
            return  # tells its submitter nothing (yet): a compensation's step, or a failure to undo
        sender = _state()
        owner = ctx.envelope.owner
        endpoint = sender.endpoints.get(owner)
        if endpoint is None:
            return  # no endpoint configured for this owner (or none named): nothing to tell
        if sender.cooling.get(owner, 0.0) > time.monotonic():
            POSTS.labels("cooling_down").inc()
            raise Rejected("receiver cooling down after its last outcome spent every try")
        outcome = outcome_of(event, label, ctx.envelope)
        body = json.dumps(outcome.model_dump(mode="json"), separators=(",", ":")).encode()
        timestamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", H_ID: header_id(outcome.event_id),
                   H_TIMESTAMP: timestamp, H_SIGNATURE: sign(endpoint.secret, timestamp, body)}
        try:
            with within(TIMEOUT_S, endpoint.internal), sender.client.stream("POST", endpoint.url, content=body,
                                                         headers=headers) as answer:
                status = answer.status_code  # the body is never read: a receiver cannot make us wait on it
        except httpx.HTTPError as exc:
            _failed(sender, owner, ctx, f"network: {type(exc).__name__}")
        if not 200 <= status < 300:
            _failed(sender, owner, ctx, f"receiver answered {status}")
        sender.cooling.pop(owner, None)
        POSTS.labels("delivered").inc()
        ctx.log.info("webhook.delivered", owner=owner, tries=ctx.try_no)

    return post


def header_id(event_id: str) -> str:
    """The deciding event's id as ``X-Choreo-Id``: as it is when it is a header's printable
    ASCII, else its SHA-256 (an id is its writer's: one with a line break made every try fail
    before it was sent, and the owner's next outcomes cool down)."""
    if event_id.isascii() and event_id.isprintable():
        return event_id
    return hashlib.sha256(event_id.encode(errors="surrogatepass")).hexdigest()


def _failed(sender: _Sender, owner: str, ctx: Context, why: str) -> NoReturn:
    POSTS.labels("failed").inc()
    if ctx.try_no >= MAX_TRIES:  # the runner dead-letters it after this one
        sender.cooling[owner] = time.monotonic() + COOLDOWN_S
    raise Retryable(f"webhook: {why} (try {ctx.try_no} of {MAX_TRIES})")  # no owner: it is redacted in logs


def _subscribe() -> None:
    """The deciding events of the workflow this instance runs with (``choreo run --workflow``;
    ``WEBHOOKS_WORKFLOW`` names another), and the compensation log."""
    ref = os.environ.get("WEBHOOKS_WORKFLOW") or os.environ.get("SUPERVISOR_WORKFLOW", "")
    if not ref:
        raise RuntimeError("no workflow: run with --workflow, or set WEBHOOKS_WORKFLOW (module:attribute)")
    flow: Workflow = load_workflow(ref)
    for model in deciding(flow):
        service.subscribe(model.topic, model, _post(flow))


def deciding(flow: Workflow) -> list[type[Event]]:
    """What this service reads of ``flow``: every event that may tell an outcome (also what
    its principal may read, ``infra.security``)."""
    return [*flow.outcome_labels, CompensationRecord]


service.defer(_subscribe)
