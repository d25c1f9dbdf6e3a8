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
