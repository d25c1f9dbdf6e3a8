"""Who may call the registry, what each login may do, and how instances trust each other.

Authentication is HTTP basic (``BasicAuth``): a known user with its password, compared in
constant time. Authorization is one role per login (``Grant``):

* ``read``: every lookup (schemas, subjects, versions, config, mode, compatibility checks);
* ``write``: ``read``, and registering versions under the subjects it names (an exact name,
  or a prefix ending in ``*``);
* ``admin``: everything, including deletes and changes of compatibility and mode.

Roles come as entries ``user role [subject ...]`` (``parse_roles``). Without any role entry
every authenticated login is an admin (a registry that only authenticates); with roles, a
login that has none is a reader.

Instances forward writes to the leader. A follower never passes the caller's password on:
it authenticates and authorizes the caller itself, then asserts the caller's name to the
leader in a request signed with the instances' shared secret (``Peers``); the leader checks
the signature and authorizes that name again. The leader's lease in Redis carries an HMAC
of the instance id and URL under the same secret, so a lease planted by anyone who can
write Redis but does not hold the secret is never followed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Access = Literal["read", "write", "admin"]
ROLES: tuple[Access, ...] = ("read", "write", "admin")

PRINCIPAL_HEADER = "x-registry-principal"
TIMESTAMP_HEADER = "x-registry-timestamp"
SIGNATURE_HEADER = "x-registry-signature"
MIN_PEER_SECRET = 32  # characters of the shared secret, at least


@dataclass(frozen=True)
class Grant:
    """One login's role, and for ``write`` the subject patterns it may register under."""

    role: Access
    subjects: tuple[str, ...] = ()

    def allows(self, access: Access, subject: str | None) -> bool:
        if self.role == "admin" or access == "read":
            return True
        if access == "write" and self.role == "write" and subject is not None:
            return any(subject.startswith(p[:-1]) if p.endswith("*") else subject == p
                       for p in self.subjects)
        return False


ADMIN = Grant("admin")
READER = Grant("read")


def parse_roles(text: str) -> dict[str, Grant]:
    """Entries ``user role [subject ...]`` separated by new lines or ``;`` (``#`` starts a
    comment), e.g. ``admin admin; deployer write delivery.* package.ready-value; package read``."""
    grants: dict[str, Grant] = {}
    for raw in text.replace(";", "\n").splitlines():
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) < 2 or words[1] not in ROLES:
            raise ValueError(f"a registry role entry must look like 'user read|write|admin [subject ...]': {raw.strip()!r}")
        user, role, subjects = words[0], words[1], tuple(words[2:])
        if role == "write" and not subjects:
            raise ValueError(f"the write role of {user!r} names no subject")
        if role != "write" and subjects:
            raise ValueError(f"only the write role names subjects ({user!r} is {role})")
        grants[user] = Grant(role, subjects)
    return grants


def parse_users(text: str) -> dict[str, str]:
    """``user:password`` entries separated by commas or new lines (``#`` starts a comment)."""
    users: dict[str, str] = {}
    for raw in text.replace(",", "\n").splitlines():
        entry = raw.strip()
        if not entry or entry.startswith("#"):
            continue
        user, sep, password = entry.partition(":")
        if not sep or not user.strip() or not password.strip():
            raise ValueError("a registry user entry must look like user:password")
        users[user.strip()] = password.strip()
    return users


@dataclass(frozen=True)
class BasicAuth:
    """Users allowed to call protected endpoints (``{username: password}``) and their roles
    (None: every user is an admin)."""

    users: Mapping[str, str]
    protect_reads: bool = False
    roles: Mapping[str, Grant] | None = None
    realm: str = "schema-registry"

    def __post_init__(self) -> None:
        if not self.users or any(not u or ":" in u or not pw for u, pw in self.users.items()):
            raise ValueError("basic auth needs at least one user; names without ':' and non-empty passwords")
        unknown = sorted(set(self.roles or {}) - set(self.users))
        if unknown:
            raise ValueError(f"registry roles name users without a login: {', '.join(unknown)}")

    def required(self, access: Access) -> bool:
        return access != "read" or self.protect_reads

    def grant(self, user: str) -> Grant:
        if self.roles is None:
            return ADMIN
        return self.roles.get(user, READER)

    def check(self, header: str | None) -> str | None:
        """The authenticated user, or None. Every known user is compared (constant time)."""
        if not header:
            return None
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        user, sep, password = decoded.partition(":")
        if not sep:
            return None
        found: str | None = None
        for name, secret in self.users.items():
            same_user = hmac.compare_digest(name.encode(), user.encode())
            same_password = hmac.compare_digest(secret.encode(), password.encode())
            if same_user and same_password:
                found = name
        return found


@dataclass(frozen=True)
class Peers:
    """The secret the registry's instances share: signs their leases and forwarded writes."""

    secret: bytes
    max_skew_s: float = 30.0

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_PEER_SECRET:
            raise ValueError(f"the registry's peer secret needs at least {MIN_PEER_SECRET} characters")

    @classmethod
    def from_file(cls, path: Path) -> Peers:
        return cls(path.read_text().strip().encode())

    def _mac(self, *parts: str) -> str:
        return hmac.new(self.secret, "\n".join(parts).encode(), hashlib.sha256).hexdigest()

    def sign_lease(self, instance_id: str, url: str) -> str:
        return self._mac("lease", instance_id, url)

    def lease_ok(self, instance_id: str, url: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign_lease(instance_id, url).encode(), signature.encode(errors="replace"))

    def _request_mac(self, method: str, target: str, user: str, body: bytes, stamp: str) -> str:
        return self._mac("request", method.upper(), target, user, stamp, hashlib.sha256(body).hexdigest())

    def sign_request(self, method: str, target: str, user: str, body: bytes) -> dict[str, str]:
        """Headers asserting that ``user`` made this exact request (method, path and query, body)."""
        stamp = str(int(time.time()))
        return {PRINCIPAL_HEADER: user, TIMESTAMP_HEADER: stamp,
                SIGNATURE_HEADER: self._request_mac(method, target, user, body, stamp)}

    def verify_request(self, headers: Mapping[str, str], method: str, target: str, body: bytes) -> str | None:
        """The user a peer asserts, when the signature holds and is recent; else None."""
        user = headers.get(PRINCIPAL_HEADER)
        stamp = headers.get(TIMESTAMP_HEADER, "")
        signature = headers.get(SIGNATURE_HEADER, "")
        if (user is None or not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 12
                or abs(time.time() - int(stamp)) > self.max_skew_s):
            return None
        expected = self._request_mac(method, target, user, body, stamp)
        return user if hmac.compare_digest(expected.encode(), signature.encode(errors="replace")) else None
