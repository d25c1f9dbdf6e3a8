"""Nothing secret reaches a log line, whoever writes it (our structlog calls or a library)."""

from __future__ import annotations

import io
import logging

from confluent_kafka.schema_registry.common import _httpx_compat

from choreo.logs import RedactUrlCredentials, configure, redact


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


def test_the_registry_clients_request_lines_stay_out_of_info_logs() -> None:
    """The registry client's HTTP library (httpx2 or httpx, whichever it imported) would log
    every request at INFO: a line per schema lookup, with the registry's URL."""
    configure("INFO")
    library = _httpx_compat.httpx.__name__
    # their own level, not the root's (under pytest the root logger is pytest's to set)
    assert logging.getLogger(library).level >= logging.WARNING, library
    assert logging.getLogger(library.replace("httpx", "httpcore")).level >= logging.WARNING
