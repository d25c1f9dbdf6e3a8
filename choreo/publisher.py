"""Publishing the first event of a story (a delivery request) from code, HTTP or the CLI.

The steps the event triggers are registered as pending in the state table *before* the
event is produced, with their complete-by deadlines, so the supervisor watches them even
if the service that should take them is down. Produce is idempotent with acks=all; a
publish is confirmed only by the broker's delivery report, never by a per-message flush.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
from confluent_kafka import KafkaError, Message, Producer

from choreo.kafka import pipeline_producer_config
from choreo.config import settings
from choreo.envelope import Envelope, now_ms
from choreo.events import Event
from choreo.serde import Encoder, registry_client
from choreo.state import StateTable
from choreo.workflow import Workflow

DeliveryCallback = Callable[[KafkaError | None, Message | None], None]


class PublishError(RuntimeError):
    """The event could not be made durable; nothing was accepted."""


class Publisher:
    def __init__(self, name: str, workflow: Workflow | None = None,
                 redis_client: redis.Redis | None = None,
                 producer_config: dict[str, Any] | None = None) -> None:
        cfg = settings()
        self.name = name
        self.workflow = workflow
        self.redis = redis_client or redis.Redis.from_url(cfg.redis_url, socket_timeout=5)
        self.state = StateTable(self.redis)
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
        target = topic or event.topic
        envelope = Envelope.first(event_id, event.key, type(event).__name__, self.name, deadline_ms)
        self.open_steps(event.key, target)
        try:
            value = self._encoder(event, target)(event)
            with self._lock:
                self.producer.produce(target, key=event.key.encode(), value=value,
                                      headers=envelope.to_headers(), on_delivery=on_delivery)
                self.producer.poll(0)
        except BaseException:
            self.abandon_steps(event.key, target)
            raise
        return envelope

    def open_steps(self, delivery_id: str, topic: str) -> None:
        if self.workflow is None:
            return
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        for spec in self.workflow.steps_triggered_by(topic):
            self.state.open(delivery_id, spec.name, now + int(spec.deadline_s * 1000), now, pipe=pipe)
        pipe.execute()

    def abandon_steps(self, delivery_id: str, topic: str) -> None:
        """The trigger was not accepted: withdraw its pending steps, so the supervisor never
        chases a delivery nobody accepted."""
        if self.workflow is None:
            return
        for spec in self.workflow.steps_triggered_by(topic):
            self.state.abandon(delivery_id, spec.name)

    def publish_all(self, events: list[tuple[Event, str]], timeout_s: float = 30.0) -> None:
        """Publish many and wait until every one is durable; raise if any is not."""
        failures: list[str] = []

        def record(err: KafkaError | None, _: Message | None) -> None:
            if err is not None:
                failures.append(str(err))

        for event, event_id in events:
            self.publish(event, event_id, on_delivery=record)
        self.flush(timeout_s)
        if failures:
            raise PublishError(f"{len(failures)} events were not accepted: {failures[0]}")

    def poll(self, timeout_s: float) -> int:
        return int(self.producer.poll(timeout_s))

    def flush(self, timeout_s: float) -> None:
        remaining = self.producer.flush(timeout_s)
        if remaining:
            raise PublishError(f"{remaining} events still unconfirmed after {timeout_s}s")
