"""A batch's events of one delivery run one after the other, in input order (choreo.runner)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

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


def test_an_attempt_whose_delivery_was_released_is_dropped_not_resumed() -> None:
    """The answer ``RELEASED`` ends the handler where it waits (choreo.effects): what it would
    have done after its effect, and its outputs, never happen."""
    from choreo.effects import RELEASED, EffectCall, OnceEffect
    from choreo.runner import Attempt

    reached: list[str] = []
    effect = EffectCall(OnceEffect("book", "return 'drone-1'"), "d-1", "svc:book:e-1", (), (), 60)

    def handler(event: Any, ctx: Any) -> Any:
        answer = yield effect
        reached.append(answer)
        return "an output"

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step="drone"), event=None))
    attempt.ctx = SimpleNamespace()
    attempt.start()
    assert attempt.request is effect and attempt.error is None
    attempt.resume(RELEASED)
    assert attempt.released and attempt.request is None and attempt.result is None
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

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler, step=step), event=None))
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
