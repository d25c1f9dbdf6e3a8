"""The garbage collector's settings for a long-running batch process (choreo.memory)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from choreo.memory import GC_YOUNG_THRESHOLD, settle_garbage_collector


@pytest.fixture()
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_start_up_objects_leave_the_collectors_sight_and_it_runs_less_often(restored_gc: None) -> None:
    built_at_start = [[i] for i in range(1000)]  # container objects the collector tracks
    settle_garbage_collector()
    assert gc.get_freeze_count() >= len(built_at_start)
    assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD > 700  # CPython's default: 700
    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(info["generation"]) if phase == "stop" else None)
    try:
        batch = [{"event": i} for i in range(5000)]  # a batch's worth of short-lived objects
        del batch
        assert collected == []  # the default would have run the collector seven times
    finally:
        gc.callbacks.pop()
