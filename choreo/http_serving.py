"""Serving HTTP under uvicorn within bounds that a client cannot stretch.

uvicorn bounds idle keep-alive between two requests (``timeout_keep_alive``) and the
connections it serves (``limit_concurrency``, past which every request is answered 503),
and nothing else: a connection that sends nothing, or sends its head a byte at a time, is
kept for ever, so a few thousand of them shut every real client out. Its httptools
protocol (h11 costs a third of ingestion's CPU, bench/README.md) keeps a head of any size
too. ``GuardedHttpProtocol`` adds what is missing, for both HTTP servers of the project:

* a new connection gets uvicorn's keep-alive bound as well (uvicorn arms it only after a
  response);
* a request's head must arrive within ``head_timeout_s`` of its first byte and its body
  within ``body_timeout_s`` of the head's end, else 408 and the connection is closed;
* a head past ``max_head_bytes`` is refused with 431 before the parser holds it, each
  request's own, also when several requests come in one read (pipelining);
* one client address holds at most ``max_connections_per_ip`` connections (429 past it);
* after a 408 or 431 the connection lingers (``linger_s``, ``linger_bytes``): the input the
  client still sends is read and dropped, so the close is not a reset that destroys the
  answer before the client reads it;
* an answer must drain: a client that acknowledged none of the bytes waiting for it over a
  whole ``send_timeout_s`` is reset, and the kernel drops what it queued. uvicorn waits for
  ever, and a client that stops reading would hold its connection, its slot and the
  buffered answer. Both the bytes acknowledged and the bytes waiting are read from the
  kernel (``send_progress_of``): a client reading a few kilobytes a second frees the kernel's
  queue of megabytes long before the transport's buffer moves, and over TLS the buffer
  uvicorn sees is not the one that holds the answer.

It lives in ``choreo`` because both servers import ``choreo`` already and neither may
import the other: the schema registry is a product of its own, ingestion its client.
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import socket
import struct
import termios
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from choreo.config import settings
from choreo.logs import get_logger

log = get_logger(component="http")

_HEAD_END = b"\r\n\r\n"

ErrorBody = Callable[[int, str, str], tuple[str, bytes]]
"""(status, code, message) -> (content type, body): a refusal in the server's own error shape."""


@dataclass(frozen=True)
class HttpLimits:
    """What one client may take of a server (SECURITY.md lists the values in force)."""

    max_head_bytes: int = 16 * 1024  # the request line and headers; h11's default bound
    head_timeout_s: float = 10.0  # from a request's first byte to the end of its head
    body_timeout_s: float = 20.0  # from the end of the head to the end of the body
    keep_alive_s: int = 5  # idle with no request under way (uvicorn's timeout_keep_alive)
    max_connections: int = 2000  # uvicorn's limit_concurrency: 503 past it
    max_connections_per_ip: int = 256
    linger_s: float = 2.0  # after a refusal, input read and dropped before the close...
    linger_bytes: int = 256 * 1024  # ...for at most this long and this much
    send_timeout_s: float = 30.0  # the longest a waiting answer may go with none of it acknowledged


@dataclass(frozen=True)
class _Guard:
    """One server's guard: its limits, its error shape, its connections per address."""

    limits: HttpLimits
    error_body: ErrorBody
    per_ip: Counter[str] = field(default_factory=Counter)


