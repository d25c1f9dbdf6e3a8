"""Bearer tokens, as the operator configures them and as a request presents them.

Ingestion's owner tokens and the web view's operator tokens are one format and one check:
``<token>=<holder>`` entries separated by new lines or commas (``#`` starts a comment line),
or a JSON object of token to holder; a token is an RFC 6750 b64token of 16 to 512
characters. Errors name the entry's number, never the token. Only the tokens' digests are
held, and a lookup compares them all, so its time does not tell which one matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping

TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9._~+/-]{16,512}=*$")  # RFC 6750 b64token, >= 16 chars


def parse_tokens(text: str, holder: str, holder_pattern: re.Pattern[str]) -> dict[str, str]:
    """{token: holder} of ``text``; ``holder`` names what a token stands for in errors
    ("owner", "operator"), ``holder_pattern`` what a holder's name may be."""
    text = text.strip()
    if text.startswith("{"):
        loaded = json.loads(text)
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()):
            raise ValueError(f"{holder} tokens JSON must map token strings to {holder} strings")
        entries = list(enumerate(loaded.items(), 1))
    else:
        entries = []
        for number, raw in enumerate(text.replace(",", "\n").splitlines(), 1):
            entry = raw.strip()
            if entry and not entry.startswith("#"):
                token, sep, name = entry.rpartition("=")
                if not sep or not token:
                    raise ValueError(f"{holder} token entry {number}: expected <token>=<{holder}>")
                entries.append((number, (token.strip(), name.strip())))
    tokens: dict[str, str] = {}
    for number, (token, name) in entries:
        if not TOKEN_PATTERN.fullmatch(token):
            raise ValueError(f"{holder} token entry {number}: a token is 16-512 characters of "
                             "A-Z a-z 0-9 . _ ~ + / - (then optional '=')")
        if not holder_pattern.fullmatch(name):
            raise ValueError(f"{holder} token entry {number}: invalid {holder}")
        tokens[token] = name
    return tokens


class BearerTokens:
    """Token → holder, held as digests."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._digests = [(hashlib.sha256(t.encode()).digest(), name) for t, name in tokens.items()]

    def holder(self, token: str | None) -> str | None:
        """The holder of ``token``, or None."""
        if not token or not token.strip():
            return None
        presented = hashlib.sha256(token.strip().encode()).digest()
        found: str | None = None
        for digest, name in self._digests:  # no early exit: the time does not tell which
            if hmac.compare_digest(digest, presented):
                found = name
        return found

    def bearer(self, authorization: str | None) -> str | None:
        """The holder of an ``Authorization: Bearer <token>`` header, or None (no header,
        another scheme, an unknown token)."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        return self.holder(token) if scheme.lower() == "bearer" else None
