"""A batch's events of one delivery run one after the other, in input order (choreo.runner)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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

    attempt = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=handler), event=None))
    attempt.ctx = SimpleNamespace()
    attempt.start()
    assert attempt.request is effect and attempt.error is None
    attempt.resume(RELEASED)
    assert attempt.released and attempt.request is None and attempt.result is None
    assert attempt.error is None and reached == []
