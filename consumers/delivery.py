"""Delivery service: the fan-in. It acts once both the package and the drone are ready.

Each result is recorded in the delivery's Redis hash by one atomic script, which also
decides, exactly once, whether to ship or fail — in whatever order the results arrive and
on whichever instance sees them. A result for a delivery already decided is recorded and
ignored. Failure waits for both results, so the compensation list names every step that
completed, newest first.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime

from choreo.effects import OnceEffect
from choreo.envelope import derived_id
from choreo.service import Context, Effects, Service
from choreo.state import delivery_key
from consumers.agents import Agent, PermanentFailure
from schemas.models import (
    DeliveryFailed, DeliveryShipped, DroneFailed, DroneScheduled, PackageFailed, PackageReady,
)

service = Service("delivery")
flight = Agent.from_env("flight")
DEADLINE_S = 60.0
# a decided delivery's state stays this long (compensation and status reads), then expires:
# Kafka stays the record, and rebuild-state can restore it
RETENTION_S = int(os.environ.get("CHOREO_RETENTION_S", "3600"))
OUTCOMES = (DeliveryShipped, DeliveryFailed)

RECORD_RESULT = OnceEffect("record_result", """
local kind, ok, value = ARGV[1], ARGV[2], ARGV[3]
local field = 'fanin.' .. kind
if redis.call('HEXISTS', KEYS[1], field) == 0 then
  redis.call('HSET', KEYS[1], field, ok .. ':' .. value)
  if ok == 'ok' then
    redis.call('HSET', KEYS[1], 'fanin.order', kind .. ',' .. (redis.call('HGET', KEYS[1], 'fanin.order') or ''))
  end
end
if redis.call('HEXISTS', KEYS[1], 'outcome') == 1 then return cjson.encode({decision = 'late'}) end
local package = redis.call('HGET', KEYS[1], 'fanin.package')
local drone = redis.call('HGET', KEYS[1], 'fanin.drone')
if not (package and drone) then return cjson.encode({decision = 'wait'}) end
local order = redis.call('HGET', KEYS[1], 'fanin.order') or ''
if string.sub(package, 1, 3) == 'ok:' and string.sub(drone, 1, 3) == 'ok:' then
  redis.call('HSET', KEYS[1], 'outcome', 'shipped')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return cjson.encode({decision = 'ship', package = string.sub(package, 4), drone = string.sub(drone, 4)})
end
redis.call('HSET', KEYS[1], 'outcome', 'failed')
redis.call('EXPIRE', KEYS[1], ARGV[4])
local failed, reason = 'package', package
if string.sub(package, 1, 3) == 'ok:' then failed, reason = 'drone', drone end
return cjson.encode({decision = 'fail', failed = failed, reason = string.sub(reason, 6), order = order})
""")

FLIGHT_REFUSED = OnceEffect("flight_refused", """
redis.call('HSET', KEYS[1], 'outcome', 'failed')
return 'failed'
""")


@service.on("package.ready", step="delivery", deadline_s=DEADLINE_S, produces=OUTCOMES)
def package_ready(result: PackageReady, ctx: Context) -> Effects[None]:
    yield from decide(ctx, "package", "ok", result.package_id)


@service.on("drone.scheduled", step="delivery", deadline_s=DEADLINE_S, produces=OUTCOMES)
def drone_scheduled(result: DroneScheduled, ctx: Context) -> Effects[None]:
    yield from decide(ctx, "drone", "ok", result.drone_id)


@service.on("package.failed", step="delivery", deadline_s=DEADLINE_S, produces=OUTCOMES)
def package_failed(result: PackageFailed, ctx: Context) -> Effects[None]:
    yield from decide(ctx, "package", "fail", result.reason)


@service.on("drone.failed", step="delivery", deadline_s=DEADLINE_S, produces=OUTCOMES)
def drone_failed(result: DroneFailed, ctx: Context) -> Effects[None]:
    yield from decide(ctx, "drone", "fail", result.reason)


def decide(ctx: Context, kind: str, ok: str, value: str) -> Effects[None]:
    """Record one result; ship or fail once both are in (a replay gets the same decision)."""
    raw = yield ctx.effect(RECORD_RESULT, keys=[delivery_key(ctx.delivery_id)],
                   args=[kind, ok, value, RETENTION_S])
    decision = json.loads(raw or "{}")
    now = datetime.now(UTC)
    if decision.get("decision") == "ship":
        try:
            flight.call("depart", ctx.call_id, ctx.try_label)
        except PermanentFailure as refusal:
            yield ctx.effect(FLIGHT_REFUSED, keys=[delivery_key(ctx.delivery_id)])
            fail(ctx, "FLIGHT_REFUSED", str(refusal), "delivery", ["drone", "package"])
            return
        ctx.emit(
            DeliveryShipped(delivery_id=ctx.delivery_id, package_id=decision["package"],
                            drone_id=decision["drone"], shipped_at=now),
            event_id=derived_id(ctx.delivery_id, "delivery.shipped"),
        )
    elif decision.get("decision") == "fail":
        completed = [step for step in decision["order"].split(",") if step]
        fail(ctx, decision["reason"], f"{decision['failed']} step failed", decision["failed"], completed)
    elif decision.get("decision") == "wait":
        ctx.keep_open()  # the step is done only when both halves are in
    elif decision.get("decision") == "late":
        ctx.log.info("result.late", kind=kind)


def fail(ctx: Context, reason: str, detail: str, failed_step: str, compensate: list[str]) -> None:
    ctx.emit(
        DeliveryFailed(delivery_id=ctx.delivery_id, reason=reason, detail=detail,
                       failed_step=failed_step, compensate=compensate, failed_at=datetime.now(UTC)),
        event_id=derived_id(ctx.delivery_id, "delivery.failed"),
    )
