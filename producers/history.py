"""A delivery's status once its state expired from Redis: told from Kafka, the record.

The state table keeps a decided delivery for the join's retention only; Kafka keeps its
whole story (``choreo.ops.trace`` finds it without reading whole topics). Reading it costs a
scan of one partition per topic from the request on, so lookups are bounded: a few at a
time per process (``INGESTION_HISTORY_CONCURRENCY``), and fewer per caller
(``INGESTION_HISTORY_PER_CALLER``), so that one caller looping over ids nobody submitted
(each a scan of the request topic's window) leaves the others slots; past either, 503 with
``Retry-After``. A decided delivery's answer is remembered (it cannot change) for the next
reader.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from choreo.ops.trace import Hop, Keeping, trace
from choreo.outcomes import told
from choreo.runtime_events import CompensationRecord
from choreo.workflow import Workflow

REMEMBERED = 1024  # decided deliveries' answers kept, the oldest forgotten first
MAX_STORY_RECORDS = 200  # a delivery's records a lookup keeps (a real story has a few dozen)
MAX_STORY_HEADER_BYTES = 16 * 1024  # an envelope's headers are a few hundred bytes


class HistoryBusy(RuntimeError):
    """Every lookup slot is taken: the caller should retry shortly."""


class HistoryTooLong(RuntimeError):
    """The delivery has more records than a lookup keeps (``MAX_STORY_RECORDS``: someone
    padded it): what is kept may lack the request or the outcome, so nothing is told."""


@dataclass(frozen=True)
class History:
    """What Kafka says of one delivery: its owner (from the request) and its status."""

    owner_id: str
    status: dict[str, Any]


class KafkaHistory:
    def __init__(self, workflow: Workflow, client: redis.Redis, concurrency: int, per_caller: int,
                 max_value_bytes: int) -> None:
        """``max_value_bytes``: the largest request body ingestion takes (its Avro is no larger)."""
        self.workflow = workflow
        self.redis = client
        self._slots = threading.BoundedSemaphore(concurrency)
        self._per_caller = per_caller
        self._callers: dict[str, int] = {}  # lookups under way per caller (none: absent)
        self._decided: OrderedDict[str, History] = OrderedDict()
        self._lock = threading.Lock()
        self._deciding = {model.__name__: model for model in workflow.outcome_labels}
        # what a status needs of the story: the request's body (its owner) and the deciding
        # events', all small; a story padded by anyone able to write a topic stays bounded
        self._keeping = Keeping(
            values_of=frozenset({*workflow.extra_producers, CompensationRecord.topic,
                                 *(model.topic for model in workflow.outcome_labels)}),
            max_value_bytes=max_value_bytes, max_header_bytes=MAX_STORY_HEADER_BYTES, max_records=MAX_STORY_RECORDS)

    def lookup(self, delivery_id: str, caller: str) -> History | None:
        """The delivery's story as a status, or None if Kafka holds no request for it (within
        the trace's window). ``caller``: who asks (its owner, or its address without tokens).
        Blocking: call it from a worker thread."""
        with self._lock:
            known = self._decided.get(delivery_id)
            if known is not None:
                return known
            if self._callers.get(caller, 0) >= self._per_caller:
                raise HistoryBusy("too many history lookups at once for this caller")
            if not self._slots.acquire(blocking=False):
                raise HistoryBusy("too many history lookups at once")
            self._callers[caller] = self._callers.get(caller, 0) + 1
        try:
            found = self._read(delivery_id)
        finally:
            with self._lock:
                self._slots.release()
                left = self._callers.pop(caller) - 1
                if left:
                    self._callers[caller] = left
        if found is not None and found.status["outcome"]:
            with self._lock:
                self._decided[delivery_id] = found
                while len(self._decided) > REMEMBERED:
                    self._decided.popitem(last=False)
        return found

    def _told(self, hop: Hop, delivery_id: str) -> str | None:
        """The outcome ``hop`` tells the submitter (``choreo.outcomes.told``), if any: a deciding
        event's, or the compensation log record's that ends a failure's compensation. Only
        on the topic its model is published to: the event type is a header, and any writer of
        another topic could name a deciding one; a body that is not such an event, or is
        another delivery's, tells none."""
        model = CompensationRecord if hop.kind == "compensation" else (
            self._deciding.get(hop.event_type) if hop.kind == "event" else None)
        if (model is None or hop.topic != model.topic or not isinstance(hop.body, dict)
                or hop.body.get("delivery_id") != delivery_id):
            return None
        try:
            return told(model.model_validate(hop.body), self.workflow)
        except ValidationError:
            return None

    def _read(self, delivery_id: str) -> History | None:
        story = trace(delivery_id, self.workflow, redis_client=self.redis, keeping=self._keeping)
        if story.stats.cut:
            raise HistoryTooLong(f"more than {MAX_STORY_RECORDS} records")
        entry = set(self.workflow.extra_producers)
        # the request names the owner: one that is this delivery's, and only one owner among
        # them (copies of it are the same request); a second owner is a forgery, and no one
        # is told then rather than maybe the wrong one
        owners = {str(h.body.get("owner_id", "")) for h in story.hops
                  if h.topic in entry and isinstance(h.body, dict) and h.body.get("delivery_id") == delivery_id}
        if len(owners) != 1:
            return None
        outcome = next((told for h in story.hops if (told := self._told(h, delivery_id)) is not None), None)
        history = [{"topic": h.topic, "kind": h.kind, "event_type": h.event_type, "producer": h.producer,
                    "attempt": h.attempt, "time_ms": h.time_ms} for h in story.hops]  # never the bodies
        status = {"delivery_id": delivery_id, "status": outcome or "in_progress", "outcome": outcome,
                  "source": "kafka", "history": history}
        return History(owners.pop(), status)
