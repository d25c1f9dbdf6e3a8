"""A subscriber added later, built for a given topic: one output per input on ``<topic>.out``
(replay tests count them: exactly the range, each once)."""

from __future__ import annotations

from datetime import UTC, datetime

from choreo.service import Context, Service
from schemas.models import DeliveryRequested, PackageReady


def build(topic: str, name: str | None = None) -> Service:
    service = Service(name or f"ops-subscriber-{topic}")

    @service.on(topic)
    def on_request(request: DeliveryRequested, ctx: Context) -> None:
        ctx.emit(PackageReady(delivery_id=request.delivery_id, package_id=f"p-{request.delivery_id}",
                              package_size=request.package_size, weight_kg=request.weight_kg,
                              ready_at=datetime.now(UTC)), topic=f"{topic}.out")

    return service
