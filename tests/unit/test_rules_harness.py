"""``choreo.testing`` itself: it answers only what the test scripted, reports what the
runner would act on, and fails clearly on what it cannot stand in for."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from choreo.answers import RELEASED, STALE
from choreo.effects import OnceEffect
from choreo.envelope import derived_id
from choreo.errors import DeadLetterReason, Rejected, Retryable
from choreo.keys import of_delivery
from choreo.pool import Pool, Reservation
from choreo.serde import Unwritable
from choreo.service import Context, Effects, Service
from choreo.testing import Asked, HarnessError, Raw, Records, complete, failed, run
from consumers import delivery
from schemas.models import DeliveryShipped, DroneFailed, DroneScheduled, PackageReady

NOW = datetime(2025, 1, 1, tzinfo=UTC)
PING = OnceEffect("ping", "return 'pong'")

probe = Service("probe")
pool = probe.pool(Pool("bays", seed=lambda: {"bay-1": 1.0}))
notes = probe.record("note", ttl_s=60)


def shipped(delivery_id: str = "d-1") -> DeliveryShipped:
    return DeliveryShipped(delivery_id=delivery_id, package_id="p-1", drone_id="drone-7", shipped_at=NOW)


@probe.on("delivery.shipped")
def book(event: DeliveryShipped, ctx: Context) -> Effects[list[DeliveryShipped]]:
    first = yield pool.reserve(event.delivery_id, 1.0)
    second = yield pool.reserve(event.delivery_id, 2.0)
    ctx.emit(event, topic="emitted.first")
    return [event.model_copy(update={"drone_id": f"{first.member}+{second.member}"})]


def test_an_operation_nobody_scripted_fails_the_test_and_says_which() -> None:
    with pytest.raises(HarnessError, match=r"book asked pool_reserve\(keys=.*args=\('d-1', 1.0\)\).*"
                                           r"answers=\{'pool_reserve': \.\.\.\}"):
        run(probe, shipped())


def test_a_list_answers_in_order_and_runs_out_loudly() -> None:
    outcome = run(probe, shipped(), answers={"pool_reserve": [Reservation("bay-1"), Reservation("bay-2")]})
    assert [a.args for a in outcome.asked("pool_reserve")] == [("d-1", 1.0), ("d-1", 2.0)]
    assert all(a.typed for a in outcome.effects)
    with pytest.raises(HarnessError, match="asked pool_reserve 2 times; the test scripted 1 answers"):
        run(probe, shipped(), answers={"pool_reserve": [Reservation("bay-1")]})


def test_a_callable_answers_from_what_was_asked() -> None:
    def by_load(asked: Asked) -> Reservation:
        return Reservation(f"bay-{asked.args[1]}")

    outcome = run(probe, shipped(), answers={"pool_reserve": by_load})
    assert outcome.events[-1] == shipped().model_copy(update={"drone_id": "bay-1.0+bay-2.0"})


def test_emits_come_first_then_the_returned_events_with_ids_derived_from_the_input() -> None:
    outcome = run(probe, shipped(), answers={"pool_reserve": Reservation("bay-1")}, event_id="e-1")
    assert outcome.topics == ["emitted.first", "delivery.shipped"]
    assert [e.event_id for e in outcome.emitted] == [
        derived_id("e-1", "probe", "emitted.first", "0"), derived_id("e-1", "probe", "delivery.shipped", "1")]
    assert isinstance(outcome.result, list)


def test_the_envelope_is_the_events_delivery_with_the_attempt_asked() -> None:
    seen: list[tuple[str, str, int, str]] = []
    service = Service("envelope")

    @service.on("delivery.shipped")
    def look(event: DeliveryShipped, ctx: Context) -> None:
        seen.append((ctx.delivery_id, ctx.event_id, ctx.attempt, ctx.try_label))

    run(service, shipped("d-9"), event_id="e-9", attempt=3, try_no=2)
    assert seen == [("d-9", "e-9", 3, "3.2")]


def failing(error: Exception) -> Service:
    service = Service("failing")

    @service.on("delivery.shipped")
    def fail(event: DeliveryShipped, ctx: Context) -> Effects[None]:
        yield ctx.effect(PING)
        ctx.emit(event)
        raise error

    return service


def test_a_retryable_is_reported_and_what_was_emitted_before_it_dropped() -> None:
    outcome = run(failing(Retryable("not now")), shipped(), answers={"ping": "pong"})
    assert isinstance(outcome.error, Retryable) and str(outcome.error) == "not now"
    assert outcome.emitted == [] and outcome.context.emitted != []
    assert [(a.name, a.typed, a.answer) for a in outcome.effects] == [("ping", False, "pong")]


def test_a_rejection_is_reported() -> None:
    outcome = run(failing(Rejected("never")), shipped(), answers={"ping": "pong"})
    assert isinstance(outcome.error, Rejected) and outcome.emitted == []


def test_any_other_exception_is_a_bug_and_propagates() -> None:
    with pytest.raises(KeyError):
        run(failing(KeyError("bug")), shipped(), answers={"ping": "pong"})


def test_outputs_are_checked_as_the_runner_checks_them_before_the_step_completes() -> None:
    """An output too large for a consumer is the input's OVERSIZED refusal, with nothing
    emitted; one Avro cannot write (a string that is not Unicode) is a bug of the rule."""
    service = Service("copier")

    @service.on("delivery.shipped")
    def copy(event: DeliveryShipped, ctx: Context) -> None:
        ctx.emit(event.model_copy(update={"package_id": event.package_id * 100_000}), topic="copies")

    fits = run(service, shipped(delivery_id="d-1"))
    assert fits.error is None and len(fits.emitted) == 1
    too_large = run(service, shipped(delivery_id="d-1").model_copy(update={"package_id": "p-123456"}))
    assert isinstance(too_large.error, Rejected) and too_large.emitted == []
    assert too_large.error.reason is DeadLetterReason.OVERSIZED
    assert "DeliveryShipped for copies would be 8000" in str(too_large.error)
    with pytest.raises(Unwritable, match="UnicodeEncodeError"):
        run(service, shipped().model_copy(update={"package_id": "\ud800"}))


def test_yielding_anything_but_an_operation_is_rejected_as_the_runner_does() -> None:
    service = Service("confused")

    @service.on("delivery.shipped")
    def confused(event: DeliveryShipped, ctx: Context) -> Effects[None]:
        yield event  # type: ignore[misc]

    outcome = run(service, shipped())
    assert isinstance(outcome.error, Rejected)
    assert "confused yielded DeliveryShipped" in str(outcome.error)


@pytest.mark.parametrize("refusal, why", [(RELEASED, "released"), (STALE, "stale")])
def test_an_effect_refused_meanwhile_drops_the_attempt(refusal: str, why: str) -> None:
    """Its delivery released, or its step given to a newer attempt: nothing is emitted."""
    for answer in (refusal, Raw(refusal)):
        outcome = run(probe, shipped(), answers={"pool_reserve": answer})
        assert outcome.dropped == why and outcome.emitted == [] and outcome.error is None
        assert outcome.released == (why == "released")
        assert len(outcome.effects) == 1


def test_once_is_answered_from_the_script_too() -> None:
    service = Service("once")

    @service.on("delivery.shipped")
    def at_once(event: DeliveryShipped, ctx: Context) -> DeliveryShipped:
        return event.model_copy(update={"drone_id": ctx.once(PING, keys=["k"], args=[1]) or ""})

    outcome = run(service, shipped(), answers={"ping": "pong"})
    assert outcome.only(DeliveryShipped).drone_id == "pong"
    assert (outcome.effects[0].keys, outcome.effects[0].args) == (("k",), (1,))
    assert run(service, shipped(), answers={"ping": RELEASED}).released


def test_touching_redis_fails_the_test_clearly() -> None:
    service = Service("direct")

    @service.on("delivery.shipped")
    def direct(event: DeliveryShipped, ctx: Context) -> None:
        ctx.redis.get("x")

    with pytest.raises(HarnessError, match=r"ctx.redis.get: there is no Redis"):
        run(service, shipped())


def test_a_topic_without_handler_or_an_event_of_the_wrong_type_is_the_tests_mistake() -> None:
    with pytest.raises(HarnessError, match="probe has no handler of 'nowhere'"):
        run(probe, shipped(), topic="nowhere")
    with pytest.raises(HarnessError, match="reads 'delivery.shipped' as DeliveryShipped, not PackageReady"):
        run(probe, PackageReady(delivery_id="d", package_id="p", package_size="S", weight_kg=1, ready_at=NOW),
            topic="delivery.shipped")


def test_join_decisions_are_checked_against_the_join() -> None:
    drone = DroneScheduled(delivery_id="d", drone_id="x", scheduled_at=NOW)
    with pytest.raises(HarnessError, match=r"completes with parts \['drone', 'package'\], not \['drone'\]"):
        complete(delivery.delivery, {"drone": drone})
    with pytest.raises(HarnessError, match="fails with a DroneFailed, not a DroneScheduled"):
        failed(delivery.delivery, "drone", drone)
    with pytest.raises(HarnessError, match=r"completed beside the failed 'drone' are among \['package'\]"):
        failed(delivery.delivery, "drone", DroneFailed(delivery_id="d", reason="x", failed_at=NOW), ["drone"])
    with pytest.raises(HarnessError, match="has no part 'flight'"):
        failed(delivery.delivery, "flight", DroneFailed(delivery_id="d", reason="x", failed_at=NOW))


def test_records_behave_like_the_redis_hashes() -> None:
    service = Service("notes")

    @service.on("delivery.shipped")
    def write(event: DeliveryShipped, ctx: Context) -> Effects[None]:
        missing = yield notes.update(event.delivery_id, answer="drone", status="x")
        yield notes.put(event.delivery_id, drone=event.drone_id, weight=2.5)
        kept = yield notes.set_once(event.delivery_id, "drone", "other")
        found = yield notes.update(event.delivery_id, answer="drone", status="done")
        ctx.emit(event.model_copy(update={"package_id": f"{missing}|{kept}|{found}"}))

    records = Records()
    outcome = run(service, shipped(), answers=records.answers)
    assert outcome.only(DeliveryShipped).package_id == "None|drone-7|drone-7"
    assert records.hashes == {of_delivery("note", "d-1"): {"drone": "drone-7", "weight": "2.5", "status": "done"}}



def test_a_handler_declared_first_op_in_begin_that_emits_before_it_fails_the_test() -> None:
    """The runtime starts such a handler before the dedupe, for copies too: an emit or a
    ``ctx.once`` before its first operation is a bug the harness reports."""
    eager = Service("eager")

    @eager.on("delivery.shipped", first_op_in_begin=True)
    def note(event: DeliveryShipped, ctx: Context) -> Effects[None]:
        ctx.emit(event, topic="emitted.early")
        yield notes.set_once(event.delivery_id, "drone", event.drone_id)

    with pytest.raises(HarnessError, match="declared first_op_in_begin.*emitted.early"):
        run(eager, shipped(), answers={"record_set_once": "drone-7"})


def test_first_op_in_begin_needs_a_handler_that_yields() -> None:
    def plain(event: DeliveryShipped, ctx: Context) -> None:
        return None

    with pytest.raises(ValueError, match="first_op_in_begin"):
        Service("plain").on("delivery.shipped", first_op_in_begin=True)(plain)


@pytest.mark.parametrize("drone", ["stale", "released", "\x00stale"])
def test_no_text_an_event_carries_reads_as_an_effect_not_run(drone: str) -> None:
    """A record's field is ``set_once``'s answer: a shipment naming its drone ``"stale"`` is
    told that drone, not dropped as if its effect had been refused (``choreo.answers``)."""
    from consumers.notifier import service as notifier

    records = Records()
    outcome = run(notifier, shipped().model_copy(update={"drone_id": drone}), answers=records.answers)
    assert outcome.dropped == "" and outcome.error is None
    assert records.hashes[of_delivery("notified", "d-1")] == {"drone": drone}
