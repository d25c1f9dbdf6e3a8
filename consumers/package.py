"""Package service: prepares the package of each requested delivery; cancels it on failure.

Preparing is an idempotent upsert keyed by the delivery id, so a redelivered request or a
requeued step finds the same package.
"""

from __future__ import annotations

from datetime import UTC, datetime

from choreo.effects import OnceEffect
from choreo.envelope import derived_id
from choreo.errors import Retryable
from choreo.service import Context, Effects, Service
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryFailed, DeliveryRequested, PackageCancelled, PackageFailed, PackageReady,
)

service = Service("package")
warehouse = Agent.from_env("warehouse")
warehouse_cancel = Agent.from_env("warehouse-cancel")  # compensation fails on its own terms

UPSERT_PACKAGE = OnceEffect("upsert_package", """
redis.call('HSET', KEYS[1], 'package_id', ARGV[1], 'size', ARGV[2], 'weight_kg', ARGV[3],
           'status', 'ready')
redis.call('EXPIRE', KEYS[1], ARGV[4])
return ARGV[1]
""")

CANCEL_PACKAGE = OnceEffect("cancel_package", """
local package_id = redis.call('HGET', KEYS[1], 'package_id')
if not package_id then return '' end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
return package_id
""")

RETENTION_S = 24 * 3600


@service.released_with_delivery  # a shipped delivery's package is out of the warehouse
def package_key(delivery_id: str) -> str:
    return f"pkg:{{{delivery_id}}}"


@service.on("delivery.requested", step="package", deadline_s=30,
            produces=[PackageReady, PackageFailed])
def prepare(request: DeliveryRequested, ctx: Context) -> Effects[PackageReady | PackageFailed]:
    try:
        warehouse.call("prepare", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:
        return PackageFailed(delivery_id=request.delivery_id, reason="WAREHOUSE_REFUSED",
                             detail=str(refusal), failed_at=datetime.now(UTC))
    package_id = yield ctx.effect(
        UPSERT_PACKAGE, keys=[package_key(request.delivery_id)],
        args=[derived_id(request.delivery_id, "package"), request.package_size,
              request.weight_kg, RETENTION_S],
    )
    assert package_id is not None
    return PackageReady(delivery_id=request.delivery_id, package_id=package_id,
                        package_size=request.package_size, weight_kg=request.weight_kg,
                        ready_at=datetime.now(UTC))


@service.on("delivery.failed", step="cancel_package", deadline_s=30, produces=[PackageCancelled])
def cancel(failure: DeliveryFailed, ctx: Context) -> Effects[PackageCancelled | None]:
    if "package" not in failure.compensate:
        return None
    try:
        warehouse_cancel.call("cancel", ctx.call_id, ctx.try_label)
    except PermanentFailure as refusal:  # compensation must be retried, then alerted on
        raise Retryable(f"cancel refused: {refusal}") from refusal
    package_id = yield ctx.effect(CANCEL_PACKAGE, keys=[package_key(failure.delivery_id)])
    return PackageCancelled(delivery_id=failure.delivery_id, package_id=package_id or None,
                            cancelled_at=datetime.now(UTC))
