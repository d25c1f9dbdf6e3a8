"""Version 2 of the package service, for the rolling-upgrade test.

What changed from ``consumers.package`` (version 1), as a real release would change it:
- ``PackageReady`` and ``PackageCancelled`` carry a new optional field, ``label`` (their
  contracts beside this file, registered as the next BACKWARD-compatible version);
- the package record gains two fields: ``label`` and ``rev`` (the version that last wrote
  it). A cancel reads the record whichever version wrote it, and answers its label if it
  has one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

from choreo import Context, Effects, Retryable, UndoRequested, derived_id
from consumers import package as v1
from consumers.agents import PermanentFailure
from schemas import models as v1_events
from schemas.models import DeliveryRequested, PackageFailed

HERE = Path(__file__).parent
REV = "2"


class PackageReady(v1_events.PackageReady):
    schema_file: ClassVar[Path] = HERE / "PackageReady.avsc"

    label: str | None = None


class PackageCancelled(v1_events.PackageCancelled):
    schema_file: ClassVar[Path] = HERE / "PackageCancelled.avsc"

    label: str | None = None


def label_of(package_id: str) -> str:
    return f"PKG-{package_id[:8].upper()}"


def prepare(request: DeliveryRequested, ctx: Context) -> Effects[PackageReady | PackageFailed]:
    try:
        v1.warehouse.call("prepare", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        return PackageFailed(delivery_id=request.delivery_id, reason="WAREHOUSE_REFUSED",
                             detail=str(refusal), failed_at=datetime.now(UTC))
    package_id = derived_id(request.delivery_id, "package")
    yield v1.packages.put(request.delivery_id, package_id=package_id, size=request.package_size,
                          weight_kg=request.weight_kg, status="ready", label=label_of(package_id), rev=REV)
    return PackageReady(delivery_id=request.delivery_id, package_id=package_id,
                        package_size=request.package_size, weight_kg=request.weight_kg,
                        ready_at=datetime.now(UTC), label=label_of(package_id))


def cancel(request: UndoRequested, ctx: Context) -> Effects[PackageCancelled]:
    try:
        v1.warehouse_cancel.call("cancel", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        raise Retryable(f"cancel refused: {refusal}") from refusal
    package_id = yield v1.packages.update(request.delivery_id, answer="package_id", status="cancelled", rev=REV)
    label = yield v1.packages.update(request.delivery_id, answer="label")
    return PackageCancelled(delivery_id=request.delivery_id, package_id=package_id or None,
                            cancelled_at=datetime.now(UTC), label=label or None)
