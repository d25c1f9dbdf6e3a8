"""The HTTP face of the registry: Confluent Schema Registry's REST API, path for path.

Routing works on the *raw* request path, segment by segment, and unquotes each segment only
after splitting: the client percent-encodes subjects (``a%2Fb`` for ``a/b``), and routing on
the decoded path would let a subject's slash, dot-dot or control character change which
endpoint answers. Every answer, including unknown paths, wrong methods, bad media types,
oversized bodies and unexpected failures, is a JSON ``{"error_code", "message"}`` body with
the real registry's status; a stack trace never leaves the process.

Optional HTTP basic authentication with roles (``registry.auth``; off by default): each
endpoint needs ``read``, ``write`` (register under a subject) or ``admin`` (deletes, config
and mode changes); writes always need a login, reads too when ``protect_reads`` is set,
except ``/`` and ``/_health`` (probes). An unknown login is 401 with ``WWW-Authenticate``, a
known one without the role 403 (40301), both with the Confluent error body. A follower
forwards a write to the leader only when the leader's lease is signed with the instances'
shared secret, and sends the caller's name in a signed request, never the caller's password.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from choreo.logs import get_logger
from registry import errors
from registry.auth import SIGNATURE_HEADER, Access, BasicAuth, Peers
from registry.registry import Registry, check_subject

log = get_logger(component="registry.api")

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
ACCEPTED_TYPES = frozenset({
    "application/vnd.schemaregistry.v1+json", "application/vnd.schemaregistry+json",
    "application/json", "application/octet-stream", "",
})
FORWARDED_HEADER = "x-registry-forwarded"
POSITION_HEADER = "x-registry-log-position"
DENIED = 40301  # Confluent's error code for a login without the role an operation needs
MAX_SCHEMAS_PAGE = 1000  # schemas one GET /schemas answers with at most
MAX_SCHEMAS_PAGE_CHARS = 8 * 1024 * 1024  # and the schemas' text (with references) past which its page ends
_COUNT = re.compile(r"-?[0-9]{1,9}")


@dataclass
class Call:
    """What a handler sees: path parameters, query, the parsed body and the registry."""

    registry: Registry
    params: dict[str, str]
    query: dict[str, str]
    body: dict[str, Any] = field(default_factory=dict)

    def flag(self, name: str) -> bool:
        """Query booleans arrive as true/True/TRUE (the Python client sends ``True``)."""
        return self.query.get(name, "").strip().lower() == "true"

    def subject(self) -> str:
        return check_subject(self.params["subject"])


Handler = Callable[[Call], Any]
OPEN_PATHS = frozenset({(), ("_health",)})


@dataclass(frozen=True)
class Endpoint:
    method: str
    pattern: tuple[str, ...]
    handler: Handler
    access: Access = "read"
    has_body: bool = False

    @property
    def writes(self) -> bool:
        return self.access != "read"

    def match(self, segments: list[str]) -> dict[str, str] | None:
        if len(segments) != len(self.pattern):
            return None
        params: dict[str, str] = {}
        for want, got in zip(self.pattern, segments):
            if want.startswith("{"):
                params[want[1:-1]] = got
            elif want != got:
                return None
        return params


def _associations(call: Call) -> Any:
    raise errors.RegistryError(
        errors.HTTP_NOT_FOUND, errors.SUBJECT_NOT_FOUND,
        "No subject is associated with this resource: associations are not supported by this registry.",
    )


def _referenced_by(call: Call) -> list[int]:
    return call.registry.referenced_by(call.subject(), call.params["version"])


def _all_schemas(call: Call) -> list[dict[str, Any]]:
    """A page of every schema, in subject and version order: from ``offset``, at most
    ``limit`` (``MAX_SCHEMAS_PAGE``, also when asked for more or for all) and ending early
    once the page's text passes ``MAX_SCHEMAS_PAGE_CHARS``, so that no call builds the whole
    store (every schema up to 256 KiB) into one answer."""
    reg = call.registry
    offset, limit = _query_count(call, "offset", 0), _query_count(call, "limit", MAX_SCHEMAS_PAGE)
    limit = MAX_SCHEMAS_PAGE if limit <= 0 else min(limit, MAX_SCHEMAS_PAGE)
    found: list[dict[str, Any]] = []
    seen = chars = 0
    for subject in reg.subjects(call.flag("deleted"), False, call.query.get("subjectPrefix")):
        try:
            versions = reg.versions(subject, call.flag("deleted"))
        except errors.RegistryError:  # deleted since the subjects were listed
            continue
        if call.flag("latestOnly"):
            versions = versions[-1:]
        for version in versions:
            seen += 1
            if seen <= offset:
                continue
            try:
                entry = reg.version(subject, str(version), call.flag("deleted"))
            except errors.RegistryError:
                continue
            found.append(entry)
            chars += len(entry["schema"]) + sum(len(r["name"]) + len(r["subject"]) for r in entry.get("references", []))
            if len(found) >= limit or chars >= MAX_SCHEMAS_PAGE_CHARS:
                return found
    return found


def _query_count(call: Call, name: str, default: int) -> int:
    """A query's count (``-1`` for all, as Confluent's API takes it), else a 400."""
    raw = call.query.get(name)
    if raw is None:
        return default
    if not _COUNT.fullmatch(raw.strip()):
        raise errors.http_error(400, f"{name} is not a count")
    return int(raw)


def _metadata(call: Call) -> Any:
    filters = {k[len("key"):]: v for k, v in call.query.items() if k.startswith("key")}
    return call.registry.metadata(call.subject(), filters, call.flag("deleted"))


def endpoints() -> list[Endpoint]:
    """Every path the pinned confluent-kafka client (and common tooling) calls."""
    s, v, i = "{subject}", "{version}", "{id}"
    return [
        Endpoint("GET", (), lambda c: {}),
        Endpoint("GET", ("_health",), lambda c: {"status": "ok"}),
        Endpoint("GET", ("subjects",), lambda c: c.registry.subjects(
            c.flag("deleted"), c.flag("deletedOnly") or c.flag("deleted_only"), c.query.get("subjectPrefix"))),
        Endpoint("POST", ("subjects", s), lambda c: c.registry.lookup(c.subject(), c.body, c.flag("deleted")),
                 has_body=True),
        Endpoint("DELETE", ("subjects", s), lambda c: c.registry.delete_subject(c.subject(), c.flag("permanent")),
                 access="admin"),
        Endpoint("GET", ("subjects", s, "versions"), lambda c: c.registry.versions(c.subject(), c.flag("deleted"))),
        Endpoint("POST", ("subjects", s, "versions"), lambda c: c.registry.register(c.subject(), c.body),
                 access="write", has_body=True),
        Endpoint("GET", ("subjects", s, "versions", v), lambda c: c.registry.version(
            c.subject(), c.params["version"], c.flag("deleted"))),
        Endpoint("GET", ("subjects", s, "versions", v, "schema"), lambda c: json.loads(c.registry.version(
            c.subject(), c.params["version"], c.flag("deleted"))["schema"])),
        Endpoint("DELETE", ("subjects", s, "versions", v), lambda c: c.registry.delete_version(
            c.subject(), c.params["version"], c.flag("permanent")), access="admin"),
        Endpoint("GET", ("subjects", s, "versions", v, "referencedby"), _referenced_by),
        Endpoint("GET", ("subjects", s, "metadata"), _metadata),
        Endpoint("GET", ("schemas",), _all_schemas),
        Endpoint("GET", ("schemas", "types"), lambda c: ["AVRO"]),
        Endpoint("GET", ("schemas", "ids", i), lambda c: c.registry.schema(c.params["id"], c.query.get("subject"))),
        Endpoint("GET", ("schemas", "ids", i, "schema"), lambda c: json.loads(
            c.registry.schema(c.params["id"], c.query.get("subject"))["schema"])),
        Endpoint("GET", ("schemas", "ids", i, "subjects"), lambda c: c.registry.schema_subjects(
            c.params["id"], c.flag("deleted"), c.query.get("subject"))),
        Endpoint("GET", ("schemas", "ids", i, "versions"), lambda c: c.registry.schema_versions(
            c.params["id"], c.flag("deleted"), c.query.get("subject"))),
        Endpoint("GET", ("config",), lambda c: c.registry.get_config(None, True)),
        Endpoint("PUT", ("config",), lambda c: c.registry.set_config(None, c.body), access="admin", has_body=True),
        Endpoint("DELETE", ("config",), lambda c: c.registry.delete_config(None), access="admin"),
        Endpoint("GET", ("config", s), lambda c: c.registry.get_config(c.subject(), c.flag("defaultToGlobal"))),
        Endpoint("PUT", ("config", s), lambda c: c.registry.set_config(c.subject(), c.body),
                 access="admin", has_body=True),
        Endpoint("DELETE", ("config", s), lambda c: c.registry.delete_config(c.subject()), access="admin"),
        Endpoint("POST", ("compatibility", "subjects", s, "versions", v), lambda c: c.registry.check(
            c.subject(), c.params["version"], c.body, c.flag("verbose")), has_body=True),
        Endpoint("POST", ("compatibility", "subjects", s, "versions"), lambda c: c.registry.check(
            c.subject(), None, c.body, c.flag("verbose")), has_body=True),
        Endpoint("GET", ("mode",), lambda c: c.registry.get_mode(None, True)),
        Endpoint("PUT", ("mode",), lambda c: c.registry.set_mode(None, c.body, c.flag("force")),
                 access="admin", has_body=True),
        Endpoint("GET", ("mode", s), lambda c: c.registry.get_mode(c.subject(), c.flag("defaultToGlobal"))),
        Endpoint("PUT", ("mode", s), lambda c: c.registry.set_mode(c.subject(), c.body, c.flag("force")),
                 access="admin", has_body=True),
        Endpoint("DELETE", ("mode", s), lambda c: c.registry.delete_mode(c.subject()), access="admin"),
        Endpoint("GET", ("contexts",), lambda c: ["."]),
        *[Endpoint(method, ("associations", *rest), _associations, has_body=method in ("POST", "PUT"))
          for method in ("GET", "POST", "PUT", "DELETE")
          for rest in ((), ("{a}",), ("{a}", "{b}"), ("{a}", "{b}", "{c}"), ("{a}", "{b}", "{c}", "{d}"))],
    ]


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), status_code=status,
                    media_type=CONTENT_TYPE, headers=headers)


def _error(exc: errors.RegistryError) -> Response:
    return _json(exc.body(), exc.status)


def _target(request: Request) -> str:
    """The raw path and query as the client sent them (what a forwarded request signs)."""
    raw_path = (request.scope.get("raw_path") or request.url.path.encode()).decode("latin-1")
    query = request.url.query
    return raw_path + (f"?{query}" if query else "")


def refusal(status: int, code: str, message: str) -> tuple[str, bytes]:
    """A refusal of the connection guard (``choreo.http_serving``: 408, 429, 431) in the
    registry's error shape, where the error code of a plain HTTP answer is its status."""
    del code
    return CONTENT_TYPE, json.dumps(errors.RegistryError(status, status, message).body()).encode()


