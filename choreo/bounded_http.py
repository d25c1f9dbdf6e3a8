"""An HTTP client whose requests each end within a total time.

httpx's timeouts bound each connect, read and write, not a request: a server that answers
``100 Continue`` every second (httpcore reads any number of informational answers), or sends
its answer's head a byte at a time, holds a request for ever, each read restarting the
clock. Here every connect, read and write is given at most what is left of its request's
time (``within``), so the request ends with a timeout when its time is spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_deadline: ContextVar[float] = ContextVar("request_deadline", default=math.inf)


@contextmanager
def within(seconds: float) -> Iterator[None]:
    """The requests made in the block end within ``seconds`` in all."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def _left(timeout: float | None, error: type[Exception]) -> float:
    left = _deadline.get() - time.monotonic()
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
        return _Stream(self._backend.connect_tcp(host, port, _left(timeout, httpcore.ConnectTimeout), local_address,
                                                 socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._backend.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout),
                                                         socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def bounded_client(timeout: httpx.Timeout) -> httpx.Client:
    """An ``httpx.Client`` (no redirects, no proxy or settings from the environment) whose
    requests made ``within`` a time end within it."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx takes no network backend: its pool is the one place one goes in
    transport._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), network_backend=_Backend(),
                                              max_connections=100, max_keepalive_connections=20,
                                              keepalive_expiry=5.0)
    return httpx.Client(transport=transport, timeout=timeout, follow_redirects=False, trust_env=False)
