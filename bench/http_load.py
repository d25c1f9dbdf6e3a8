"""A closed-loop HTTP load client: C connections (keep-alive), each sending the next of N
``POST /deliveries`` as soon as its previous answer came.

    python -m bench.http_load --url http://127.0.0.1:8000 --requests 5000 --concurrency 32

Raw asyncio streams and one prepared request, not an HTTP library: httpx took 7 ms of CPU
per request on this machine, more than the server it measured, so the client was the
limit (bench/README.md, "HTTP ingestion"). This one takes about 0.2 ms. The
last line printed is a JSON object: requests/s, status counts, latency percentiles and the
client's own CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from bench.common import latency_summary

SAMPLE_REQUEST = {
    "owner_id": "acct-bench", "package_size": "SMALL", "weight_kg": 1.2,
    "pickup": {"lat": 47.6062, "lon": -122.3321, "address": "1 Bench St"},
    "dropoff": {"lat": 47.6205, "lon": -122.3493, "address": "2 Bench Ave"},
}


class BadResponse(Exception):
    """The server answered something this client cannot read as an HTTP/1.1 response."""


def request_bytes(host: str, body: bytes) -> bytes:
    head = (f"POST /deliveries HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def parse_head(head: bytes) -> tuple[int, int, bool]:
    """Status, body length and whether the server closes the connection, from a response's
    head (up to and including the blank line)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    length, close = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            if not value.strip().isdigit():
                raise BadResponse(f"bad Content-Length: {value[:40]!r}")
            length = int(value)
        elif name == b"connection":
            close = value.strip().lower() == b"close"
        elif name == b"transfer-encoding":
            raise BadResponse("chunked responses are not read by this client")
    return int(parts[1]), length, close


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


async def drive(url: str, requests: int, concurrency: int, body: bytes) -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    prepared = request_bytes(f"{host}:{port}", body)
    statuses: dict[int, int] = {}
    latencies_ms: list[float] = []
    errors: list[str] = []
    left = iter(range(requests))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for _ in left:
                started = time.perf_counter()
                try:
                    writer.write(prepared)
                    status, length, close = parse_head(await reader.readuntil(b"\r\n\r\n"))
                    await reader.readexactly(length)
                except (BadResponse, OSError, asyncio.IncompleteReadError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    close = True
                else:
                    latencies_ms.append((time.perf_counter() - started) * 1000)
                    statuses[status] = statuses.get(status, 0) + 1
                if close:  # the server ends this connection: open another
                    writer.close()
                    reader, writer = await asyncio.open_connection(host, port)
        finally:
            writer.close()

    cpu_before, started = _cpu_s(), time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    cpu_s = _cpu_s() - cpu_before
    answered = len(latencies_ms)
    return {
        "requests": requests, "concurrency": concurrency, "answered": answered,
        "statuses": {str(k): v for k, v in sorted(statuses.items())}, "errors": len(errors),
        "first_errors": errors[:5], "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(answered / elapsed, 1) if elapsed else 0.0,
        "latency": latency_summary(latencies_ms),
        "client_cpu_us_per_request": round(cpu_s / max(1, answered) * 1e6),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.http_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--requests", "-n", type=int, default=5000)
    parser.add_argument("--concurrency", "-c", type=int, default=32)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        raise SystemExit("--requests and --concurrency must be at least 1")
    body = json.dumps(SAMPLE_REQUEST).encode()
    print(json.dumps(asyncio.run(drive(args.url, args.requests, args.concurrency, body))))


if __name__ == "__main__":
    main()
