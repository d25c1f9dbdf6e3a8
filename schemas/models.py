"""pydantic mirrors of the ``.avsc`` contracts beside this file (checked by tests/unit/test_contracts.py)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from choreo.events import MAX_ITEMS, Event

HERE = Path(__file__).parent

PackageSize = Literal["SMALL", "MEDIUM", "LARGE"]


class Location(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    lat: float = Field(ge=-90, le=90)
    lon: float = Field(ge=-180, le=180)
    address: str = Field(min_length=1, max_length=500)


class DeliveryRequested(Event):
    schema_file: ClassVar[Path] = HERE / "DeliveryRequested.avsc"
    topic: ClassVar[str] = "delivery.requested"

    delivery_id: str
    owner_id: str
    pickup: Location
    dropoff: Location
    package_size: PackageSize
    weight_kg: float = Field(gt=0, le=1000)
    deadline: datetime | None = None
    reply_topic: str | None = None
    requested_at: datetime


class PackageReady(Event):
    schema_file: ClassVar[Path] = HERE / "PackageReady.avsc"
    topic: ClassVar[str] = "package.ready"

    delivery_id: str
    package_id: str
    package_size: str
    weight_kg: float
    ready_at: datetime


class PackageFailed(Event):
    schema_file: ClassVar[Path] = HERE / "PackageFailed.avsc"
    topic: ClassVar[str] = "package.failed"

    delivery_id: str
    reason: str
    detail: str = ""
    failed_at: datetime


class DroneScheduled(Event):
    schema_file: ClassVar[Path] = HERE / "DroneScheduled.avsc"
    topic: ClassVar[str] = "drone.scheduled"

    delivery_id: str
    drone_id: str
    scheduled_at: datetime


class DroneFailed(Event):
    schema_file: ClassVar[Path] = HERE / "DroneFailed.avsc"
    topic: ClassVar[str] = "drone.failed"

    delivery_id: str
    reason: str
    detail: str = ""
    failed_at: datetime


class DeliveryShipped(Event):
    schema_file: ClassVar[Path] = HERE / "DeliveryShipped.avsc"
    topic: ClassVar[str] = "delivery.shipped"

    delivery_id: str
    package_id: str
    drone_id: str
    shipped_at: datetime


class DeliveryFailed(Event):
    schema_file: ClassVar[Path] = HERE / "DeliveryFailed.avsc"
    topic: ClassVar[str] = "delivery.failed"

    delivery_id: str
    reason: str
    detail: str = ""
    failed_step: str
    compensate: list[str] = Field(default=[], max_length=MAX_ITEMS)
    failed_at: datetime


class PackageCancelled(Event):
    schema_file: ClassVar[Path] = HERE / "PackageCancelled.avsc"
    topic: ClassVar[str] = "package.cancelled"

    delivery_id: str
    package_id: str | None = None
    cancelled_at: datetime


class DroneReleased(Event):
    schema_file: ClassVar[Path] = HERE / "DroneReleased.avsc"
    topic: ClassVar[str] = "drone.released"

    delivery_id: str
    drone_id: str | None = None
    released_at: datetime


# the contracts beside this file; the runtime's own are ``choreo.runtime_events.RUNTIME_EVENTS``
ALL_EVENTS: tuple[type[Event], ...] = (
    DeliveryRequested, PackageReady, PackageFailed, DroneScheduled, DroneFailed,
    DeliveryShipped, DeliveryFailed, PackageCancelled, DroneReleased,
)
