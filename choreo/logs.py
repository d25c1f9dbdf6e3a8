"""structlog JSON logs; customer data is redacted before it can reach a log line."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

# Field names that may hold customer data (addresses, names, contact details, secrets).
SENSITIVE_KEYS = frozenset(
    {"owner", "owner_id", "owner_name", "name", "address", "pickup", "dropoff", "email", "phone",
     "token", "authorization", "password", "secret"}
)


def redact(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Replace sensitive values anywhere in the event, so a careless log call cannot leak them."""
    for key in list(event_dict):
        if key.lower() in SENSITIVE_KEYS:
            event_dict[key] = "[redacted]"
        elif isinstance(event_dict[key], dict):
            event_dict[key] = {
                k: ("[redacted]" if k.lower() in SENSITIVE_KEYS else v)
                for k, v in event_dict[key].items()
            }
    return event_dict


URL_USERINFO = re.compile(r"(\w+://)[^/\s@]+@")


class RedactUrlCredentials(logging.Filter):
    """Library log lines (httpx logs every request at INFO, URL included) would carry the
    ``user:password@`` of a URL such as ``SCHEMA_REGISTRY_URL``: scrub it from every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a library's malformed %-args: logging reports it on emit, as before
            return True
        if "@" in message:
            record.msg, record.args = URL_USERINFO.sub(r"\1[redacted]@", message), None
        if record.exc_text and "@" in record.exc_text:
            record.exc_text = URL_USERINFO.sub(r"\1[redacted]@", record.exc_text)
        return True


_configured = False


def configure(level: str = "INFO", stream: Any = None) -> None:
    global _configured
    level = level.upper()
    logging.basicConfig(format="%(message)s", stream=stream or sys.stderr, level=level)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactUrlCredentials) for f in handler.filters):
            handler.addFilter(RedactUrlCredentials())
    numeric = logging.getLevelName(level)
    # a line per registry request is noise, not news (the registry client takes httpx2 when it
    # is installed, httpx otherwise: both, and their cores, log every request at INFO)
    for chatty in ("httpx", "httpcore", "httpx2", "httpcore2"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, numeric if isinstance(numeric, int)
                                               else logging.INFO))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(**bound: Any) -> Any:
    if not _configured:
        from choreo.config import settings

        configure(settings().log_level)
    return structlog.get_logger().bind(**bound)
