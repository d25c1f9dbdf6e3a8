"""Deliberately broken topologies for the topology check (``choreo ops topology check``).

* ``ORPHAN``: a service consumes a topic that no one produces;
* ``SPLIT_FAN_IN``: a fan-in step joins two topics that the test creates with different
  partition counts (3 and 6), so the halves of a pair would land on different partitions.
"""

from __future__ import annotations

from choreo.service import Context, Service
from choreo.workflow import Workflow
from schemas.models import DroneScheduled, PackageReady

FAN_LEFT, FAN_RIGHT = "t.ops.split.left", "t.ops.split.right"

orphan = Service("ops-orphan")
split = Service("ops-split")


@orphan.on("t.ops.nobody.produces")
def lonely(event: PackageReady, ctx: Context) -> None:
    del event, ctx


@split.on(FAN_LEFT, step="join")
def left(event: PackageReady, ctx: Context) -> None:
    del event, ctx


@split.on(FAN_RIGHT, step="join")
def right(event: DroneScheduled, ctx: Context) -> None:
    del event, ctx


ORPHAN = Workflow("orphan", ["tests.services.ops_broken:orphan"])
SPLIT_FAN_IN = Workflow("split", ["tests.services.ops_broken:split"],
                        extra_producers={FAN_LEFT: "test", FAN_RIGHT: "test"})
