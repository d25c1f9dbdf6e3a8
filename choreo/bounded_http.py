"""An HTTP client whose requests each end within a total time, and reach only public
addresses unless told otherwise.

httpx's timeouts bound each connect, read and write, not a request: a server that answers
``100 Continue`` every second (httpcore reads any number of informational answers), or sends
its answer's head a byte at a time, holds a request for ever, each read restarting the
clock. Here every connect, read and write is given at most what is left of its request's
time (``within``), so the request ends with a timeout when its time is spent.

A host name is resolved here and the connection made to an address checked to be public
(``ipaddress``'s ``is_global``), unless the request is made ``within(..., internal=True)``:
whoever controls the name's DNS could otherwise point it, between two requests too, at a
loopback, private or link-local address (a cloud's metadata service).
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_deadline: ContextVar[float] = ContextVar("request_deadline", default=math.inf)
_internal: ContextVar[bool] = ContextVar("request_may_reach_internal_addresses", default=False)


@contextmanager
def within(seconds: float, internal: bool = False) -> Iterator[None]:
    """The requests made in the block end within ``seconds`` in all; with ``internal``, they
    may reach addresses that are not public."""
    deadline, internal_token = _deadline.set(time.monotonic() + seconds), _internal.set(internal)
    try:
        yield
    finally:
        _deadline.reset(deadline)
        _internal.reset(internal_token)


def public_addresses(host: str, port: int) -> list[str]:
    """The public addresses ``host`` resolves to, in the resolver's order; ``ConnectError``
    when there is none. The lookup is bounded by the request's time (a resolver has no
    timeout of its own: a name server that never answers held the request)."""
    lookup = _lookup(host, port)
    try:
        found = lookup.result(timeout=_left(None, httpcore.ConnectTimeout))
    except FutureTimeout as exc:
        raise httpcore.ConnectTimeout(f"{host[:100]} did not resolve within the request's time") from exc
    except OSError as exc:
        raise httpcore.ConnectError(f"{host[:100]} does not resolve: {exc}") from exc
    addresses = [str(sockaddr[0]) for *_, sockaddr in found if _public(str(sockaddr[0]))]
    if not addresses:
        raise httpcore.ConnectError(f"{host[:100]} resolves to no public address; an endpoint marked internal may")
    return list(dict.fromkeys(addresses))


_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_resolver = ThreadPoolExecutor(max_workers=8, thread_name_prefix="resolve")
_lookups: dict[tuple[str, int], Future[list[Any]]] = {}  # under way, one per name
_lookups_lock = threading.RLock()  # a lookup done at once forgets itself while it is held


def _lookup(host: str, port: int) -> Future[list[Any]]:
    """The lookup of ``host`` under way, else a new one. A lookup that outlives its request
    cannot be stopped (``getaddrinfo`` holds its thread): each try of an owner whose name
    server never answers would take another of the pool's threads, and other owners' names
    would wait behind them. Shared, a name holds one thread however often it is tried."""
    with _lookups_lock:
        running = _lookups.get((host, port))
        if running is None:
            running = _lookups[(host, port)] = _resolver.submit(socket.getaddrinfo, host, port,
                                                                type=socket.SOCK_STREAM)
            running.add_done_callback(lambda _: _forget(host, port))
        return running


def _forget(host: str, port: int) -> None:
    with _lookups_lock:
        _lookups.pop((host, port), None)


def _public(address: str) -> bool:
    """Whether ``address`` is public, and so is any IPv4 address inside it (IPv4-mapped,
    6to4, Teredo, NAT64: each reaches that IPv4 address)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    inner: list[ipaddress.IPv4Address] = []
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [a for a in (ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None) if a is not None]
        if ip in _NAT64:
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF))
    return all(a.is_global and not a.is_multicast for a in (ip, *inner))


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    """``timeout`` cut to what is left of the request's time (none outside ``within``)."""
    deadline = _deadline.get()
    if deadline == math.inf:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the request's time is spent")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        failed: Exception | None = None
        for address in [host] if _internal.get() else public_addresses(host, port):
            try:  # each checked address in turn, as a connect to the name tries each of its own
                return _Stream(self._backend.connect_tcp(address, port, _left(timeout, httpcore.ConnectTimeout),
                                                         local_address, socket_options))
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failed = exc
        assert failed is not None
        raise failed

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        if not _internal.get():
            raise httpcore.ConnectError("a unix socket is no public address")
        return _Stream(self._backend.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                         socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def bounded_client(timeout: httpx.Timeout) -> httpx.Client:
    """An ``httpx.Client`` (no redirects, no proxy or settings from the environment) whose
    requests made ``within`` a time end within it, and reach public addresses only unless
    made ``within(..., internal=True)``."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx takes no network backend: its pool is the one place one goes in
    transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                              network_backend=_Backend(),
                                              max_connections=100, max_keepalive_connections=20,
                                              keepalive_expiry=5.0)
    return httpx.Client(transport=transport, timeout=timeout, follow_redirects=False, trust_env=False)
