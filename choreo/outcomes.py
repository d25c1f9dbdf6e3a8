"""A delivery's outcome, copied to the reply topic its submitter named.

The entry point puts the request's reply topic in the envelope (``reply_to``) and every hop
carries it on (a requeue too). The runner that produces an event that decides a delivery
(``Workflow.outcome_labels``: the deciding join's outcomes) writes one ``DeliveryOutcome`` to that topic in the same
transaction: the outcome event and its copy commit or abort together, and the copy's id is
derived from the outcome event's, so a replay writes the same record again, never a second
outcome (``read_committed`` readers see exactly one). Two exceptions, both from the
supervisor's scan, which has no input to read again: it writes its own ``delivery.failed``
again until it reads it back, and an undo's failure record until its transaction is known
committed (RELIABILITY.md, "An undo that fails past its budget"). Each is written again
under the same ids, its outcome's copy too, so a reader that keeps the first record of an id
is told once.

The header may have been forged at any hop, so the writer trusts it no more than the HTTP
edge trusts the request: only a legal topic name under the configured prefix
(``CHOREO_REPLY_TOPIC_PREFIX``, one prefixed ACL in the secured stack) that exists on the
broker is written to. Anything else is logged and skipped; the outcome event itself is
published as usual. A topic that does not exist is never produced to: with topic
auto-creation off, the produce would fail the transaction and the batch would replay
forever.

**Which outcome, and when.** A delivery gets exactly one record: ``shipped``; ``failed`` when
nothing it did needs undoing (its failure lists no compensable step) or when an undo failed
for good; ``compensated`` once every completed step its failure listed is confirmed undone.
A failure that leaves work to undo is therefore told when its compensation ends, not when it
is decided: a submitter told ``failed`` at once would have to be told again, and an operator
reading the reply topic wants to know that nothing is left half done. The supervisor decides
the end of a compensation (``choreo.supervision``: the delivery's ``outcome.told`` field,
written once) and states it on the compensation log record that ends it (its ``outcome``),
in the same transaction as that record: that record is the deciding event then.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime

from prometheus_client import Counter

from choreo.envelope import MAX_TOPIC_CHARS, Envelope
from choreo.events import Event
from choreo.join import FAILED
from choreo.runtime_events import CompensationRecord, DeliveryOutcome
from choreo.workflow import Workflow

COMPENSATED = "compensated"
TOLD = "outcome.told"  # the delivery's field: the outcome a compensation ended with
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


def told(event: Event, flow: Workflow | None) -> str | None:
    """The outcome ``event`` tells its delivery's submitter, or None when it tells none: a
    deciding event's label (a failure only when it leaves nothing to undo), or the outcome a
    compensation log record states when it ends the compensation."""
    if isinstance(event, CompensationRecord):
        return event.outcome or None
    label = flow.outcome_labels.get(type(event)) if flow is not None else None
    if label == FAILED and flow is not None and undoes(getattr(event, "compensate", None) or (), flow):
        return None  # told when its compensation ends
    return label


def told_in_state(fields: Mapping[str, str]) -> str | None:
    """What a delivery's state (its hash's plain fields) says its submitter is told, or None
    while it is undecided or its failure may still be compensated: a failure is final once
    the supervisor read it (``fail.seen``) and found nothing to undo (an empty ``undo.order``),
    or once its compensation ended (``outcome.told``). What the status and its stream show."""
    if fields.get(TOLD):
        return fields[TOLD]
    outcome = fields.get("outcome") or None
    if outcome == FAILED and not (fields.get("fail.seen") and not fields.get("undo.order")):
        return None
    return outcome


def undoes(steps: Iterable[str], flow: Workflow) -> list[str]:
    """The steps of a failure's list that have a compensation, each once: what the supervisor
    undoes (a list that names one step ten thousand times is one step, not a script's
    arguments past what Lua unpacks)."""
    return list(dict.fromkeys(step for step in steps if step in flow.undoable))


def outcome_of(event: Event, label: str, envelope: Envelope) -> DeliveryOutcome:
    """The outcome record of the event that decided a delivery (``told``: its ``label``).
    A compensation's end states the failure it undid: its reason code and its steps."""
    event_type, delivery_id = type(event).__name__, event.key
    if isinstance(event, CompensationRecord):  # its reason is the failure's "<code>: <detail>"
        delivery_id = event.delivery_id  # its key names the step too
        reason = "COMPENSATION_FAILED" if event.status == "COMPENSATION_FAILED" else event.reason.partition(": ")[0]
        steps: Iterable[object] = event.undone
        event_type = CompensationRecord.__name__
    else:
        reason, steps = str(getattr(event, "reason", "") or ""), getattr(event, "compensate", None) or ()
    return DeliveryOutcome(
        delivery_id=delivery_id, outcome=label, reason=reason, compensate=[str(step) for step in steps],
        event_type=event_type, event_id=envelope.event_id, trace_id=envelope.trace_id,
        decided_at=datetime.fromtimestamp((envelope.produced_at_ms or int(time.time() * 1000)) / 1000, UTC),
    )
