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
