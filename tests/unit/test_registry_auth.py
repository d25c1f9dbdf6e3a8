"""The registry's roles, and the signatures its instances trust each other by."""

from __future__ import annotations

import time

import pytest

from registry.auth import (
    PRINCIPAL_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, BasicAuth, Grant, Peers, parse_roles,
)

SECRET = b"s" * 40


def test_roles_parse_from_lines_or_semicolons() -> None:
    grants = parse_roles("admin admin\n# the deploy job\ndeployer write delivery.* pkg-value; package read")
    assert grants == {"admin": Grant("admin"), "deployer": Grant("write", ("delivery.*", "pkg-value")),
                      "package": Grant("read")}
    for bad in ("admin", "x owner", "x write", "x read delivery.*", "x admin y"):
        with pytest.raises(ValueError):
            parse_roles(bad)


def test_what_each_role_allows() -> None:
    writer = Grant("write", ("delivery.*", "pkg-value"))
    assert writer.allows("read", None) and writer.allows("write", "delivery.requested-value")
    assert writer.allows("write", "pkg-value") and not writer.allows("write", "pkg-value2")
    assert not writer.allows("write", "drone.scheduled-value") and not writer.allows("admin", "pkg-value")
    assert not Grant("read").allows("write", "pkg-value") and not Grant("read").allows("admin", None)
    assert Grant("admin").allows("admin", None) and Grant("admin").allows("write", "anything")


def test_without_roles_every_login_is_an_admin_and_with_them_the_unnamed_read() -> None:
    assert BasicAuth({"a": "p"}).grant("a") == Grant("admin")
    auth = BasicAuth({"a": "p", "b": "q"}, roles={"a": Grant("admin")})
    assert auth.grant("a") == Grant("admin") and auth.grant("b") == Grant("read")
    with pytest.raises(ValueError):
        BasicAuth({"a": "p"}, roles={"ghost": Grant("admin")})


def test_a_lease_verifies_only_with_the_secret_it_was_signed_with() -> None:
    peers = Peers(SECRET)
    signature = peers.sign_lease("i-1", "http://10.0.0.1:8081")
    assert peers.lease_ok("i-1", "http://10.0.0.1:8081", signature)
    assert not peers.lease_ok("i-1", "http://evil:8081", signature)
    assert not peers.lease_ok("i-1", "http://10.0.0.1:8081", "")
    assert not peers.lease_ok("i-1", "http://10.0.0.1:8081", "\u00e9" * 64)  # refused, not a TypeError
    assert not Peers(b"t" * 40).lease_ok("i-1", "http://10.0.0.1:8081", signature)
    with pytest.raises(ValueError):
        Peers(b"short")


def test_a_forwarded_request_verifies_only_as_it_was_signed_and_while_recent() -> None:
    peers = Peers(SECRET)
    headers = peers.sign_request("POST", "/subjects/a-value/versions", "admin", b'{"schema": "x"}')
    assert peers.verify_request(headers, "POST", "/subjects/a-value/versions", b'{"schema": "x"}') == "admin"
    assert peers.verify_request(headers, "DELETE", "/subjects/a-value/versions", b'{"schema": "x"}') is None
    assert peers.verify_request(headers, "POST", "/subjects/b-value/versions", b'{"schema": "x"}') is None
    assert peers.verify_request(headers, "POST", "/subjects/a-value/versions", b'{"schema": "y"}') is None
    assert peers.verify_request({**headers, PRINCIPAL_HEADER: "other"}, "POST",
                                "/subjects/a-value/versions", b'{"schema": "x"}') is None
    assert Peers(b"t" * 40).verify_request(headers, "POST", "/subjects/a-value/versions", b'{"schema": "x"}') is None
    old = str(int(time.time()) - 120)
    stale = {**headers, TIMESTAMP_HEADER: old,
             SIGNATURE_HEADER: peers._request_mac("POST", "/subjects/a-value/versions", "admin", b'{"schema": "x"}', old)}
    assert peers.verify_request(stale, "POST", "/subjects/a-value/versions", b'{"schema": "x"}') is None
    for stamp in ("\u00b2", "1" + "0" * 400):  # a digit to isdigit that int() refuses; past any time
        assert peers.verify_request({**headers, TIMESTAMP_HEADER: stamp}, "POST", "/subjects/a-value/versions",
                                    b'{"schema": "x"}') is None
    assert peers.verify_request({**headers, SIGNATURE_HEADER: "\u00e9"}, "POST", "/subjects/a-value/versions",
                                b'{"schema": "x"}') is None
