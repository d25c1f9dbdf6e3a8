"""The live view's rules that need no stack: operator tokens and sessions, and the flow's
layout from the real workflow's declarations (the page itself is tested in a browser,
tests/integration/test_web_view.py)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from choreo.ops.flowdoc import flow_edges
from choreo.http_serving import client_key, loopback
from choreo.ops.web.auth import OperatorTokens, Sessions, host_is_loopback, parse_tokens, same_origin
from choreo.ops.web.graph import layout
from consumers.workflow import WORKFLOW

TOKEN = "a-token-of-twenty-chars"


def _request(**headers: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/",
                    "headers": [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]})


def test_tokens_name_operators_and_errors_never_quote_a_token() -> None:
    assert parse_tokens(f"# ops\n{TOKEN}=alice, {TOKEN}x=bob\n") == {TOKEN: "alice", TOKEN + "x": "bob"}
    with pytest.raises(ValueError) as short:
        parse_tokens("too-short=alice")
    assert "too-short" not in str(short.value)
    with pytest.raises(ValueError, match="entry 1: invalid operator"):
        parse_tokens(f"{TOKEN}=<script>")
    tokens = OperatorTokens({TOKEN: "alice"})
    assert tokens.bearer(f"Bearer {TOKEN}") == "alice"
    assert tokens.bearer(f"Basic {TOKEN}") is None and tokens.bearer(None) is None
    assert tokens.holder(TOKEN + "x") is None


def test_sessions_expire_are_bounded_and_sign_their_csrf_token() -> None:
    sessions = Sessions(ttl_s=3600, capacity=2)
    first, second, third = (sessions.open(name) for name in ("a", "b", "c"))
    assert sessions.operator(first) is None  # the oldest went first
    assert (sessions.operator(second), sessions.operator(third)) == ("b", "c")
    assert sessions.csrf_ok(second, sessions.csrf(second))
    assert not sessions.csrf_ok(second, sessions.csrf(third)) and not sessions.csrf_ok(second, None)
    sessions.close(second)
    assert sessions.operator(second) is None
    expired = Sessions(ttl_s=-1)
    assert expired.operator(expired.open("a")) is None


def test_loopback_and_same_origin() -> None:
    assert all(loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.9.9.9"))
    assert not any(loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.com", ""))
    assert same_origin(_request(host="127.0.0.1:8090", origin="http://127.0.0.1:8090", sec_fetch_site="same-origin"))
    assert same_origin(_request(host="127.0.0.1:8090"))  # a script: no browser headers
    assert not same_origin(_request(host="127.0.0.1:8090", origin="https://elsewhere.example"))
    assert not same_origin(_request(host="127.0.0.1:8090", sec_fetch_site="cross-site"))
    assert not same_origin(_request(host="127.0.0.1:8090", origin="null"))
    # what no URL parser reads is no origin and no host: refused, not a 500
    assert not same_origin(_request(host="127.0.0.1:8090", origin="http://[x"))
    assert not host_is_loopback(_request(host="[::1"))
    assert host_is_loopback(_request(host="[::1]:8090"))


def test_a_client_is_its_ipv4_address_or_its_ipv6_64() -> None:
    """A host given a /64 would be thousands of clients to the per-client bounds by its addresses."""
    assert client_key("203.0.113.7") == "203.0.113.7"
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert client_key("fe80::1%eth0") == "fe80::/64" and client_key("") == ""


def test_a_csrf_token_of_any_characters_is_refused_not_an_error() -> None:
    sessions = Sessions(ttl_s=3600)
    session = sessions.open("a")
    assert not sessions.csrf_ok(session, "é" * 64)


def test_the_flow_is_laid_out_from_the_declarations() -> None:
    drawn = layout(flow_edges(WORKFLOW))
    assert all(a.source in drawn.nodes and a.target in drawn.nodes for a in drawn.arrows)
    assert not any(n.name.startswith("retry.") for n in drawn.nodes.values())  # requeues are folded
    requeues = {a.target for a in drawn.arrows if a.kind == "requeue"}
    assert requeues == {"s:package", "s:drone-scheduler", "s:delivery"}
    column = {n.name: n.column for n in drawn.nodes.values()}
    assert column["ingestion"] == 0
    assert column["ingestion"] < column["delivery.requested"] < column["package"] == column["drone-scheduler"] \
        < column["package.ready"] < column["delivery"] < column["delivery.shipped"] < column["notifier"]
    back = {(a.source, a.target) for a in drawn.arrows if a.back}
    assert ("t:undo.package", "s:package") in back  # compensation loops back below
    assert len({(n.x, n.y) for n in drawn.nodes.values()}) == len(drawn.nodes)  # no two nodes overlap
