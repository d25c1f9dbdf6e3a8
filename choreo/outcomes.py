"""A delivery's outcome, copied to the reply topic its submitter named.

The entry point puts the request's reply topic in the envelope (``reply_to``) and every hop
carries it on (a requeue too). The runner that produces an event that decides a delivery
(``Workflow.outcome_labels``: the deciding join's outcomes) writes one ``DeliveryOutcome`` to that topic in the same
transaction: the outcome event and its copy commit or abort together, and the copy's id is
derived from the outcome event's, so a replay writes the same record again, never a second
outcome (``read_committed`` readers see exactly one).

The header may have been forged at any hop, so the writer trusts it no more than the HTTP
edge trusts the request: only a legal topic name under the configured prefix
(``CHOREO_REPLY_TOPIC_PREFIX``, one prefixed ACL in the secured stack) that exists on the
broker is written to. Anything else is logged and skipped; the outcome event itself is
published as usual. A topic that does not exist is never produced to: with topic
auto-creation off, the produce would fail the transaction and the batch would replay
forever.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime

from prometheus_client import Counter

from choreo.envelope import MAX_TOPIC_CHARS, Envelope
from choreo.events import Event
from choreo.runtime_events import DeliveryOutcome

DEFAULT_REPLY_PREFIX = "replies."
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
KNOWN_TTL_S = 60.0  # how long a topic's existence (or absence) is believed
KNOWN_MAX = 1024  # topics remembered; the oldest are forgotten first
REPLIES = Counter("choreo_replies_total", "Outcome copies to reply topics, written or refused",
                  ["service", "result"])


def reply_prefix() -> str:
    """The prefix every reply topic starts with: what the ACL grants (``replies.`` by default)."""
    prefix = os.environ.get("CHOREO_REPLY_TOPIC_PREFIX", DEFAULT_REPLY_PREFIX)
    if not prefix or not TOPIC_NAME.fullmatch(prefix):
        raise ValueError("CHOREO_REPLY_TOPIC_PREFIX must be a non-empty topic name prefix")
    return prefix


def refusal(topic: str, prefix: str | None = None) -> str | None:
    """Why ``topic`` may not receive outcomes, or None when it may (existence aside)."""
    prefix = reply_prefix() if prefix is None else prefix
    if not topic.startswith(prefix) or len(topic) == len(prefix):
        return f"not under the reply prefix {prefix!r}"
    if len(topic) > MAX_TOPIC_CHARS or not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        return "not a legal Kafka topic name"
    return None


class ReplyTopics:
    """Which reply topics a writer may produce to: allowed by name, and known to exist (asked
    of the broker once a minute per topic at most, and for a bounded number of topics)."""

    def __init__(self, exists: Callable[[str], bool], prefix: str | None = None) -> None:
        self.prefix = reply_prefix() if prefix is None else prefix
        self._exists = exists
        self._known: OrderedDict[str, tuple[float, bool]] = OrderedDict()

    def refusal(self, topic: str) -> str | None:
        why = refusal(topic, self.prefix)
        if why is not None:
            return why
        now = time.monotonic()
        known = self._known.get(topic)
        if known is None or known[0] < now:
            known = (now + KNOWN_TTL_S, self._exists(topic))
            self._known[topic] = known
            self._known.move_to_end(topic)
            while len(self._known) > KNOWN_MAX:
                self._known.popitem(last=False)
        return None if known[1] else "no such topic (or not visible to this service)"


def outcome_of(event: Event, label: str, envelope: Envelope) -> DeliveryOutcome:
    """The outcome record of the event that decided a delivery (its join's ``label``)."""
    return DeliveryOutcome(
        delivery_id=event.key, outcome=label, reason=str(getattr(event, "reason", "") or ""),
        compensate=[str(step) for step in getattr(event, "compensate", None) or ()],
        event_type=type(event).__name__, event_id=envelope.event_id, trace_id=envelope.trace_id,
        decided_at=datetime.fromtimestamp((envelope.produced_at_ms or int(time.time() * 1000)) / 1000, UTC),
    )