def _piece_ends(tail: bytes, data: bytes) -> list[int]:
    """Where a read is cut before the parser sees it: after every CRLFCRLF (one may start in
    ``tail``, the previous read's last bytes) and at its end. A head ends at its first
    CRLFCRLF, so each piece holds the bytes of at most one head, which is what lets
    ``GuardedHttpProtocol`` count a pipelined head before feeding it."""
    straddle = (tail + data[:3]).find(_HEAD_END)
    ends = [straddle + len(_HEAD_END) - len(tail)] if straddle >= 0 else []
    at = data.find(_HEAD_END)
    while at >= 0:
        ends.append(at + len(_HEAD_END))
        at = data.find(_HEAD_END, at + len(_HEAD_END))
    if not ends or ends[-1] != len(data):
        ends.append(len(data))
    return ends


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol held to ``limits`` (see the module docstring).

    ``guarded_protocol`` makes one subclass per server, with its own ``_Guard``."""

    guard: ClassVar[_Guard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = self.guard.limits
        self._ip: str | None = None  # set while counted against the address's cap
        self._phase = "head"  # what is being waited for: "head" or "body"
        self._deadline: float | None = None  # when that wait ends (loop time); None: no wait
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._tail = b""
        self._head_open = False  # a request's head has begun and not ended
        self._head_bytes = 0  # of the open head, fed so far
        self._body_left: int | None = None  # of a Content-Length body being received
        self._chunked = False  # a chunked body is being received
        self._refusing = False  # a head was refused: 431 once the responses under way are out
        self._linger_left: int | None = None  # answered and closing: input still to drop
        self._linger_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # the next look at what the client takes
        self._progress = SendProgress(0, 0)  # what the last look saw

    # -- connections ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_check)
        ip = client_key(self.client[0] if self.client else "")
        if self.guard.per_ip[ip] >= self.limits.max_connections_per_ip:
            log.warning("http.too_many_connections", client=ip, limit=self.limits.max_connections_per_ip)
            # closed at once, not lingering: this connection is counted against no address's
            # cap, so a client that opens them fast must not hold them
            self._answer(429, "too_many_connections",
                         f"more than {self.limits.max_connections_per_ip} connections from one address",
                         linger=False)
            return
        self.guard.per_ip[ip] += 1
        self._ip = ip
        # uvicorn arms its keep-alive bound only after a response: without this, a
        # connection that never sends a request is kept for ever
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ip is not None:
            self.guard.per_ip[self._ip] -= 1
            if not self.guard.per_ip[self._ip]:
                del self.guard.per_ip[self._ip]
            self._ip = None
        for timer in (self._timer, self._linger_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    # -- writing -------------------------------------------------------------------------

    def _send_check(self) -> None:
        """Reset when bytes waited for the client since the last look and it acknowledged
        none of them; look again in ``send_timeout_s``."""
        now = send_progress_of(self.transport)
        if now is not None:
            if now.waiting and self._progress.waiting and now.acknowledged == self._progress.acknowledged:
                log.info("http.send_timeout", client=self._ip, waiting=now.waiting)
                _reset(self.transport)
                return
            self._progress = now
        self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._send_check)

    # -- reading -------------------------------------------------------------------------

    @property
    def _closing(self) -> bool:
        """Closed, or answered and closing (``_close_lingering``)."""
        return self.transport.is_closing() or self._linger_left is not None

    @property
    def _body_open(self) -> bool:
        return self._chunked or self._body_left is not None

    def data_received(self, data: bytes) -> None:
        if self._linger_left is not None:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.transport.abort()
            return
        if self._ip is None or self._refusing:
            return  # refused: nothing more is parsed
        if self._deadline is None and not self._body_open:
            self._arm("head", self.limits.head_timeout_s)
        start = 0
        for end in _piece_ends(self._tail, data):
            part = self._head_part(end - start)
            if self._head_bytes + part > self.limits.max_head_bytes:
                self._refuse_head()
                return
            super().data_received(data[start:end])
            if self._closing:
                return
            if self._head_open:
                self._head_bytes += part
            start = end
        self._tail = (self._tail + data[-3:])[-3:]

    def _head_part(self, size: int) -> int:
        """How many of the next ``size`` bytes (one piece) can belong to a head: all of them,
        but for the rest of a body that comes first. A chunked body ends with CRLFCRLF,
        so no head can follow it within a piece."""
        if self._head_open:
            return size
        if self._chunked:
            return 0
        if self._body_left is not None:
            return max(0, size - self._body_left)
        return size

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True
        if self._deadline is None:
            self._arm("head", self.limits.head_timeout_s)

    def on_headers_complete(self) -> None:
        self._head_open, self._head_bytes = False, 0
        headers = dict(self.headers)
        self._chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        length = headers.get(b"content-length", b"").strip().lstrip(b"0")  # 5,000 zeros are past int()'s digits
        self._body_left = int(length) if length.isdigit() and not self._chunked else None
        super().on_headers_complete()
        if self._body_open and not self.pipeline:
            self._arm("body", self.limits.body_timeout_s)
        else:  # no body, or queued behind a response under way (reading is paused meanwhile)
            self._disarm()

    def on_body(self, body: bytes) -> None:
        if self._body_left is not None:
            self._body_left -= len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_left, self._chunked = None, False
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._closing:
            return
        if self._refusing and self._idle():
            self._answer(431, "headers_too_large",
                         f"the request's head is larger than {self.limits.max_head_bytes} bytes")
        elif self._body_open and self._deadline is None and not self.pipeline:
            self._arm("body", self.limits.body_timeout_s)  # a queued request's turn has come

    # -- refusing ------------------------------------------------------------------------

    def _idle(self) -> bool:
        """No response is under way or queued on this connection."""
        return (self.cycle is None or self.cycle.response_complete) and not self.pipeline

    def _refuse_head(self) -> None:
        """431 and close; after the responses under way when requests were pipelined."""
        log.warning("http.head_too_large", client=self._ip, limit=self.limits.max_head_bytes)
        self._refusing = True
        self._disarm()
        self.flow.pause_reading()
        if self._idle():
            self._answer(431, "headers_too_large",
                         f"the request's head is larger than {self.limits.max_head_bytes} bytes")

    def _arm(self, phase: str, seconds: float) -> None:
        """Start waiting for ``phase``. The timer is lazy: one already pending that fires no
        later stays and re-arms itself when it fires early, so a request on a kept-alive
        connection costs no timer of its own."""
        self._phase, self._deadline = phase, self.loop.time() + seconds
        if self._timer is None or self._timer_at > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = self.loop.call_at(self._deadline, self._tick), self._deadline

    def _disarm(self) -> None:
        self._deadline = None

    def _tick(self) -> None:
        self._timer = None
        if self._deadline is None:
            return
        if self.loop.time() < self._deadline:
            self._timer, self._timer_at = self.loop.call_at(self._deadline, self._tick), self._deadline
            return
        self._deadline = None
        self._expire(self._phase)

    def _expire(self, phase: str) -> None:
        """The head or body took too long: 408 where no response is under way, else close."""
        if self._closing:
            return
        log.info("http.request_timeout", phase=phase, client=self._ip)
        cycle = self.cycle
        message = f"the request's {phase} did not arrive in time"
        if phase == "body" and cycle is not None and not cycle.response_started:
            # what uvicorn does when a client leaves: the handler's receive() gets
            # http.disconnect and whatever it sends afterwards is dropped
            cycle.disconnected = True
            cycle.waiting_for_100_continue = False  # nothing may be written after the answer
            cycle.message_event.set()
            self._answer(408, "request_timeout", message)
        elif phase == "head" and self._head_open and self._idle():
            self._answer(408, "request_timeout", message)
        else:
            self.transport.close()

    def _answer(self, status: int, code: str, message: str, linger: bool = True) -> None:
        content_type, body = self.guard.error_body(status, code, message)
        self.transport.write(b"".join([
            STATUS_LINE[status], b"content-type: ", content_type.encode(), b"\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body]))
        if linger:
            self._close_lingering()
        else:
            self.transport.close()

    def _close_lingering(self) -> None:
        """Close after an answer without losing it. Closing a socket with input unread
        makes the kernel reset the connection, and a reset can discard the answer in the
        client's buffer before the client reads it: a refused head usually leaves input
        unread. So the write side is shut (the client sees the end after the answer) and
        input is read and dropped, within ``linger_s`` and ``linger_bytes``, until the
        client closes too (asyncio then closes the transport) or a bound is reached."""
        if self._closing:
            return
        half_closed = self.transport.can_write_eof()  # not over TLS
        if half_closed:
            self.transport.write_eof()
        self._linger_left = self.limits.linger_bytes
        self._disarm()
        self._unset_keepalive_if_required()  # the linger's bounds are the only ones left
        self.flow.resume_reading()
        # once half-closed, abort rather than close: a close waits for a client that reads
        # nothing to take the answer; over TLS a close still says so (close_notify)
        end = self.transport.abort if half_closed else self.transport.close
        self._linger_timer = self.loop.call_later(self.limits.linger_s, end)


def guarded_protocol(limits: HttpLimits, error_body: ErrorBody) -> type[GuardedHttpProtocol]:
    """The protocol class of one server (its own per-address count)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": _Guard(limits, error_body)})


