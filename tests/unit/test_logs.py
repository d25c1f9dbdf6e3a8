"""Nothing secret reaches a log line, whoever writes it (our structlog calls or a library)."""

from __future__ import annotations

import io
import logging

from choreo.logs import RedactUrlCredentials, redact


def test_structlog_events_lose_customer_fields() -> None:
    event = redact(None, "info", {"event": "x", "address": "1 Main St", "request": {"token": "t"}})
    assert event == {"event": "x", "address": "[redacted]", "request": {"token": "[redacted]"}}


def test_library_lines_lose_url_credentials() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactUrlCredentials())
    log = logging.getLogger("test.redact")
    log.addHandler(handler)
    try:
        log.warning("HTTP Request: POST %s %s", "http://package:s3cret@127.0.0.1:28081/subjects/a/versions",
                    "HTTP/1.1 200 OK")
        log.warning("no credentials in http://127.0.0.1:8081/schemas/ids/1 or a@b")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("HTTP Request: POST http://[redacted]@127.0.0.1:28081/subjects/a/versions "
                        "HTTP/1.1 200 OK")
    assert "s3cret" not in stream.getvalue()
    assert lines[1] == "no credentials in http://127.0.0.1:8081/schemas/ids/1 or a@b"
