"""What one client can take of the two HTTP servers: ingestion (as ``choreo serve`` serves
it) and the schema registry (a real process, as the stack starts it).

Every test talks raw sockets on loopback. Attackers connect from their own loopback
addresses (127.0.0.2, ...) so that the per-address cap they run into never touches the
real client on 127.0.0.1.
"""

from __future__ import annotations

import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from choreo.http_serving import HttpLimits, uvicorn_config
from tests.helpers import free_port, wait_for
from tests.ingestion import ingestion_settings, serving
from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

LIMITS = HttpLimits()
SLACK_S = 3.0  # scheduling on a busy two-core machine


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    path: str  # a GET that answers 200
    post_path: str  # a POST whose handler reads the body
    pid: int | None  # the server's own process, when it has one

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)


@contextmanager
def running(name: str, request: pytest.FixtureRequest, unique: str) -> Iterator[Server]:
    """The ingestion server (as ``choreo serve`` serves it) or a registry process."""
    if name == "ingestion":
        from choreo import topology
        from consumers.workflow import WORKFLOW

        topology.create(WORKFLOW)
        with serving(ingestion_settings(unique)) as url:
            yield Server("ingestion", url, "/healthz", "/deliveries", None)
    else:
        start: Starter = request.getfixturevalue("instances")
        proc, url = start("bounds")
        yield Server("registry", url, "/subjects", "/subjects/slow/versions", proc.pid())


@pytest.fixture(params=["ingestion", "registry"])
def server(request: pytest.FixtureRequest, stack: None, unique: str) -> Iterator[Server]:
    with running(request.param, request, unique) as one:
        yield one


@pytest.fixture()
def servers(request: pytest.FixtureRequest, stack: None, unique: str) -> Iterator[list[Server]]:
    """Both servers, for the tests that wait out a bound: they wait on both at once."""
    with running("ingestion", request, unique) as ingestion, running("registry", request, unique) as registry:
        yield [ingestion, registry]


def on_each(check: Callable[[Server], None], servers: list[Server]) -> None:
    """``check`` on every server side by side; the first failure is raised, naming its server,
    once every check has ended."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [(server, pool.submit(check, server)) for server in servers]
    for server, future in futures:
        failure = future.exception()
        if failure is not None:
            failure.add_note(f"on the {server.name} server")
            raise failure


def connect(server: Server, source: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(10)
    sock.connect(server.address)
    return sock


def real_request(server: Server) -> int:
    """A well-behaved client on 127.0.0.1: the status it gets."""
    with httpx.Client(base_url=server.url, timeout=10) as client:
        return client.get(server.path).status_code


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes, and when it closed (None: still open)."""
    started = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - started < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, ssl.SSLError):  # a reset, or one under TLS
            return data, time.monotonic() - started
        if not chunk:
            return data, time.monotonic() - started
        data += chunk
    return data, None