def tls_options() -> dict[str, str]:
    """uvicorn's ``ssl_certfile``/``ssl_keyfile`` from ``CHOREO_HTTP_TLS_CERT_FILE`` and
    ``CHOREO_HTTP_TLS_KEY_FILE``: with them the server speaks HTTPS only, so a secured
    deployment switches every HTTP server by environment, like its Kafka clients. One without
    the other is refused at start rather than silently serving plain HTTP."""
    cfg = settings()
    cert, key = cfg.http_tls_cert_file, cfg.http_tls_key_file
    if cert is None and key is None:
        return {}
    if cert is None or key is None:
        raise ValueError("set both CHOREO_HTTP_TLS_CERT_FILE and CHOREO_HTTP_TLS_KEY_FILE, or neither")
    return {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}


def uvicorn_config(app: Any, host: str, port: int, limits: HttpLimits, error_body: ErrorBody,
                   **options: Any) -> uvicorn.Config:
    """uvicorn's configuration held to ``limits``: uvicorn's own settings where it has them
    (keep-alive, connection limit), the guarded protocol for the rest, on uvloop, no
    websockets (neither server speaks them), and TLS when configured (``tls_options``). A
    client is its peer's address: uvicorn would take it from ``X-Forwarded-For`` when the
    peer is loopback, and a local client could then be any number of clients to the
    per-client bounds (event streams, Kafka lookups)."""
    return uvicorn.Config(app, host=host, port=port, http=guarded_protocol(limits, error_body),
                          loop="uvloop", ws="none", timeout_keep_alive=limits.keep_alive_s,
                          limit_concurrency=limits.max_connections, proxy_headers=False,
                          **{**tls_options(), **options})


