"""Agents: the calls that package and drone work make to the outside world.

They simulate remote services with configurable latency, transient and permanent errors
(environment variables ``AGENT_<NAME>_LATENCY_MS``, ``AGENT_<NAME>_TRANSIENT_RATE``,
``AGENT_<NAME>_PERMANENT_RATE``), so retries, deadlines and failures run for real. Each
call carries a stable id so the remote side could dedupe. Failures are decided by a hash
of the call id: a permanent failure stays permanent on every retry, a transient one
depends on the try too, so it eventually clears.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

from choreo import Retryable


class PermanentFailure(Exception):
    """The remote side refused for good (e.g. the warehouse cannot take this package)."""


def _fraction(*parts: str) -> float:
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(frozen=True)
class Agent:
    name: str
    latency_ms: float = 0.0
    transient_rate: float = 0.0
    permanent_rate: float = 0.0

    @classmethod
    def from_env(cls, name: str) -> Agent:
        prefix = f"AGENT_{name.upper().replace('-', '_')}_"
        return cls(
            name,
            latency_ms=float(os.environ.get(prefix + "LATENCY_MS", "0")),
            transient_rate=float(os.environ.get(prefix + "TRANSIENT_RATE", "0")),
            permanent_rate=float(os.environ.get(prefix + "PERMANENT_RATE", "0")),
        )

    def call(self, operation: str, call_id: str, try_label: str) -> None:
        """Perform ``operation`` remotely; raise ``Retryable`` or ``PermanentFailure`` as configured."""
        if self.latency_ms:
            time.sleep(self.latency_ms / 1000)
        if not (self.permanent_rate or self.transient_rate):
            return  # nothing injected: no hashing on the hot path
        if _fraction(self.name, operation, call_id) < self.permanent_rate:
            raise PermanentFailure(f"{self.name} refused {operation}")
        # the try label is "<attempt>.<try>": a requeue is a new roll, not a replay of the old ones
        if _fraction(self.name, operation, call_id, try_label) < self.transient_rate:
            raise Retryable(f"{self.name} {operation} timed out")
