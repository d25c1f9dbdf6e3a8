"""Who may look at the live view and who may act from it.

Operator tokens (``CHOREO_OPS_TOKENS_FILE``, or ``CHOREO_OPS_TOKENS`` with the same text):
``<token>=<operator>`` entries, one a line or separated by commas, the format and token
alphabet of ingestion's owner tokens. With tokens set every page needs one: a script sends
``Authorization: Bearer <token>``; a browser signs in once on ``/login`` and holds a
session cookie (random, ``HttpOnly``, ``SameSite=Strict``; the token itself never goes in
a cookie). Without tokens the view is read-only and served on loopback only.

A change (redrive, sign-out) is a POST that must come from the view's own origin
(``Origin`` and ``Sec-Fetch-Site`` when the browser sends them) and, when it rides on the
cookie, carry the session's CSRF token (an HMAC of the session id under a per-process key)
in ``X-CSRF-Token``: a page of another site can make the browser send the cookie, never
read the token. Tokens are held as SHA-256 digests and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.requests import Request

from choreo.http_serving import loopback
from choreo.tokens import BearerTokens
from choreo.tokens import parse_tokens as parse_bearer_tokens

OPERATOR_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
SESSION_COOKIE = "choreo_ops_session"
CSRF_HEADER = "x-csrf-token"


class WebSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", populate_by_name=True)

    tokens: str = Field("", validation_alias="CHOREO_OPS_TOKENS")
    tokens_file: Path | None = Field(None, validation_alias="CHOREO_OPS_TOKENS_FILE")
    session_ttl_s: int = Field(8 * 3600, ge=60, le=7 * 24 * 3600, validation_alias="CHOREO_OPS_SESSION_TTL_S")


def parse_tokens(text: str) -> dict[str, str]:
    """``<token>=<operator>`` entries → {token: operator} (``choreo.tokens``)."""
    return parse_bearer_tokens(text, "operator", OPERATOR_PATTERN)


class OperatorTokens(BearerTokens):
    """Bearer token → operator."""

    @classmethod
    def from_settings(cls, cfg: WebSettings) -> OperatorTokens | None:
        """None when no tokens are configured (the read-only loopback view)."""
        found = parse_tokens(cfg.tokens) | (parse_tokens(cfg.tokens_file.read_text())
                                            if cfg.tokens_file is not None else {})
        return cls(found) if found else None


class Sessions:
    """Signed-in browsers: session id → (operator, expiry), at most ``capacity`` (the oldest
    go first), so no number of sign-ins grows the process without bound."""

    def __init__(self, ttl_s: int, capacity: int = 1000) -> None:
        self.ttl_s, self.capacity = ttl_s, capacity
        self._open: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._key = secrets.token_bytes(32)

    def open(self, operator: str) -> str:
        session = secrets.token_urlsafe(32)
        self._open[session] = (operator, time.monotonic() + self.ttl_s)
        while len(self._open) > self.capacity:
            self._open.popitem(last=False)
        return session

    def operator(self, session: str | None) -> str | None:
        found = self._open.get(session or "")
        if found is None:
            return None
        if found[1] < time.monotonic():
            self._open.pop(session or "", None)
            return None
        return found[0]

    def close(self, session: str | None) -> None:
        self._open.pop(session or "", None)

    def csrf(self, session: str) -> str:
        return hmac.new(self._key, session.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: str, presented: str | None) -> bool:
        return hmac.compare_digest(self.csrf(session).encode(), (presented or "").encode(errors="replace"))


@dataclass(frozen=True)
class Visitor:
    """Who is asking: ``operator`` None means the open read-only view (no tokens set)."""

    operator: str | None
    session: str | None = None  # set when the request rides on the session cookie

    @property
    def may_act(self) -> bool:
        return self.operator is not None


def host_is_loopback(request: Request) -> bool:
    """The ``Host`` the browser asked for is a loopback name: a page whose DNS name was
    re-pointed at 127.0.0.1 (DNS rebinding) asks with its own name and is refused."""
    host = request.headers.get("host", "")
    try:
        return loopback(urlsplit(f"//{host}").hostname or "")
    except ValueError:  # "[::1": no host at all
        return False


def same_origin(request: Request) -> bool:
    """The request comes from the view's own pages (or from a script that sends no
    browser headers at all)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True
    try:
        return urlsplit(origin).netloc == request.headers.get("host", "")
    except ValueError:  # "http://[x": no origin at all
        return False
