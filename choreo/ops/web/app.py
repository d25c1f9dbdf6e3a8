"""The operators' live view: one page, refreshed by htmx every few seconds.

Every request is bounded. The live part renders the sampler's last snapshot (no broker or
Redis call in a request); a search runs one trace (``choreo.ops.trace``) for a delivery
id that must be a UUID, at most ``MAX_TRACES`` at once (429 past that); a redrive
(``choreo.ops.dlq.redrive``) covers one dead-letter topic and reason from the oldest
letter shown on, at most ``MAX_REDRIVE`` letters, one at a time (409 while one runs);
a POST body is at most ``MAX_FORM_BYTES``. The server runs under uvicorn held to
``choreo.http_serving``'s bounds (head size and time, idle and per-address connections).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from choreo.http_serving import HttpLimits, loopback, tls_options, uvicorn_config
from choreo.logs import get_logger
from choreo.ops.dlq import RedriveResult, RedriveStopped, Selection, redrive
from choreo.ops.flowdoc import flow_edges
from choreo.ops.records import shown_time
from choreo.ops.trace import Trace, consumer_group, trace
from choreo.ops.web.auth import (
    CSRF_HEADER, SESSION_COOKIE, OperatorTokens, Sessions, Visitor, WebSettings, host_is_loopback, same_origin,
)
from choreo.ops.web.graph import Layout, layout
from choreo.ops.web.sampler import DEAD_LETTERS_PER_PARTITION, Sampler, Snapshot
from choreo.workflow import Workflow

HERE = Path(__file__).parent
MAX_TRACES = 2
MAX_REDRIVE = 1000
MAX_FORM_BYTES = 4096
MAX_ROWS = 50  # rows per table of the live part
REASON_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
OPEN_PATHS = ("/login", "/healthz", "/static/")
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # "no-referrer" makes a form send Origin: null
    "Cache-Control": "no-store",
}
log = get_logger(component="ops-web")


@dataclass
class View:
    """What a page needs besides the snapshot."""

    workflow: Workflow
    layout: Layout
    sampler: Sampler
    tokens: OperatorTokens | None
    sessions: Sessions
    loopback_only: bool
    traces: threading.BoundedSemaphore
    redriving: threading.Lock


def create_app(workflow: Workflow, *, loopback_only: bool, sampler: Sampler | None = None,
               cfg: WebSettings | None = None) -> FastAPI:
    cfg = cfg or WebSettings()
    tokens = OperatorTokens.from_settings(cfg)
    if tokens is None and not loopback_only:
        raise ValueError("the live view is served beyond loopback only with operator tokens (CHOREO_OPS_TOKENS_FILE)")
    # served over HTTPS (the server's own TLS): the session cookie is never sent in clear
    secure = bool(tls_options())
    view = View(workflow, layout(flow_edges(workflow)), sampler or Sampler(workflow), tokens,
                Sessions(cfg.session_ttl_s), loopback_only, threading.BoundedSemaphore(MAX_TRACES),
                threading.Lock())
    pages = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
    pages.filters["when"] = _when
    pages.filters["rate"] = _rate

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        view.sampler.start()
        try:
            yield
        finally:
            view.sampler.stop()

    app = FastAPI(title="choreo live view", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    def page(name: str, request: Request, status_code: int = 200, **values: Any) -> HTMLResponse:
        visitor: Visitor | None = getattr(request.state, "visitor", None)
        csrf = view.sessions.csrf(visitor.session) if visitor and visitor.session else ""
        body = pages.get_template(name).render(view=view, visitor=visitor, csrf=csrf, csrf_header=CSRF_HEADER,
                                               **values)
        return HTMLResponse(body, status_code=status_code)

    def visitor_of(request: Request) -> Visitor | None:
        if view.tokens is None:
            return Visitor(None)
        operator = view.tokens.bearer(request.headers.get("authorization"))
        if operator is not None:
            return Visitor(operator)
        session = request.cookies.get(SESSION_COOKIE)
        operator = view.sessions.operator(session)
        return Visitor(operator, session) if operator is not None else None

    @app.middleware("http")
    async def gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await _gate(request, call_next)
        response.headers.update(HEADERS)
        return response

    async def _gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if view.loopback_only and not host_is_loopback(request):
            return _refuse(request, 421, "this view answers only to a loopback host name")
        if request.method not in ("GET", "HEAD") and not same_origin(request):
            return _refuse(request, 403, "a change must come from the view's own pages")
        path = request.url.path
        if path.startswith(OPEN_PATHS):
            return await call_next(request)
        visitor = visitor_of(request)
        if visitor is None:
            if request.headers.get("hx-request"):
                return Response(status_code=401, headers={"HX-Redirect": "/login"})
            if request.method == "GET":
                return RedirectResponse("/login", status_code=303)
            return _refuse(request, 401, "an operator token is required (Authorization: Bearer)")
        if request.method not in ("GET", "HEAD") and visitor.session is not None \
                and not view.sessions.csrf_ok(visitor.session, request.headers.get(CSRF_HEADER)):
            return _refuse(request, 403, "the session's CSRF token is missing or wrong")
        request.state.visitor = visitor
        return await call_next(request)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request) -> HTMLResponse:
        return page("index.html", request, live=live_values(view, view.sampler.snapshot))

    @app.get("/live", response_class=HTMLResponse)
    async def live(request: Request) -> HTMLResponse:
        return page("live.html", request, live=live_values(view, view.sampler.snapshot))

    @app.get("/timeline", response_class=HTMLResponse)
    async def timeline(request: Request, delivery: str = "") -> HTMLResponse:
        wanted = _delivery_id(delivery[:64])
        if wanted is None:
            return page("timeline.html", request, status_code=422, problem="a delivery id is a UUID")
        if not view.traces.acquire(blocking=False):
            return page("timeline.html", request, status_code=429, problem="other searches are running: try again")
        try:
            found: Trace = await run_in_threadpool(trace, wanted, view.workflow)
        except Exception as exc:  # noqa: BLE001 - the cause is logged, the page says it failed
            log.warning("ops_web.trace_failed", delivery_id=wanted, error=type(exc).__name__)
            return page("timeline.html", request, status_code=503, problem="the trace failed: see the server's log")
        finally:
            view.traces.release()
        return page("timeline.html", request, trace=found)

    @app.post("/dead-letters/redrive", response_class=HTMLResponse)
    async def redrive_letters(request: Request) -> HTMLResponse:
        visitor: Visitor = request.state.visitor
        if not visitor.may_act:
            return page("redrive.html", request, status_code=403,
                        problem="a redrive needs an operator token (set CHOREO_OPS_TOKENS_FILE)")
        form = await _form(request)
        if form is None:
            return page("redrive.html", request, status_code=413, problem="the form is too large")
        topic, reason = form.get("topic", ""), form.get("reason", "")
        shown = [d for d in view.sampler.snapshot.dead_letters if (d.dlq_topic, d.reason) == (topic, reason)]
        if not shown or not set(reason) <= REASON_CHARS:
            return page("redrive.html", request, status_code=422, problem="no such dead letters on the page")
        if not view.redriving.acquire(blocking=False):
            return page("redrive.html", request, status_code=409, problem="a redrive is running: try again")
        # from the records' own times, which the search goes by, and never below 0: a time
        # header of 999 would make it -1, Kafka's "the end"
        since_ms = max(0, min(d.written_ms for d in shown) - 1000)
        selection = Selection(topics=[topic], reasons=[reason], since_ms=since_ms, limit=MAX_REDRIVE)
        try:
            result: RedriveResult = await run_in_threadpool(redrive, selection)
        except Exception as exc:  # noqa: BLE001
            done = len(exc.done.redriven) if isinstance(exc, RedriveStopped) else 0
            log.warning("ops_web.redrive_failed", topic=topic, reason=reason, error=type(exc).__name__,
                        redriven=done)
            return page("redrive.html", request, status_code=503,
                        problem=f"the redrive failed after {done} redriven: see the server's log")
        finally:
            view.redriving.release()
        log.info("ops_web.redriven", operator=visitor.operator, topic=topic, reason=reason,
                 redriven=len(result.redriven), skipped=len(result.skipped))
        return page("redrive.html", request, result=result, topic=topic, reason=reason)

    @app.get("/login", response_class=HTMLResponse)
    async def login_form(request: Request) -> Response:
        if view.tokens is None:
            return RedirectResponse("/", status_code=303)
        return page("login.html", request)

    @app.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        form = await _form(request)
        operator = view.tokens.holder(form.get("token")) if view.tokens is not None and form else None
        if operator is None:
            log.warning("ops_web.login_refused")  # never the token
            return page("login.html", request, status_code=401, problem="unknown token")
        log.info("ops_web.login", operator=operator)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(SESSION_COOKIE, view.sessions.open(operator), max_age=view.sessions.ttl_s,
                            httponly=True, samesite="strict", path="/", secure=secure)
        return response

    @app.post("/logout")
    async def logout(request: Request) -> Response:
        view.sessions.close(request.cookies.get(SESSION_COOKIE))
        response = Response(status_code=204, headers={"HX-Redirect": "/login"})
        response.delete_cookie(SESSION_COOKIE, path="/", secure=secure, httponly=True, samesite="strict")
        return response

    return app


def live_values(view: View, snap: Snapshot) -> dict[str, Any]:
    """The snapshot arranged for the page: numbers per node and arrow, tables cut to
    ``MAX_ROWS``."""
    status = snap.deliveries
    service_of = {step.name: step.service for step in view.workflow.steps}
    services: dict[str, dict[str, int]] = {}
    for node in view.layout.nodes.values():
        if node.kind == "service":
            services[node.name] = {"lag": snap.group_lag(consumer_group(node.name)), "in_flight": 0, "stuck": 0,
                                   "failed": 0, "compensating": 0,
                                   "dead": sum(1 for d in snap.dead_letters if d.service == node.name)}
    for kind in ("in_flight", "stuck", "failed", "compensating"):
        for step in getattr(status, kind, []):
            counts = services.get(service_of.get(step.step, ""))
            if counts is not None:
                counts[kind] += 1
    arrows = []
    for arrow in view.layout.arrows:
        if arrow.kind == "consume":
            key = (consumer_group(arrow.service), arrow.topics[0])
            rate, lag = snap.handled.get(key, 0.0), snap.lag.get(key, 0)
        else:
            rate, lag = sum(snap.rates.get(t, 0.0) for t in arrow.topics), 0
        arrows.append({"arrow": arrow, "rate": rate, "lag": lag})
    groups = sorted({g for g, _ in snap.lag})
    return {"snap": snap, "status": status, "services": services, "arrows": arrows, "max_rows": MAX_ROWS,
            "lag_by_group": [(g, snap.group_lag(g)) for g in groups], "letters": snap.dead_letters[:MAX_ROWS],
            "per_partition": DEAD_LETTERS_PER_PARTITION}


def _refuse(request: Request, status: int, message: str) -> Response:
    if "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(f"<p>{status}: {message}</p>", status_code=status)
    return JSONResponse({"error": status, "message": message}, status_code=status)


async def _form(request: Request) -> dict[str, str] | None:
    """A urlencoded form of at most ``MAX_FORM_BYTES`` and 16 fields (None past either):
    first value per name."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        fields = parse_qs(body.decode(errors="replace"), max_num_fields=16)
    except ValueError:  # more fields than any form of the view has
        return None
    return {name: values[0] for name, values in fields.items()}


def _delivery_id(text: str) -> str | None:
    try:
        return str(uuid.UUID(text.strip()))
    except ValueError:
        return None


def _when(ms: int) -> str:
    return shown_time(ms, with_date=False)


def _rate(value: float) -> str:
    return f"{value:.0f}/s" if value >= 10 else f"{value:.1f}/s"



def refusal(status: int, code: str, message: str) -> tuple[str, bytes]:
    """A refusal of the connection guard (``choreo.http_serving``) as plain text."""
    return "text/plain; charset=utf-8", f"{status} {code}: {message}\n".encode()


def serve(workflow: Workflow, host: str, port: int, *, interval_s: float = 2.0, log_level: str = "warning") -> None:
    """Serve the view with uvicorn under the connection bounds both HTTP servers use;
    refuses (``ValueError``) a non-loopback address without operator tokens."""
    app = create_app(workflow, loopback_only=loopback(host), sampler=Sampler(workflow, interval_s=interval_s))
    config = uvicorn_config(app, host, port, HttpLimits(max_connections=200, max_connections_per_ip=32), refusal,
                            access_log=False, log_level=log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