@dataclass(frozen=True)
class SendProgress:
    """How far a connection's client has taken what it was sent."""

    acknowledged: int  # bytes the client acknowledged since the connection began
    waiting: int  # bytes sent or buffered that it has not


_BYTES_ACKED_AT = 120  # of tcpi_bytes_acked (a u64) in Linux's struct tcp_info (since 4.1)


def send_progress_of(transport: asyncio.BaseTransport) -> SendProgress | None:
    """The kernel's count of the bytes the client acknowledged (``TCP_INFO``) and of those
    waiting for it (``SIOCOUTQ``, which Linux answers for a TCP socket under ``TIOCOUTQ``'s
    number), plus the transport's buffer; None where the kernel does not tell (not Linux,
    not TCP, the socket gone)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return None
    if len(info) < _BYTES_ACKED_AT + 8:
        return None
    buffered: int = transport.get_write_buffer_size()  # type: ignore[attr-defined]
    return SendProgress(struct.unpack_from("Q", info, _BYTES_ACKED_AT)[0], queued + buffered)


def _reset(transport: asyncio.BaseTransport) -> None:
    """Abort with a reset (``SO_LINGER`` 0): the kernel drops what it queued for the client
    at once, where a plain close keeps it, megabytes a connection, until its retries end."""
    sock = transport.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # gone already: the abort below is all there is to do
    transport.abort()  # type: ignore[attr-defined]


def client_key(address: str) -> str:
    """Who a peer's address counts as, for the per-client bounds: an IPv4 address, or an
    IPv6 address's /64 (one host is usually given a whole /64, and would be thousands of
    clients by its addresses)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (a name other than ``localhost``
    is not trusted to be): what every server of the project binds without a guard."""
    name = host.strip().strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
