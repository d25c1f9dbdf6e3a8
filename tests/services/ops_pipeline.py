"""The pipeline's real business rules on one test's private topics and consumer groups.

The ops tests (rebuild after FLUSHALL, trace of a compensated delivery) must not share the
real topics and groups with whatever else runs on the shared stack (a demo, another
test's pipeline): those instances would take partitions of the same groups. So this module
registers the *same handler functions* from ``consumers.*`` on ``OPS_PREFIX``-ed topics and
service names, and re-routes what they emit onto the prefixed topics.

``OPS_FAIL_FIRST_<ROLE>=1`` makes the first attempt of that role's forward step fail with a
transient error on every try (so the step is reported, and requeued by a supervisor run
against this pipeline, whose attempt 2 then works).

``OPS_PACKAGE_VERSION=2`` runs the package service's next version (``tests.services.v2``);
``OPS_PACKAGE_PUTS_OFF_KG=<kg>`` makes the package service answer a parcel of exactly that
weight with a transient error, every time, so another instance takes it from the retry topic
(the rolling-upgrade test hands steps from one version to the other so).

``OPS_DEADLINE_S`` is the steps' deadline (30 s; the join's is twice it): a test that waits
for a step to be failed past its deadlines sets it shorter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from choreo.errors import Retryable
from choreo.join import Joined, JoinFailed
from choreo.runtime_events import UndoRequested
from choreo.service import Context, Service
from choreo.workflow import Workflow
from tests.services import v2 as package_v2
from tests.services.routing import private_workflow, routed
from consumers import delivery as delivery_rules
from consumers import drone_scheduler as drone_rules
from consumers import notifier as notifier_rules
from consumers import package as package_rules
from schemas.models import (
    DeliveryFailed, DeliveryRequested, DeliveryShipped, DroneFailed, DroneReleased, DroneScheduled,
    PackageCancelled, PackageFailed, PackageReady,
)

MODULE = "tests.services.ops_pipeline"
ROLES = ("package", "drone", "delivery", "notifier")


def _fail_first(role: str) -> Callable[[Any, Context], None] | None:
    if os.environ.get(f"OPS_FAIL_FIRST_{role.upper()}", "") not in ("1", "true"):
        return None

    def fail(_: Any, ctx: Context) -> None:
        if ctx.attempt == 1:
            raise Retryable(f"{role} attempt 1 fails (OPS_FAIL_FIRST_{role.upper()})")

    return fail


def _puts_off(weight_kg: str, then: Callable[[Any, Context], None] | None) -> Callable[[Any, Context], None] | None:
    if not weight_kg:
        return then

    def put_off(request: Any, ctx: Context) -> None:
        if request.weight_kg == float(weight_kg):
            raise Retryable(f"parcels of {weight_kg} kg are left to another instance (OPS_PACKAGE_PUTS_OFF_KG)")
        if then is not None:
            then(request, ctx)

    return put_off


def build(prefix: str, batch: int = 500, deadline_s: float | None = None) -> dict[str, Service]:
    t = lambda name: prefix + name  # noqa: E731
    if deadline_s is None:
        deadline_s = float(os.environ.get("OPS_DEADLINE_S", "30"))
    # OPS_PACKAGE_VERSION=2: the package service's next version (the rolling-upgrade test)
    v2 = os.environ.get("OPS_PACKAGE_VERSION", "1") == "2"
    ready, cancelled = (package_v2.PackageReady, package_v2.PackageCancelled) if v2 else (PackageReady, PackageCancelled)
    rules: Any = package_v2 if v2 else package_rules
    package = Service(t("package"), batch_size=batch)
    package.records.append(package_rules.packages)
    package.on(t("delivery.requested"), step="package", deadline_s=deadline_s,
               produces=[ready, PackageFailed])(routed(rules.prepare, DeliveryRequested, prefix, _puts_off(
                   os.environ.get("OPS_PACKAGE_PUTS_OFF_KG", ""), _fail_first("package"))))
    package.undo("package", step="cancel_package", confirmed_by=cancelled,
                 prefix=prefix)(routed(rules.cancel, UndoRequested, prefix))
    drone = Service(t("drone-scheduler"), batch_size=batch)
    drone.pool(drone_rules.fleet)
    drone.on(t("delivery.requested"), step="drone", deadline_s=deadline_s, first_op_in_begin=True,
             produces=[DroneScheduled, DroneFailed])(routed(drone_rules.reserve, DeliveryRequested, prefix,
                                                              _fail_first("drone")))
    drone.undo("drone", step="release_drone", confirmed_by=DroneReleased,
               prefix=prefix)(routed(drone_rules.release, UndoRequested, prefix))
    delivery = Service(t("delivery"), batch_size=batch)
    join = delivery.join("delivery", parts=delivery_rules.PARTS, outcomes=delivery_rules.OUTCOMES,
                         deadline_s=2 * deadline_s,
                         prefix=prefix)
    join.on_complete(routed(delivery_rules.ship, Joined, prefix))
    join.on_failure(routed(delivery_rules.refuse, JoinFailed, prefix))
    notifier = Service(t("notifier"))
    notifier.records.append(notifier_rules.notified)
    notifier.on(t("delivery.shipped"))(routed(notifier_rules.notify, DeliveryShipped, prefix))
    return {"package": package, "drone": drone, "delivery": delivery, "notifier": notifier}


def workflow(prefix: str, services: dict[str, Service] | None = None) -> Workflow:
    return private_workflow(f"ops-{prefix}", MODULE, ROLES, prefix, services)


PREFIX = os.environ.get("OPS_PREFIX", "t.ops.unset.")
_services = build(PREFIX, int(os.environ.get("OPS_BATCH", "500")))
package = _services["package"]
drone = _services["drone"]
delivery = _services["delivery"]
notifier = _services["notifier"]
WORKFLOW = workflow(PREFIX, _services)
