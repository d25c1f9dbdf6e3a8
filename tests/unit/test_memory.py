"""The garbage collector's settings for a long-running batch process (choreo.memory)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from choreo.memory import GC_YOUNG_THRESHOLD, collect_batch_cycles, settle_garbage_collector


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


def test_a_cycle_a_batch_left_is_freed_when_the_batch_is_done(restored_gc: None) -> None:
    """A handler's error keeps its traceback, whose frame keeps what holds the error: with
    the threshold raised, only the collection after the batch frees it in time."""
    settle_garbage_collector()

    class Attempt:
        error: Exception | None = None
        payload = b""

    def fail(attempt: Attempt) -> None:
        try:
            raise ValueError("handler failed")
        except ValueError as exc:
            attempt.error = exc  # the traceback's frame refers to ``attempt``: a cycle

    attempt = Attempt()
    attempt.payload = b"x" * 512 * 1024
    fail(attempt)
    freed = weakref.ref(attempt)
    del attempt
    assert freed() is not None  # reference counting alone cannot free a cycle
    collect_batch_cycles()
    assert freed() is None
