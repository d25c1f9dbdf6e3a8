"""Package service: prepares the package of each requested delivery; cancels it on failure.

Preparing is an idempotent upsert keyed by the delivery id, so a redelivered request or a
requeued step finds the same package.
"""

from __future__ import annotations

from datetime import UTC, datetime

from choreo import Context, Effects, Retryable, Service, UndoRequested, derived_id
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryRequested, PackageCancelled, PackageFailed, PackageReady,
)

service = Service("package")
warehouse = Agent.from_env("warehouse")
warehouse_cancel = Agent.from_env("warehouse-cancel")  # compensation fails on its own terms

# a shipped delivery's package is out of the warehouse: its record goes with the delivery
packages = service.record("pkg", ttl_s=24 * 3600, released_with_delivery=True)
packages.rebuilt_from(PackageReady, lambda ready: {
    "package_id": ready.package_id, "size": ready.package_size, "weight_kg": ready.weight_kg,
    "status": "ready"})
packages.rebuilt_from(PackageCancelled, lambda _: {"status": "cancelled"})


@service.on("delivery.requested", step="package", deadline_s=30,
            produces=[PackageReady, PackageFailed])
def prepare(request: DeliveryRequested, ctx: Context) -> Effects[PackageReady | PackageFailed]:
    try:
        warehouse.call("prepare", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        return PackageFailed(delivery_id=request.delivery_id, reason="WAREHOUSE_REFUSED",
                             detail=str(refusal), failed_at=datetime.now(UTC))
    package_id = derived_id(request.delivery_id, "package")
    yield packages.put(request.delivery_id, package_id=package_id, size=request.package_size,
                       weight_kg=request.weight_kg, status="ready")
    return PackageReady(delivery_id=request.delivery_id, package_id=package_id,
                        package_size=request.package_size, weight_kg=request.weight_kg,
                        ready_at=datetime.now(UTC))


@service.undo("package", step="cancel_package", confirmed_by=PackageCancelled)
def cancel(request: UndoRequested, ctx: Context) -> Effects[PackageCancelled]:
    try:
        warehouse_cancel.call("cancel", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:  # compensation must be retried, then alerted on
        raise Retryable(f"cancel refused: {refusal}") from refusal
    package_id = yield packages.update(request.delivery_id, answer="package_id", status="cancelled")
    return PackageCancelled(delivery_id=request.delivery_id, package_id=package_id,
                            cancelled_at=datetime.now(UTC))
