"""A service whose behaviour the runtime tests steer through the request's weight:

* 13 kg: the handler rejects the event (non-retryable) → dead letter;
* 11 kg: the handler yields its event instead of an effect (a bug in a rule) → dead letter;
* 17 kg: the handler raises what is neither a retry nor a refusal (a bug, or an input its
  rule does not refuse) → dead letter;
* 19 kg: its output names a package Avro cannot write (a string that is not Unicode) → dead
  letter;
* 23 kg: its output names a package of 600,000 characters, more than a consumer takes →
  dead letter;
* 7 kg: a transient failure on the first try, then success (in-process retry);
* 9 kg: always transient → retries exhausted → reported to the recovery topic;
* 3 kg: transient on its first three tries, across batches (a flaky remote call);
* 42 kg: the first time, hang after the Redis effect so the test can kill -9 mid-batch;
* anything else: an idempotent Redis counter effect (yielded: batched with the batch's
  other effects), then a derived event.
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

from choreo.effects import OnceEffect
from choreo.errors import Rejected, Retryable
from choreo.service import Context, Effects, Service
from schemas.models import DeliveryRequested, PackageReady

TOPIC = os.environ["PROBE_TOPIC"]
service = Service(f"probe-{TOPIC}", batch_size=int(os.environ.get("PROBE_BATCH", "500")),
                  max_hops=int(os.environ.get("PROBE_MAX_HOPS", "20")))

COUNT = OnceEffect("count", """
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return 'counted'
""")


@service.on(TOPIC, step="probe", deadline_s=float(os.environ.get("PROBE_DEADLINE_S", "30")))
def handle(request: DeliveryRequested, ctx: Context) -> Effects[None]:
    if request.weight_kg == 13:
        raise Rejected("13 kg is unlucky")
    if request.weight_kg == 11:
        yield request  # type: ignore[misc]  # the bug this weight stands for
    if request.weight_kg == 17:
        raise ValueError("year 10000 is out of range")  # what a rule's library raised on a forged input
    if request.weight_kg == 7 and ctx.try_no == 1:
        raise Retryable("first try fails")
    if request.weight_kg == 9:
        raise Retryable("always fails")
    if request.weight_kg == 3 and ctx.redis.incr(f"probe:{TOPIC}:flaky:{request.delivery_id}") <= 3:
        raise Retryable("flaky")
    counted = yield ctx.effect(COUNT, keys=[f"probe:{TOPIC}:effects"], args=[request.delivery_id])
    assert counted == "counted"
    if request.weight_kg == 42 and ctx.redis.set(f"probe:{TOPIC}:hung", 1, nx=True):
        ctx.redis.set(f"probe:{TOPIC}:hanging", 1)
        time.sleep(120)
    tail = {19: "\ud800", 23: "p" * 600_000}.get(int(request.weight_kg), "")
    ctx.emit(PackageReady(delivery_id=request.delivery_id, package_id=f"p-{request.delivery_id}{tail}",
                          package_size=request.package_size, weight_kg=request.weight_kg,
                          ready_at=datetime.now(UTC)), topic=f"{TOPIC}.out")
