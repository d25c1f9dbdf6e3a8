"""How the ingestion endpoint is served: uvicorn on httptools and uvloop, held to the bounds
of ``choreo.http_serving`` (head size and time, body time, idle connections, connections
per address).

httptools and uvloop (C) in place of h11 and asyncio's pure-Python loop: a request's parsing
and the loop's own work took about a third of the server's CPU (bench/README.md, "HTTP
ingestion").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import uvicorn

from choreo.http_serving import HttpLimits, uvicorn_config

LIMITS = HttpLimits()
MAX_HEAD_BYTES = LIMITS.max_head_bytes


def refusal(status: int, code: str, message: str) -> tuple[str, bytes]:
    """A refusal of the connection guard in ingestion's error shape (``ingestion.error``)."""
    return "application/json", json.dumps({"error": code, "message": message}).encode()


def server_config(asgi_app: Any, host: str, port: int,
                  limit_concurrency: int = LIMITS.max_connections,
                  log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's configuration for ``choreo serve`` (the benchmark's bare baseline and the
    tests serve the same way)."""
    limits = dataclasses.replace(LIMITS, max_connections=limit_concurrency)
    return uvicorn_config(asgi_app, host, port, limits, refusal, access_log=False,
                          log_level=log_level, timeout_graceful_shutdown=30)


def run_http(asgi_app: Any, host: str, port: int, limit_concurrency: int = LIMITS.max_connections,
             log_level: str = "warning") -> None:
    uvicorn.Server(server_config(asgi_app, host, port, limit_concurrency, log_level)).run()
