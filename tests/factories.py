"""Valid events for tests."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from schemas.models import DeliveryRequested, Location


def delivery_request(delivery_id: str | None = None, weight_kg: float = 1.0, **overrides: Any) -> DeliveryRequested:
    fields: dict[str, Any] = dict(
        delivery_id=delivery_id or str(uuid.uuid4()), owner_id="owner-1",
        pickup=Location(lat=52.52, lon=13.40, address="Alexanderplatz 1"),
        dropoff=Location(lat=52.50, lon=13.37, address="Potsdamer Platz 2"),
        package_size="SMALL", weight_kg=weight_kg, requested_at=datetime.now(UTC),
    )
    fields.update(overrides)
    return DeliveryRequested(**fields)


def request_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "owner_id": "owner-1",
        "pickup": {"lat": 52.52, "lon": 13.40, "address": "Alexanderplatz 1"},
        "dropoff": {"lat": 52.50, "lon": 13.37, "address": "Potsdamer Platz 2"},
        "package_size": "SMALL",
        "weight_kg": 1.5,
    }
    body.update(overrides)
    return body


class KafkaMessage:
    """What the runtime asks of a consumed Kafka message, for fake consumers and producers:
    one record, its value ``size`` bytes unless given."""

    def __init__(self, offset: int, size: int = 0, *, topic: str = "t", partition: int = 0, key: bytes = b"k",
                 value: bytes | None = None, headers: list[tuple[str, bytes | None]] | None = None,
                 timestamp_ms: int = 0) -> None:
        self._offset, self._topic, self._partition, self._key = offset, topic, partition, key
        self._value = b"v" * size if value is None else value
        self._headers, self._timestamp_ms = headers or [], timestamp_ms

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes:
        return self._value

    def timestamp(self) -> tuple[int, int]:
        return 0, self._timestamp_ms

    def headers(self) -> list[tuple[str, bytes | None]]:
        return self._headers