def closed_by_server(socks: list[socket.socket], timeout_s: float) -> int:
    """How many of ``socks`` the server closed within ``timeout_s`` (nothing is sent on them)."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout_s
    try:
        while closed < len(socks) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    data = ready.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionResetError:
                    data = b""
                if not data:
                    selector.unregister(ready)
                    closed += 1
    finally:
        selector.close()
    return closed


def trickle(sock: socket.socket, first: bytes, byte: bytes, stop: threading.Event) -> None:
    """A slow client: ``first``, then one ``byte`` a second until the server gives up on it."""
    try:
        sock.sendall(first)
        while not stop.wait(1.0):
            sock.sendall(byte)
    except OSError:
        pass


def test_idle_connections_a_slow_head_and_a_slow_body_are_cut_at_their_bounds(servers: list[Server]) -> None:
    on_each(idle_and_slow_are_cut, servers)


def idle_and_slow_are_cut(server: Server) -> None:
    idle_count = 200  # under the per-address cap: only the deadlines can end them
    stop = threading.Event()
    with ExitStack() as stack:
        idle = [stack.enter_context(connect(server, "127.0.0.2")) for _ in range(idle_count)]
        slow_head = stack.enter_context(connect(server, "127.0.0.3"))
        slow_body = stack.enter_context(connect(server, "127.0.0.3"))
        started = time.monotonic()
        slow = [
            threading.Thread(target=trickle, daemon=True, args=(
                slow_head, f"GET {server.path} HTTP/1.1\r\nHost: x\r\n".encode(), b"X-a: b\r\n", stop)),
            threading.Thread(target=trickle, daemon=True, args=(
                slow_body, f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Content-Length: 1000\r\n\r\n{".encode(), b" ", stop)),
        ]
        for thread in slow:
            thread.start()
        stack.callback(stop.set)
        assert real_request(server) == 200  # meanwhile, a real client is served

        assert closed_by_server(idle, LIMITS.keep_alive_s + SLACK_S) == idle_count, \
            f"idle connections outlived the {LIMITS.keep_alive_s} s keep-alive bound"
        head_answer, head_closed = read_until_closed(
            slow_head, LIMITS.head_timeout_s + SLACK_S - (time.monotonic() - started))
        assert head_closed is not None, f"a head sent a byte a second outlived {LIMITS.head_timeout_s} s"
        assert head_answer.startswith(b"HTTP/1.1 408 "), head_answer[:200]
        body_answer, body_closed = read_until_closed(
            slow_body, LIMITS.body_timeout_s + SLACK_S - (time.monotonic() - started))
        assert body_closed is not None, f"a body sent a byte a second outlived {LIMITS.body_timeout_s} s"
        assert body_answer.startswith(b"HTTP/1.1 408 "), body_answer[:200]
        assert real_request(server) == 200


def test_connections_past_the_per_address_cap_are_refused(server: Server) -> None:
    cap, extra = LIMITS.max_connections_per_ip, 10
    with ExitStack() as stack:
        held = [stack.enter_context(connect(server, "127.0.0.4")) for _ in range(cap)]
        refused = [stack.enter_context(connect(server, "127.0.0.4")) for _ in range(extra)]
        for sock in refused:
            answer, closed = read_until_closed(sock, SLACK_S)
            assert closed is not None, "a connection past the per-address cap was kept"
            assert answer == b"" or answer.startswith(b"HTTP/1.1 429 "), answer[:200]
        assert real_request(server) == 200  # another address is not affected
        assert closed_by_server(held[:5], 0.5) == 0  # the ones under the cap were kept


def test_two_thousand_idle_connections_do_not_shut_out_real_requests(stack: None, unique: str) -> None:
    """The reported attack on ingestion: connections that send nothing fill uvicorn's
    ``limit_concurrency`` (2,000), past which every request is answered 503."""
    from choreo import topology
    from consumers.workflow import WORKFLOW

    topology.create(WORKFLOW)
    per_address = 250
    sources = [f"127.0.1.{n}" for n in range(1, 9)]  # 8 x 250 = 2,000
    with serving(ingestion_settings(unique)) as url, ExitStack() as sockets:
        server = Server("ingestion", url, "/healthz", "/deliveries", None)
        idle = [sockets.enter_context(connect(server, source))
                for source in sources for _ in range(per_address)]
        deadline = time.monotonic() + LIMITS.keep_alive_s + SLACK_S
        statuses = [real_request(server)]
        while statuses[-1] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            statuses.append(real_request(server))
        assert statuses[-1] == 200, f"real requests got {statuses} while 2,000 idle connections stayed"
        assert closed_by_server(idle, max(0.5, deadline - time.monotonic())) == len(idle)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send_until_refused(sock: socket.socket, pieces: Callable[[], Iterator[bytes]]) -> None:
    try:
        for piece in pieces():
            sock.sendall(piece)
    except (BrokenPipeError, ConnectionResetError):  # refused part-way: the answer is read next
        pass


def test_an_unterminated_huge_head_is_refused_without_growing_memory(server: Server) -> None:
    total, chunk = 21 * 1024 * 1024, 64 * 1024

    def head() -> Iterator[bytes]:
        yield f"GET {server.path} HTTP/1.1\r\nHost: x\r\nX-Junk: ".encode()
        for _ in range(total // chunk):
            yield b"a" * chunk

    before = rss_bytes(server.pid) if server.pid else 0
    with connect(server, "127.0.0.5") as sock:
        sock.settimeout(30)
        send_until_refused(sock, head)
        answer, closed = read_until_closed(sock, 30)
    assert closed is not None
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    if server.pid:
        grown = rss_bytes(server.pid) - before
        assert grown < 4 * 1024 * 1024, f"the registry grew by {grown} bytes holding a head"
    assert real_request(server) == 200


def test_pipelined_heads_past_the_bound_are_refused(server: Server) -> None:
    """Several requests in one write: each head is held to the bound, not only the first."""
    small = f"GET {server.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    with_body = b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789"
    big = (f"GET {server.path} HTTP/1.1\r\nHost: x\r\nX-Junk: ".encode()
           + b"a" * (LIMITS.max_head_bytes * 3) + b"\r\n\r\n")
    for first in (small, with_body, small + small):
        with connect(server, "127.0.0.6") as sock:
            sock.settimeout(10)
            send_until_refused(sock, lambda: iter([first + big + small]))
            answer, closed = read_until_closed(sock, 10)
        statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
        assert closed is not None
        assert statuses[-1] == b"431", statuses
        assert len(statuses) == first.count(b"HTTP/1.1") + 1, statuses  # nothing after the refusal


def test_a_refusal_reaches_a_client_whose_input_was_left_unread(server: Server) -> None:
    """A client that sent more than the server read before refusing it still gets the
    refusal and a clean end: closing with input unread would reset the connection, and a
    reset can destroy the answer before the client reads it."""
    head = (f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nX-Junk: ".encode()
            + b"a" * (LIMITS.max_head_bytes + 100) + b"\r\n")
    unread = b"b" * (128 * 1024)
    for _ in range(3):
        with connect(server, "127.0.0.9") as sock:
            sock.sendall(head + unread)
            time.sleep(0.5)  # the server answers and closes before the client reads
            answer, ended = b"", False
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
                ended = True
            except ConnectionResetError:
                pass
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert ended, "the connection was reset instead of closed after the answer"


def exchange(server: Server, pieces: list[bytes], responses: int) -> list[bytes]:
    """Send ``pieces`` one write each (a pause between them, so they arrive as separate
    reads); the statuses of the first ``responses`` answers."""
    with connect(server, "127.0.0.7") as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.02)
        data = b""
        deadline = time.monotonic() + 10
        while len(re.findall(rb"HTTP/1\.1 \d{3} ", data)) < responses and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        statuses: list[bytes] = re.findall(rb"HTTP/1\.1 (\d{3}) ", data)
        return statuses


def test_requests_within_the_bounds_are_served_however_they_are_cut(server: Server) -> None:
    """No false refusal: a head just under the bound in small writes with its CRLFCRLF
    split between two of them, a chunked body, and a head under the bound pipelined
    right after a large Content-Length body."""
    padding = b"X-Pad: " + b"p" * (LIMITS.max_head_bytes - 200) + b"\r\n"
    head = f"GET {server.path} HTTP/1.1\r\nHost: x\r\n".encode() + padding + b"\r\n"
    pieces = [head[i:i + 1000] for i in range(0, len(head) - 1, 1000)]
    pieces[-1:] = [head[len(head) - len(pieces[-1]):-1], head[-1:]]  # the final LF alone
    assert b"".join(pieces) == head and pieces[-2].endswith(b"\r\n\r")
    assert exchange(server, pieces, 1) == [b"200"]

    chunked = (f"POST {server.post_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n1\r\n}\r\n0\r\n\r\n").encode()
    assert exchange(server, [chunked + head], 2) == [b"422", b"200"]

    body = b"x" * 30_000
    large = b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    assert exchange(server, [large + head], 2) == [b"404", b"200"]


def test_a_slow_head_on_a_kept_alive_connection_is_cut_too(servers: list[Server]) -> None:
    on_each(slow_head_after_keep_alive_is_cut, servers)


def slow_head_after_keep_alive_is_cut(server: Server) -> None:
    """The head's clock starts again for each request of a connection, from its first byte."""
    stop = threading.Event()
    with connect(server, "127.0.0.8") as sock:
        request = f"GET {server.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        assert exchange_on(sock, request) == b"200"
        time.sleep(LIMITS.keep_alive_s / 2)  # idle, within the keep-alive bound
        started = time.monotonic()
        slow = threading.Thread(target=trickle, daemon=True, args=(
            sock, f"GET {server.path} HTTP/1.1\r\n".encode(), b"X-a: b\r\n", stop))
        slow.start()
        try:
            answer, closed = read_until_closed(sock, LIMITS.head_timeout_s + SLACK_S)
        finally:
            stop.set()
        assert closed is not None and closed >= LIMITS.head_timeout_s - 1, closed
        assert time.monotonic() - started >= LIMITS.head_timeout_s - 1
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def exchange_on(sock: socket.socket, request: bytes) -> bytes:
    """One request on an open connection: the status of its answer (read whole)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b" ")[1]


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_client_that_stops_reading_its_answer_is_cut_one_that_reads_slowly_is_not(tls: bool, tmp_path: Path) -> None:
    """uvicorn waits for ever for a client to read what it was sent: one that asks for a large
    answer and reads none of it would hold its connection (a slot of the address's and the
    server's caps) and the buffered answer. The guard resets a connection whose client
    acknowledged none of what waited for it over ``send_timeout_s``: a streamed answer or one
    written whole, over TLS too. A client reading 160 KiB a second gets all of it, past the
    seconds in which its reads free only the kernel's send queue and the moments the
    stream's writes refill it."""
    chunk, chunks = b"x" * 65536, 128  # 8 MiB: more than the kernel's send queue takes
    size = len(chunk) * chunks

    async def app(scope: dict[str, object], receive: Callable[..., object], send: Callable[..., object]) -> None:
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,  # type: ignore[misc]
                    "headers": [(b"content-length", str(size).encode())]})
        if scope["path"] == "/whole":
            await send({"type": "http.response.body", "body": chunk * chunks})  # type: ignore[misc]
            return
        for n in range(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": n < chunks - 1})  # type: ignore[misc]

    options: dict[str, str] = {}
    context = None
    if tls:
        from infra.tls import ensure_certificates

        certificates = ensure_certificates(tmp_path / "tls")
        options = {"ssl_certfile": str(certificates.server_cert), "ssl_keyfile": str(certificates.server_key)}
        context = ssl.create_default_context(cafile=str(certificates.ca_cert))
        context.check_hostname = False
    # a window of 3 s: loopback's segments are 64 KiB, so a reader's window reopens a segment
    # at a time, every 0.4 s at 160 KiB/s
    limits = HttpLimits(send_timeout_s=3.0, keep_alive_s=1)
    port = free_port()
    config = uvicorn_config(app, "127.0.0.1", port, limits, lambda status, code, message: ("text/plain", b""),
                            log_level="warning", lifespan="off", **options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    opened: list[socket.socket] = []
    try:
        wait_for(lambda: server.started, 30, 0.05, "uvicorn to start")
        guard = config.http.guard  # type: ignore[union-attr]
        clients: dict[str, socket.socket] = {}
        asked = (("/streamed", "127.0.0.3", 4096), ("/whole", "127.0.0.4", 4096),
                 ("/streamed", "127.0.0.5", 65536), ("/whole", "127.0.0.6", 65536))
        for path, source, window in asked:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
            sock.bind((source, 0))
            sock.connect(("127.0.0.1", port))
            if context is not None:
                sock = context.wrap_socket(sock)
            sock.settimeout(5)
            clients[source] = sock
            opened.append(sock)
        for (path, source, _), sock in zip(asked, clients.values()):  # asked once all are connected
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        readers = {source: clients.pop(source) for source in ("127.0.0.5", "127.0.0.6")}
        received = dict.fromkeys(readers, b"")

        def read(source: str, most: int) -> None:
            data = readers[source].recv(most)
            assert data, f"the reader on {source} was cut after {len(received[source])} bytes"
            received[source] += data

        started = time.monotonic()
        while time.monotonic() - started < 4 * limits.send_timeout_s:  # 16 KiB a reader every 0.1 s
            for source in readers:
                read(source, 16384)
            time.sleep(0.1)
        wait_for(lambda: not {"127.0.0.3", "127.0.0.4"} & set(guard.per_ip), 15, 0.1,
                 "the stalled connections to be cut")
        assert set(readers) <= set(guard.per_ip)  # the slow readers still connected
        whole = {source: data.index(b"\r\n\r\n") + 4 + size for source, data in received.items()}
        deadline = time.monotonic() + 60
        while any(len(received[source]) < whole[source] for source in readers):  # and they get all of it
            assert time.monotonic() < deadline, {source: len(data) for source, data in received.items()}
            for source in readers:
                if len(received[source]) < whole[source]:
                    read(source, 1 << 20)
        assert all(data.split(b"\r\n\r\n", 1)[1] == chunk * chunks for data in received.values())
        for sock in clients.values():
            left, _ = read_until_closed(sock, 10)  # what the kernel held, or a reset
            assert len(left) < size  # the rest of the answer was dropped
    finally:
        for sock in opened:  # an open one holds uvicorn's shutdown for its graceful wait
            sock.close()
        server.should_exit = True
        thread.join(30)
