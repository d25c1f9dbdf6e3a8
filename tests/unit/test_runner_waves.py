"""A batch's events of one delivery run one after the other, in input order (choreo.runner)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from choreo.answers import RELEASED, STALE
from choreo.runner import _waves


def work(delivery: str, n: int) -> Any:
    return SimpleNamespace(envelope=SimpleNamespace(correlation_id=delivery), n=n)


def test_the_kth_event_of_every_delivery_is_in_wave_k() -> None:
    batch = [work("a", 0), work("b", 1), work("a", 2), work("c", 3), work("a", 4), work("b", 5)]
    waves = _waves(batch)
    assert [[w.n for w in wave] for wave in waves] == [[0, 1, 3], [2, 5], [4]]


def test_distinct_deliveries_make_one_wave() -> None:
    assert len(_waves([work(str(i), i) for i in range(100)])) == 1
    assert _waves([]) == []


@pytest.mark.parametrize("answer, why", [(RELEASED, "released"), (STALE, "stale")])
def test_an_attempt_whose_effect_was_refused_is_dropped_not_resumed(answer: str, why: str) -> None:
    """The answers ``RELEASED`` (its delivery was released) and ``STALE`` (its step went to a
    newer attempt or was closed) end the handler where it waits (choreo.effects): what it
    would have done after its effect, and its outputs, never happen."""
    from choreo.effects import EffectCall, OnceEffect
    from choreo.runner import Attempt

    reached: list[str] = []
    effect = EffectCall(OnceEffect("book", "return 'drone-1'"), "d-1", "svc:book:e-1", (), (), 60)

    def handler(event: Any, ctx: Any) -> Any:
        answer = yield effect
        reached.append(answer)
        return "an output"

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step="drone"), event=None, first=None))
    attempt.ctx = SimpleNamespace()
    attempt.start()
    assert attempt.request is effect and attempt.error is None
    attempt.resume(answer)
    assert attempt.dropped == why and attempt.request is None and attempt.result is None
    assert attempt.error is None and reached == []


@pytest.mark.parametrize("step", ["package", None])
def test_a_steps_write_is_left_to_its_finish_and_the_handler_goes_on(step: str | None) -> None:
    """A record's ``put`` answers nothing: in a step the handler gets that at once and the
    write waits for the finish (one script item with it); outside a step it runs as an effect."""
    from choreo.envelope import Envelope
    from choreo.record import Record
    from choreo.runner import Attempt
    from choreo.service import Context

    record = Record("pkg", ttl_s=60)
    reached: list[str] = []

    def handler(event: Any, ctx: Any) -> Any:
        yield record.put("d-1", status="ready")
        reached.append("after the put")
        return "an output"

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step=step), event=None, first=None))
    attempt.ctx = Context("package", Envelope.first("e-1", "d-1", "Probe", "test"), "t", 0, 0,
                          None, None)  # type: ignore[arg-type]
    attempt.start()
    if step is None:
        assert attempt.request is not None and attempt.request.effect.name == "record_put"
        assert attempt.ctx.writes == [] and reached == []
        return
    assert attempt.request is None and attempt.result == "an output" and reached == ["after the put"]
    [write] = attempt.ctx.writes
    assert write.write is not None and write.write.pairs == ("status", "ready")


def test_the_operation_that_rode_in_the_begin_is_answered_from_it_on_every_try() -> None:
    """A join's record runs in its input's begin: the handler's first operation gets the
    begin's answer with no request of its own, on each in-process try; an operation asked
    after it, or another than the one that rode, goes to Redis."""
    from choreo.envelope import Envelope
    from choreo.record import Record
    from choreo.runner import Attempt
    from choreo.service import Context

    record = Record("pkg", ttl_s=60)
    first = record.update("d-1", answer="status", status="x")
    seen: list[Any] = []

    def handler(event: Any, ctx: Any) -> Any:
        seen.append((yield record.update("d-1", answer="status", status="x")))
        seen.append((yield record.update("d-1", answer="status", status="x")))

    envelope = Envelope.first("e-1", "d-1", "Probe", "test")
    rode = Context("svc", envelope, "t", 0, 0, None, None).effect(  # type: ignore[arg-type]
        first.effect, first.keys, first.args)
    work = SimpleNamespace(handler=SimpleNamespace(fn=handler, step="package"), event=None,
                           first=(rode, "ready"))
    for _ in range(2):  # a retry asks again, and is answered again
        attempt = Attempt(work)  # type: ignore[arg-type]
        attempt.ctx = Context("svc", envelope, "t", 0, 0, None, None)  # type: ignore[arg-type]
        attempt.start()
        assert seen[-1] == "ready"
        assert attempt.request is not None and attempt.request.memo_field.endswith("#1")
    work.first = (Context("svc", envelope, "t", 0, 0, None, None).effect(  # type: ignore[arg-type]
        first.effect, first.keys, ("status", "status", "y")), "ready")
    attempt = Attempt(work)  # type: ignore[arg-type]
    attempt.ctx = Context("svc", envelope, "t", 0, 0, None, None)  # type: ignore[arg-type]
    attempt.start()
    assert attempt.request is not None and attempt.request.memo_field.endswith(":" + "e-1")


def test_a_write_outside_the_deliverys_slot_runs_as_an_effect() -> None:
    """The finish's item holds keys of the delivery's slot only (a cluster refuses others with
    CROSSSLOT): a put of another shard's record goes to Redis as an effect of its own."""
    from choreo import keys
    from choreo.envelope import Envelope
    from choreo.record import Record
    from choreo.runner import Attempt
    from choreo.service import Context

    other = next(f"d-{n}" for n in range(1000) if keys.shard_of(f"d-{n}") != keys.shard_of("d-1"))
    record = Record("pkg", ttl_s=60)

    def handler(event: Any, ctx: Any) -> Any:
        yield record.put(other, status="ready")

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step="package"), event=None,
                                      first=None))  # type: ignore[arg-type]
    attempt.ctx = Context("package", Envelope.first("e-1", "d-1", "Probe", "test"), "t", 0, 0,
                          None, None)  # type: ignore[arg-type]
    attempt.start()
    assert attempt.request is not None and attempt.request.keys == (record.key(other),)
    assert attempt.ctx.writes == []


def test_a_raw_effect_that_rode_in_the_begin_is_answered_from_it() -> None:
    """The same for an effect asked with ``ctx.effect`` (the supervisor's record of a terminal):
    answered once per try, a second one goes to Redis."""
    from choreo.effects import OnceEffect
    from choreo.envelope import Envelope
    from choreo.runner import Attempt
    from choreo.service import Context

    mark = OnceEffect("mark", "return 'marked'")
    envelope = Envelope.first("e-1", "d-1", "Probe", "test")
    seen: list[Any] = []

    def handler(event: Any, ctx: Any) -> Any:
        seen.append((yield ctx.effect(mark, ["k"], [1])))
        seen.append((yield ctx.effect(mark, ["k"], [1])))

    rode = Context("svc", envelope, "t", 0, 0, None, None).effect(mark, ["k"], [1])  # type: ignore[arg-type]
    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step=None), event=None,
                                      first=(rode, "marked")))  # type: ignore[arg-type]
    attempt.ctx = Context("svc", envelope, "t", 0, 0, None, None)  # type: ignore[arg-type]
    attempt.start()
    assert seen == ["marked"]
    assert attempt.request is not None and attempt.request.memo_field.endswith("#1")
