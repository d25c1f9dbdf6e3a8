"""The reply topic a request names gets exactly one outcome per delivery, on the real stack
(shipped, failed, or compensated once a failure's undos are confirmed), and a reply topic that the policy refuses (forged at a later hop, outside the prefix, absent)
is never written to."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from choreo import topology
from choreo.envelope import Envelope
from choreo.kafka import admin, ensure_topics
from choreo.publisher import Publish, Publisher
from choreo.runtime_events import DeliveryOutcome
from choreo.serde import Decoder, registry_client
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryFailed
from tests.factories import delivery_request
from tests.helpers import ServiceProcess, read_topic, wait_for
from tests.integration.test_supervisor import BUDGET, DEADLINE_S, World, world  # noqa: F401 (fixture)
from tests.pipeline import Pipeline, of, submit, wait_terminal
from tests.services import sup_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def topics(stack: None) -> None:
    topology.create(WORKFLOW)


def outcomes(topic: str) -> list[tuple[str, DeliveryOutcome]]:
    decode = Decoder(DeliveryOutcome, topic, registry_client())
    return [((r.key or b"").decode(), decode(r.value)) for r in read_topic(topic)]


def decided(ids: set[str]) -> dict[str, str]:
    """Each delivery's outcome as its deciding event tells it: a failure that completed a
    step with an undo is compensated (the pipeline's undos succeed), any other is failed."""
    found = {(r.key or b"").decode(): "shipped" for r in of(read_topic("delivery.shipped"), ids)}
    decode = Decoder(DeliveryFailed, "delivery.failed", registry_client())
    for record in of(read_topic("delivery.failed"), ids):
        undo = set(decode(record.value).compensate) & set(WORKFLOW.compensations())
        found[(record.key or b"").decode()] = "compensated" if undo else "failed"
    return found


def test_each_delivery_gets_one_outcome_across_a_killed_delivery_service(unique: str) -> None:
    reply = f"replies.test.{unique}"
    ensure_topics([reply], partitions=3)
    running = Pipeline().start()
    try:
        requests = [delivery_request(reply_topic=reply) for _ in range(60)]
        requests += [delivery_request(weight_kg=99.0, reply_topic=reply) for _ in range(5)]  # no drone fits
        ids = set(submit(requests[:30]))
        time.sleep(1.5)
        delivery = next(p for p in running.procs if p.ref == "consumers.delivery:service")
        delivery.kill()  # kill -9, maybe mid-transaction: its batch is replayed by the next one
        ids |= set(submit(requests[30:]))
        running.procs.append(ServiceProcess("consumers.delivery:service", instance="1").start())
        counts = wait_terminal(ids, timeout_s=180)
        assert set(counts.values()) == {1}
        truth = decided(ids)
        got = wait_for(lambda: len(o := outcomes(reply)) >= len(ids) and o, timeout_s=30,
                       what="an outcome for every delivery")
        time.sleep(1.0)
        got = outcomes(reply)
        per_delivery = Counter(key for key, _ in got)
        assert set(per_delivery) == ids and set(per_delivery.values()) == {1}
        for key, outcome in got:
            assert outcome.delivery_id == key and outcome.outcome == truth[key]
        # no drone carries 99 kg: the ready package is cancelled, and only then is it told
        heavy = {r.delivery_id for r in requests[-5:]}
        compensated = {k: o for k, o in got if k in heavy}
        assert {o.outcome for o in compensated.values()} == {"compensated"}
        assert all(o.compensate == ["package"] and o.reason and o.event_type == "CompensationRecord"
                   for o in compensated.values())
        assert all(o.reason for _, o in got if o.outcome != "shipped")
        deciding = {"shipped": "DeliveryShipped", "failed": "DeliveryFailed", "compensated": "CompensationRecord"}
        assert all(o.event_type == deciding[o.outcome] and o.trace_id for _, o in got)
    finally:
        running.kill()


def test_a_forged_or_disallowed_reply_topic_is_refused_and_nothing_is_written(unique: str) -> None:
    allowed = f"replies.ok.{unique}"
    absent = f"replies.absent.{unique}"  # allowed by name, never created
    ensure_topics([allowed], partitions=3)
    publisher = Publisher("test-ingestion", WORKFLOW)
    control, forged, missing = (delivery_request() for _ in range(3))
    items = []
    for request, reply_to in ((control, allowed), (forged, "delivery.requested"), (missing, absent)):
        envelope = Envelope.first(str(uuid.uuid4()), request.delivery_id, "DeliveryRequested",
                                  "test-ingestion", reply_to=reply_to, owner="owner-1")
        items.append(Publish(request, envelope.event_id, envelope=envelope))
    requested_before = len(read_topic("delivery.requested"))
    assert not any(isinstance(r, Exception) for r in publisher.publish_many(items))
    publisher.flush(30)
    running = Pipeline().start()
    try:
        ids = {control.delivery_id, forged.delivery_id, missing.delivery_id}
        wait_terminal(ids, timeout_s=120)
        wait_for(lambda: {k for k, _ in outcomes(allowed)} == {control.delivery_id}, timeout_s=30,
                 what="the allowed reply")
        # the forged topic got nothing more than the requests themselves (a feedback loop refused)
        assert len(of(read_topic("delivery.requested"), {forged.delivery_id})) == 1
        assert len(read_topic("delivery.requested")) >= requested_before + 3
        listed = admin().list_topics(timeout=10).topics
        assert absent not in listed  # never created, never produced to
        log = next(p for p in running.procs if p.ref == "consumers.delivery:service").log_file.read_text(
            errors="replace")
        refused = [json.loads(line) for line in log.splitlines()
                   if '"reply.refused"' in line and any(d in line for d in ids)]
        why: dict[str, Any] = {e["delivery_id"]: e["why"] for e in refused}
        assert "reply prefix" in why[forged.delivery_id] and "no such topic" in why[missing.delivery_id]
        assert all(p.alive() for p in running.procs)  # refused, not crashed
    finally:
        running.kill()


def reply_topic(world: World) -> str:
    """This test's reply topic, created before any service may look it up (a service that
    finds no topic believes so for a while)."""
    topic = f"replies.sup.{world.prefix.strip('.').replace('.', '-')}"
    ensure_topics([topic], partitions=3)
    return topic


def request_with_reply(world: World, reply: str, n: int = 2) -> dict[str, str]:
    """``n`` requests naming ``reply``, on the world's pipeline: their trace ids by delivery id."""
    flow = sup_pipeline.workflow(world.prefix, sup_pipeline.build(world.prefix, DEADLINE_S, BUDGET, 0))
    publisher = Publisher("sup-test", workflow=flow, redis_client=world.redis)
    traces = {d: publisher.publish(delivery_request(d, reply_topic=reply), str(uuid.uuid4()),
                                   topic=world.topic("delivery.requested")).trace_id
              for d in (str(uuid.uuid4()) for _ in range(n))}
    publisher.flush(30)
    return traces


def replies(topic: str, n: int, timeout_s: float) -> list[tuple[str, DeliveryOutcome]]:
    """The outcomes on ``topic`` once there are ``n``, and a moment more (for any extra)."""
    wait_for(lambda: len(outcomes(topic)) >= n, timeout_s=timeout_s, what="the replies")
    time.sleep(1.0)
    return outcomes(topic)


def test_a_requeued_step_still_replies_once(world: World) -> None:
    """A drone step killed mid-work is requeued by the supervisor: the requeue carries the
    reply topic on, and the delivery that ships after it replies once."""
    reply = reply_topic(world)
    world.start("package")
    world.start("delivery")
    world.supervisor()
    drone = world.start("drone", SUP_SLOW_FIRST_DRONE_MS="60000")  # hangs in its first attempt
    ids = list(request_with_reply(world, reply))
    wait_for(lambda: all(world.state(d).get("drone.status") == "processing" for d in ids),
             timeout_s=30, what="drone steps in progress")
    drone.kill()
    wait_for(lambda: all(world.retries("drone-scheduler").get(d) for d in ids), timeout_s=30,
             what="the stuck steps requeued")
    world.start("drone", instance="1")
    wait_for(lambda: set(ids) <= set(world.by_delivery("delivery.shipped")), timeout_s=45,
             what="every delivery shipped")
    got = replies(reply, len(ids), timeout_s=30)
    assert sorted(k for k, _ in got) == sorted(ids)
    assert {o.outcome for _, o in got} == {"shipped"}


def test_a_delivery_the_supervisor_fails_still_replies_once(world: World) -> None:
    """A drone step that fails every try spends its budget: the supervisor fails the delivery.
    Its failure continues the request's story (read from the step's input), so the outcome
    still reaches the reply topic, once, in the request's trace."""
    reply = reply_topic(world)
    world.start("package")
    world.start("drone", AGENT_DISPATCH_TRANSIENT_RATE="1.0")
    world.start("delivery")
    world.supervisor()
    traces = request_with_reply(world, reply)
    ids = list(traces)
    failed = wait_for(lambda: (r := world.by_delivery("delivery.failed")) and set(ids) <= set(r) and r,
                      timeout_s=120, what="the deliveries failed by the supervisor")
    for d in ids:
        assert failed[d][0].header("producer") == world.name  # the supervisor decided it
        assert (failed[d][0].envelope or Envelope("", "")).trace_id == traces[d]
    got = replies(reply, len(ids), timeout_s=30)
    assert sorted(k for k, _ in got) == sorted(ids)
    # its ready package was cancelled: told compensated, in the request's trace, once
    assert {o.outcome for _, o in got} == {"compensated"} and all(o.compensate == ["package"] for _, o in got)
    assert {o.trace_id for _, o in got} == set(traces.values())
    assert all(o.reason == "RETRY_BUDGET_SPENT" for _, o in got)


def test_a_compensation_that_fails_for_good_replies_failed_once(world: World) -> None:
    """The drone is refused (the delivery fails, its ready package is to be cancelled) and the
    warehouse refuses every cancel: the undo fails past its budget and the submitter is told
    failed, once, not compensated; and nothing is told before the compensation ended."""
    reply = reply_topic(world)
    world.start("package", AGENT_WAREHOUSE_CANCEL_PERMANENT_RATE="1.0")
    world.start("drone", AGENT_DISPATCH_PERMANENT_RATE="1.0")
    world.start("delivery")
    world.supervisor()
    ids = list(request_with_reply(world, reply))
    wait_for(lambda: all(world.state(d).get("package.status") == "compensating" for d in ids),
             timeout_s=45, what="the cancels asked")
    assert outcomes(reply) == []  # decided failed, but its compensation has not ended
    got = replies(reply, len(ids), timeout_s=60)
    assert sorted(k for k, _ in got) == sorted(ids)
    assert {(o.outcome, o.reason, o.event_type) for _, o in got} == {
        ("failed", "COMPENSATION_FAILED", "CompensationRecord")}
    assert all(world.state(d).get("package.status") == "compensation_failed" for d in ids)