class Api:
    """Binds the endpoint table to a registry, with body limits and write forwarding."""

    def __init__(self, registry: Registry, max_body: int = 1 << 20, forward_timeout_s: float = 15.0,
                 auth: BasicAuth | None = None, peers: Peers | None = None) -> None:
        self.registry = registry
        self.auth = auth
        self.peers = peers
        self.max_body = max_body
        self.endpoints = endpoints()
        self.http = httpx.Client(timeout=forward_timeout_s)
        self.ready = False

    def segments(self, request: Request) -> list[str]:
        raw = request.scope.get("raw_path") or request.scope["path"].encode()
        path = raw.decode("latin-1").split("?", 1)[0]
        parts = [unquote(part, errors="replace") for part in path.split("/")[1:]]
        if parts and parts[-1] == "":
            parts.pop()
        return parts

    async def __call__(self, request: Request) -> Response:
        try:
            return await self._dispatch(request)
        except errors.RegistryError as exc:
            return _error(exc)
        except ClientDisconnect:  # gone, or cut off by the body deadline: nobody reads an answer
            return Response(status_code=400)
        except Exception:
            log.exception("unexpected_error", method=request.method, path=request.url.path[:200])
            return _json({"error_code": 500, "message": "Internal Server Error"}, 500)

    async def _dispatch(self, request: Request) -> Response:
        segments = self.segments(request)
        matches = [(e, p) for e in self.endpoints if (p := e.match(segments)) is not None]
        if not matches:
            raise errors.http_error(404, "Not Found")
        chosen = next(((e, p) for e, p in matches if e.method == request.method), None)
        if chosen is None:
            raise errors.http_error(405, "Method Not Allowed")
        endpoint, params = chosen
        body_bytes: bytes | None = None
        user: str | None = None
        auth = self.auth
        if auth is not None and endpoint.pattern not in OPEN_PATHS and auth.required(endpoint.access):
            if self.peers is not None and SIGNATURE_HEADER in request.headers:  # a peer forwarded it
                body_bytes = await self._body(request) if endpoint.has_body else b""
                user = self.peers.verify_request(request.headers, request.method, _target(request), body_bytes)
            else:
                user = auth.check(request.headers.get("authorization"))
            if user is None:
                return _json({"error_code": 401, "message": "Unauthorized"}, 401,
                             headers={"WWW-Authenticate": f'Basic realm="{auth.realm}"'})
            if not auth.grant(user).allows(endpoint.access, params.get("subject")):
                return _json({"error_code": DENIED, "message": f"User {user} is denied this operation: "
                              f"it needs the {endpoint.access} role"}, 403)
        if not self.ready and endpoint.pattern != ("_health",):
            raise errors.RegistryError(503, errors.OPERATION_TIMEOUT, "The registry is still reading its store")
        if body_bytes is None:
            body_bytes = await self._body(request) if endpoint.has_body else b""
        call = Call(self.registry, params, dict(request.query_params), self._parse(body_bytes))
        if endpoint.pattern == ("_health",):  # it asks Redis who leads: never on the event loop
            return _json(await run_in_threadpool(self.health))
        try:
            result = await run_in_threadpool(endpoint.handler, call)
        except errors.NotLeaderError as exc:
            if exc.leader_url is None or request.headers.get(FORWARDED_HEADER):
                raise
            return await run_in_threadpool(self._forward, request, body_bytes, exc, user)
        headers = {POSITION_HEADER: str(self.registry.store.position)} if endpoint.writes else None
        return _json(result, headers=headers)

    async def _body(self, request: Request) -> bytes:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media not in ACCEPTED_TYPES:
            raise errors.http_error(415, "Unsupported Media Type")
        declared = request.headers.get("content-length", "")
        too_large = errors.RegistryError(
            errors.HTTP_TOO_LARGE, errors.HTTP_TOO_LARGE, f"Request body is larger than {self.max_body} bytes")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any]:
        if not raw.strip():
            return {}
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise errors.RegistryError(
                errors.HTTP_BAD_REQUEST, errors.HTTP_BAD_REQUEST,
                f"Malformed JSON in the request body: {str(exc)[:200]}") from None
        if not isinstance(parsed, dict):
            raise errors.RegistryError(
                errors.HTTP_UNPROCESSABLE, errors.HTTP_UNPROCESSABLE,
                f"Unrecognized request body: expected a JSON object, got {type(parsed).__name__}")
        return parsed

    def _forward(self, request: Request, body: bytes, exc: errors.NotLeaderError, user: str | None) -> Response:
        """Hand a write to the leader, then wait until our own reader has seen its effect.

        The caller's ``Authorization`` never leaves this instance: with authentication on, the
        leader learns who asks from a request signed with the peer secret, and without that
        secret a write is not forwarded at all (the election follows only signed leases)."""
        assert exc.leader_url is not None
        target = _target(request)
        headers = {"content-type": request.headers.get("content-type", CONTENT_TYPE), FORWARDED_HEADER: "1"}
        if self.auth is not None:
            if self.peers is None or user is None:
                log.warning("forward_refused", reason="no peer secret to vouch for the caller")
                raise exc
            headers.update(self.peers.sign_request(request.method, target, user, body))
        try:
            answer = self.http.request(request.method, exc.leader_url.rstrip("/") + target,
                                       content=body or None, headers=headers)
        except httpx.HTTPError as failure:
            log.warning("forward_failed", leader=exc.leader_url, error=str(failure))
            raise exc from None
        position = answer.headers.get(POSITION_HEADER, "")
        if answer.status_code == 200 and position.isdigit():
            self.registry.store.wait_position(int(position), timeout_s=10)
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type", CONTENT_TYPE))

    def health(self) -> dict[str, Any]:
        election = self.registry.election
        lease = election.current()
        state = self.registry.state
        return {
            "status": "ok" if self.ready else "starting",
            "ready": self.ready,
            "leader": election.is_leader(),
            "leader_url": lease.url if lease else None,
            "topic": self.registry.store.topic,
            "log_position": self.registry.store.position,
            "schemas": len(state.schemas),
            "subjects": len(state.subjects),
            "skipped_records": state.skipped,
        }


def create_app(api: Api, on_startup: Callable[[], None], on_shutdown: Callable[[], None]) -> Starlette:
    """One catch-all route: the Api does its own raw-path routing (see the module docstring)."""
    from contextlib import asynccontextmanager
    from collections.abc import AsyncIterator

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # uvicorn binds the port only after this returns: the port opens once we have caught up
        await run_in_threadpool(on_startup)
        api.ready = True
        try:
            yield
        finally:
            await run_in_threadpool(on_shutdown)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return _json({"error_code": 500, "message": "Internal Server Error"}, 500)

    return Starlette(
        routes=[Route("/{path:path}", api.__call__, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])],
        lifespan=lifespan,
        exception_handlers={Exception: internal_error, 500: internal_error},
    )
