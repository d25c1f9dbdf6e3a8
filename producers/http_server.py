"""How the ingestion endpoint is served: uvicorn on httptools and uvloop, with a bound on a
request's head.

httptools and uvloop (C) in place of h11 and asyncio's pure-Python loop: a request's parsing
and the loop's own work took about a third of the server's CPU (bench/README.md, "HTTP
ingestion: group commit"). But h11 refuses a request head past 16 KB and uvicorn's
httptools protocol has no such bound: it would keep megabytes of headers per connection,
for as many connections as it serves. ``BoundedHeadProtocol`` puts h11's bound back.
"""

from __future__ import annotations

import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 16 * 1024  # h11's default (uvicorn's h11_max_incomplete_event_size)
_HEAD_END = b"\r\n\r\n"


class BoundedHeadProtocol(HttpToolsProtocol):
    """Refuses a request whose head (request line and headers) passes ``MAX_HEAD_BYTES``
    with a 431 and closes the connection, before the parser has kept it.

    Bytes are counted as they arrive, up to the blank line that ends the head; a body that
    comes in the same read is not counted (the body limit is ``ingestion.BodyLimit``'s)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            end = data.find(_HEAD_END)
            self._head_bytes += len(data) if end < 0 else end + len(_HEAD_END)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0

    def _refuse_head(self) -> None:
        body = json.dumps({"error": "headers_too_large",
                           "message": f"the request's head is larger than {MAX_HEAD_BYTES} bytes"}).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n"
                             b"connection: close\r\n\r\n" + body)
        self.transport.close()


def server_config(asgi_app: Any, host: str, port: int, limit_concurrency: int = 2000,
                  log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's configuration for ``choreo serve`` (the benchmark's bare baseline and the
    tests serve the same way)."""
    return uvicorn.Config(asgi_app, host=host, port=port, access_log=False, log_level=log_level,
                          limit_concurrency=limit_concurrency, timeout_graceful_shutdown=30,
                          http=BoundedHeadProtocol, loop="uvloop")


def run_http(asgi_app: Any, host: str, port: int, limit_concurrency: int = 2000,
             log_level: str = "warning") -> None:
    uvicorn.Server(server_config(asgi_app, host, port, limit_concurrency, log_level)).run()
