"""Text that somebody else wrote, made safe to print on an operator's terminal."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with each control character (a terminal's escape sequence) shown escaped
    instead of sent to the terminal: what a tool prints may come from Redis, Kafka, a header
    or a file."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
