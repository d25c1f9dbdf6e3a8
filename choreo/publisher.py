"""Publishing the first event of a story (a delivery request) from code, HTTP or the CLI.

The steps the event triggers are registered as pending in the state table *before* the
event is produced, with their complete-by deadlines, so the supervisor watches them even
if the service that should take them is down. Produce is idempotent with acks=all; a
publish is confirmed only by the broker's delivery report, never by a per-message flush.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from confluent_kafka import KafkaError, Message, Producer

from choreo.kafka import pipeline_producer_config
from choreo.config import settings
from choreo.envelope import Envelope, MAX_ID_CHARS, now_ms
from choreo import layout, tracing
from choreo.events import Event
from choreo.redis_client import connect
from choreo.serde import Encoder, registry_client
from choreo.state import StateTable
from choreo.workflow import Workflow

DeliveryCallback = Callable[[KafkaError | None, Message | None], None]


class PublishError(RuntimeError):
    """The event could not be made durable; nothing was accepted."""


@dataclass(frozen=True)
class Publish:
    """One event to publish: where (``topic``, default the event's own) and who learns the
    broker's report."""

    event: Event
    event_id: str
    topic: str | None = None
    deadline_ms: int = 0
    on_delivery: DeliveryCallback | None = None
    envelope: Envelope | None = None  # made by ``Publisher.envelope`` when absent


class Publisher:
    def __init__(self, name: str, workflow: Workflow | None = None,
                 redis_client: redis.Redis | None = None,
                 producer_config: dict[str, Any] | None = None) -> None:
        cfg = settings()
        self.name = name
        self.workflow = workflow
        tracing.configure(name)
        self.redis = redis_client or connect(cfg.redis_url, socket_timeout=5)
        self.state = StateTable(self.redis)
        self._layout_checked = False  # on the first steps it opens: Redis may be down at start
        self.registry = registry_client()
        self._encoders: dict[tuple[type[Event], str], Encoder[Any]] = {}
        self.producer = Producer({
            **pipeline_producer_config(),
            "enable.idempotence": True,
            "acks": "all",
            "delivery.timeout.ms": 30000,
            **(producer_config or {}),
        })
        self._lock = threading.Lock()

    def _encoder(self, event: Event, topic: str) -> Encoder[Any]:
        key = (type(event), topic)
        if key not in self._encoders:
            self._encoders[key] = Encoder(type(event), topic, self.registry)
        return self._encoders[key]

    def publish(self, event: Event, event_id: str, *, topic: str | None = None,
                deadline_ms: int = 0, on_delivery: DeliveryCallback | None = None) -> Envelope:
        """Register the triggered steps, then produce; ``on_delivery`` learns the outcome."""
        result = self.publish_many([Publish(event, event_id, topic, deadline_ms, on_delivery)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def publish_many(self, items: Sequence[Publish]) -> list[Envelope | Exception]:
        """``publish`` for many events with one state-table round trip for all of them.

        Each item's result is its envelope, or the exception that kept it from the producer
        (its steps withdrawn again). Items are produced in order, and once the local queue
        is full (``BufferError``) the rest are not produced and get that error too, so a
        caller can resume after the last one taken. If the steps cannot be registered
        (Redis), nothing is produced and every item gets that error. Raised, rather than
        returned, is only an error before anything of the batch was done.
        """
        self.producer.poll(0)  # earlier reports first: their callbacks' errors surface here
        triggers = [(item.event.key, item.topic or item.event.topic) for item in items]
        try:
            self.open_steps(triggers)
        except Exception as exc:
            # nothing withdrawn: a step this batch opened without producing is failed by the
            # supervisor at its deadline, while one a republished delivery opened before
            # (its event in Kafka) must stay
            return [exc] * len(items)
        results: list[Envelope | Exception] = []
        withdraw: list[tuple[str, str]] = []
        queue_full: BufferError | None = None
        for item, (key, target) in zip(items, triggers):
            try:
                if queue_full is not None:
                    raise queue_full
                envelope = self.envelope(item)
                value = self._encoder(item.event, target)(item.event)
                span = tracing.start_child(f"produce {target}", envelope.traceparent, tracing.SpanKind.PRODUCER, {
                    "choreo.service": self.name, "messaging.destination.name": target,
                    "messaging.message.id": envelope.event_id}) if tracing.enabled() else None
                with tracing.spanning(span), self._lock:
                    self.producer.produce(target, key=key.encode(), value=value,
                                          headers=envelope.to_headers(), on_delivery=item.on_delivery)
            except Exception as exc:
                queue_full = exc if isinstance(exc, BufferError) else None
                withdraw.append((key, target))
                results.append(exc)
                continue
            results.append(envelope)
        self._withdraw(withdraw)
        return results

    def envelope(self, item: Publish) -> Envelope:
        """The envelope ``item`` goes out with: its own, or the first of a new story. An
        entry event's ``reply_topic`` and ``owner_id`` fields, when it has them, travel in the
        story's envelope, so the hop that decides the delivery can copy its outcome there
        (``choreo.outcomes``)."""
        if item.envelope is not None:
            return item.envelope
        if len(item.event.key) > MAX_ID_CHARS:  # its readers would cut it, and refuse the event
            raise ValueError(f"a delivery id of {len(item.event.key)} characters: at most {MAX_ID_CHARS}")
        envelope = Envelope.first(
            item.event_id, item.event.key, type(item.event).__name__, self.name, item.deadline_ms,
            reply_to=str(getattr(item.event, "reply_topic", None) or ""),
            owner=str(getattr(item.event, "owner_id", None) or ""))
        if tracing.enabled():  # the story's root span, with the ids the envelope names
            root = tracing.start_root(f"ingest {item.topic or item.event.topic}", envelope.traceparent, {
                "choreo.service": self.name, "choreo.delivery_id": item.event.key,
                "messaging.message.id": item.event_id})
            if root is not None:
                root.end()
        return envelope

    def open_steps(self, triggers: Sequence[tuple[str, str]]) -> None:
        """Register the steps each ``(delivery id, topic)`` triggers, pending with their
        deadlines: one round trip for all."""
        if self.workflow is not None:
            if not self._layout_checked:
                layout.claim(self.redis)
                self._layout_checked = True
            now = now_ms()
            self.state.open_many(self.workflow.pending_steps(triggers, now), now)

    def abandon_steps(self, triggers: Sequence[tuple[str, str]]) -> None:
        """The triggers were not accepted: withdraw their pending steps (one round trip), so
        the supervisor never chases a delivery nobody accepted."""
        if self.workflow is not None:
            self.state.abandon_many([(delivery_id, step) for delivery_id, step, _, _
                                     in self.workflow.pending_steps(triggers, 0)])

    def _withdraw(self, triggers: Sequence[tuple[str, str]]) -> None:
        """``abandon_steps`` at best: a step left pending with no source is failed by the
        supervisor at its deadline, and the caller is told of the failure either way."""
        with contextlib.suppress(redis.RedisError):
            self.abandon_steps(triggers)

    def publish_all(self, events: list[tuple[Event, str]], timeout_s: float = 30.0) -> None:
        """Publish many and wait until every one is durable; raise if any is not."""
        failures: list[str] = []

        def record(err: KafkaError | None, _: Message | None) -> None:
            if err is not None:
                failures.append(str(err))

        for result in self.publish_many([Publish(event, event_id, on_delivery=record)
                                         for event, event_id in events]):
            if isinstance(result, Exception):
                failures.append(f"{type(result).__name__}: {result}")
        self.flush(timeout_s)
        if failures:
            raise PublishError(f"{len(failures)} events were not accepted: {failures[0]}")

    def poll(self, timeout_s: float) -> int:
        return int(self.producer.poll(timeout_s))

    def flush(self, timeout_s: float) -> None:
        remaining = self.producer.flush(timeout_s)
        if remaining:
            raise PublishError(f"{remaining} events still unconfirmed after {timeout_s}s")
