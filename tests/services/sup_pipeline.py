"""The pipeline's own business rules, run on one test's private topics with short deadlines.

The supervisor tests need the real package, drone-scheduler and delivery rules, but on
topics no other test (or demo) reads, with deadlines of seconds rather than 30 s, and with a
few failure knobs. So this module registers the *same handler functions* from
``consumers.*`` on prefixed topics (``SUP_PREFIX``), and re-routes what they emit onto the
prefixed topics too. Knobs (environment):

* ``SUP_DEADLINE_S`` (every step), ``SUP_BUDGET`` (each service's retry budget),
  ``SUP_IN_PROCESS_RETRIES``;
* ``SUP_SLOW_FIRST_<ROLE>_MS``: the first attempt of that role's forward step sleeps this
  long before working (a late answer after the supervisor gave the step away); the drone's
  once its drone is held (its reservation rides in the begin, as in ``consumers``).
  Failures come from the agents' own knobs (``AGENT_<NAME>_TRANSIENT_RATE``...).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from choreo.join import Joined, JoinFailed
from choreo.service import Context, Service
from choreo.workflow import Workflow
from tests.services.routing import private_workflow, routed
from consumers import delivery as delivery_rules
from consumers import drone_scheduler as drone_rules
from consumers import package as package_rules
from choreo.runtime_events import UndoRequested
from schemas.models import DeliveryRequested, DroneReleased, PackageCancelled

MODULE = "tests.services.sup_pipeline"
ROLES = ("package", "drone", "delivery")


def _slow_first(role: str) -> Callable[[Any, Context], None] | None:
    ms = float(os.environ.get(f"SUP_SLOW_FIRST_{role.upper()}_MS", "0"))
    if not ms:
        return None

    def sleep(_: Any, ctx: Context) -> None:
        if ctx.attempt == 1:
            time.sleep(ms / 1000)

    return sleep


def build(prefix: str, deadline_s: float, budget: int, in_process: int) -> dict[str, Service]:
    """The three services of the pipeline on ``prefix``-ed topics."""
    t = lambda name: prefix + name  # noqa: E731
    opts: dict[str, Any] = {"retry_budget": budget, "in_process_retries": in_process}
    package = Service(t("package"), **opts)
    package.on(t("delivery.requested"), step="package", deadline_s=deadline_s)(
        routed(package_rules.prepare, DeliveryRequested, prefix, _slow_first("package")))
    package.undo("package", step="cancel_package", deadline_s=deadline_s, confirmed_by=PackageCancelled,
                 prefix=prefix)(routed(package_rules.cancel, UndoRequested, prefix))

    drone = Service(t("drone-scheduler"), **opts)
    drone.pool(drone_rules.fleet)
    drone.on(t("delivery.requested"), step="drone", deadline_s=deadline_s, first_op_in_begin=True)(
        routed(drone_rules.reserve, DeliveryRequested, prefix, after_first_op=_slow_first("drone")))
    drone.undo("drone", step="release_drone", deadline_s=deadline_s, confirmed_by=DroneReleased,
               prefix=prefix)(routed(drone_rules.release, UndoRequested, prefix))

    delivery = Service(t("delivery"), **opts)
    join = delivery.join("delivery", parts=delivery_rules.PARTS, outcomes=delivery_rules.OUTCOMES, deadline_s=deadline_s,
                         retention_s=int(os.environ.get("SUP_RETENTION_S", "3600")), prefix=prefix)
    join.on_complete(routed(delivery_rules.ship, Joined, prefix))
    join.on_failure(routed(delivery_rules.refuse, JoinFailed, prefix))
    return {"package": package, "drone": drone, "delivery": delivery}


OUTPUTS = ("package.ready", "package.failed", "package.cancelled", "drone.scheduled", "drone.failed",
           "drone.released", "delivery.shipped", "delivery.failed")


def output_topics(prefix: str) -> list[str]:
    """What the re-routed rules publish to (their declarations name the unprefixed topics)."""
    return [prefix + name for name in OUTPUTS]


def workflow(prefix: str, services: dict[str, Service] | None = None) -> Workflow:
    return private_workflow(f"sup-{prefix}", MODULE, ROLES, prefix, services)


PREFIX = os.environ.get("SUP_PREFIX", "t.sup.unset.")
_services = build(PREFIX, float(os.environ.get("SUP_DEADLINE_S", "2")),
                  int(os.environ.get("SUP_BUDGET", "8")),
                  int(os.environ.get("SUP_IN_PROCESS_RETRIES", "0")))
package = _services["package"]
drone = _services["drone"]
delivery = _services["delivery"]
WORKFLOW = workflow(PREFIX, _services)
