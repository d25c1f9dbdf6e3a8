"""Which addresses a request may reach when it is not marked internal, and the request's
time bounding its name's lookup (the resolver is replaced: no DNS is asked)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpcore
import pytest

from choreo.bounded_http import public_addresses, within


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.10", "169.254.169.254", "100.64.0.1",
                                  "0.0.0.0", "fe80::1", "fd00::1", "224.0.0.1", "ff02::1",
                                  "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1",
                                  "2001:0:4136:e378:8000:63bf:f5ff:fffe"])
def test_a_loopback_private_link_local_or_multicast_address_is_refused(host: str) -> None:
    """Directly, or inside an IPv6 address that reaches it (mapped, NAT64, 6to4, Teredo)."""
    with pytest.raises(httpcore.ConnectError, match="no public address"):
        public_addresses(host, 443)


def test_a_public_address_is_reached() -> None:
    assert public_addresses("8.8.8.8", 443) == ["8.8.8.8"]
    assert public_addresses("2001:4860:4860::8888", 443) == ["2001:4860:4860::8888"]


def _answers(*addresses: str) -> Any:
    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in addresses]
    return getaddrinfo


def test_a_name_that_resolves_to_public_and_private_addresses_reaches_only_the_public_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getaddrinfo", _answers("10.0.0.5", "203.0.113.9", "8.8.4.4", "::1", "8.8.4.4"))
    assert public_addresses("hooks.example", 443) == ["8.8.4.4"]  # 203.0.113.0/24 is documentation's


def test_a_name_server_that_does_not_answer_ends_the_request_in_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def silent(*args: Any, **kwargs: Any) -> list[Any]:
        time.sleep(2)
        return []

    monkeypatch.setattr(socket, "getaddrinfo", silent)
    started = time.monotonic()
    with within(0.3), pytest.raises(httpcore.ConnectTimeout, match="did not resolve"):
        public_addresses("hooks.example", 443)
    assert time.monotonic() - started < 1.0


def test_a_name_that_never_resolves_holds_one_lookup_thread_however_often_it_is_tried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup cannot be stopped once it outlived its request: an owner's name server that
    never answers took a thread of the pool at each try, and the next owner's name waited
    behind them until its own try timed out."""
    answer = _answers("8.8.4.4")
    release = threading.Event()

    def resolver(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        if host == "stuck.example":
            release.wait(10)
            return []
        return answer(host, port)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    try:
        for _ in range(12):
            with within(0.05), pytest.raises(httpcore.ConnectTimeout):
                public_addresses("stuck.example", 443)
        with within(1.0):
            assert public_addresses("other.example", 443) == ["8.8.4.4"]
    finally:
        release.set()
