"""What an effect's script item answered, as the runtime reads it: text, nothing, or
``Dropped``, the word of an effect the runtime did not run.

The runtime's refusal (``choreo.effects``) answers a one-item array, ``{'released'}`` or
``{'stale'}``, where every effect body answers text or nothing. Text a body returns may come
from an event (a record's field is ``set_once``'s answer; a pool's member is what the
reservation answers), so no text can mean "not run": a drone named ``"stale"`` or
``"\\x00stale"`` is a drone.
"""

from __future__ import annotations

from typing import Any


class Dropped(str):
    """An effect not run, by why (``RELEASED``, ``STALE``): the attempt that asked it is
    dropped. A ``str`` so that it travels where answers do; told apart by its type only."""


RELEASED = Dropped("released")  # its delivery was released
STALE = Dropped("stale")  # its step went to a newer attempt or was closed
_BY_WORD = {word: dropped for dropped in (RELEASED, STALE) for word in (str(dropped), str(dropped).encode())}


def answer_of(reply: Any) -> str | None:
    """An item's reply as the runtime reads it: None, its text, or a ``Dropped``."""
    if reply is None:
        return None
    if isinstance(reply, list):
        dropped = _BY_WORD.get(reply[0]) if len(reply) == 1 and isinstance(reply[0], (str, bytes)) else None
        if dropped is None:  # a body's contract is text: a table is a bug in the body
            raise TypeError(f"an effect answered an array of {len(reply)} items, not text")
        return dropped
    return reply.decode() if isinstance(reply, bytes) else str(reply)


def dropped_by(answer: object) -> str:
    """Why an effect's answer drops the attempt that asked it, or '' (text is never a drop)."""
    return str(answer) if isinstance(answer, Dropped) else ""
