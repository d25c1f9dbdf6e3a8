"""Group commit (``producers.group``): concurrent callers share a batch, each gets its own
answer in order, and one batch's failure reaches exactly that batch's callers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from producers.group import GroupClosed, GroupCommit


class Recorder:
    """A ``work`` that doubles its items, slowly, and records the batches it was given."""

    def __init__(self, delay_s: float = 0.02, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.threads: set[str] = set()

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail_on is not None and self.fail_on in items:
            raise ConnectionError("store down")
        return [2 * item for item in items]


def test_callers_who_arrive_while_a_batch_runs_go_together_in_the_next() -> None:
    work = Recorder()
    group: GroupCommit[int, int] = GroupCommit(work, max_batch=50)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(group.submit(i) for i in range(200))))

    try:
        answers = asyncio.run(main())
    finally:
        group.close()
    assert answers == [2 * i for i in range(200)]  # each caller its own answer
    assert sorted(i for batch in work.batches for i in batch) == list(range(200))  # each item once
    assert all(len(batch) <= 50 for batch in work.batches)
    assert len(work.batches) <= 8  # shared: not one call per caller (the first may go alone)
    assert work.threads == {"group-commit"}  # on its own thread, not the event loop's


def test_a_caller_alone_is_not_held_back_for_company() -> None:
    work = Recorder(delay_s=0.0)
    group: GroupCommit[int, int] = GroupCommit(work)

    async def main() -> float:
        started = time.perf_counter()
        assert await group.submit(21) == 42
        return time.perf_counter() - started

    try:
        assert asyncio.run(main()) < 0.5  # no timer: it goes at once
    finally:
        group.close()
    assert work.batches == [[21]]


def test_a_failed_batch_fails_its_own_callers_and_the_next_batch_runs() -> None:
    work = Recorder(delay_s=0.05, fail_on=3)
    group: GroupCommit[int, int] = GroupCommit(work, max_batch=10)

    async def main() -> tuple[list[object], int]:
        first = await asyncio.gather(*(group.submit(i) for i in range(10)), return_exceptions=True)
        return list(first), await group.submit(100)

    try:
        first, later = asyncio.run(main())
    finally:
        group.close()
    failed_batch = next(batch for batch in work.batches if 3 in batch)
    for i, answer in enumerate(first):
        if i in failed_batch:
            assert isinstance(answer, ConnectionError)
        else:
            assert answer == 2 * i
    assert later == 200  # the thread lived on


def test_a_work_that_answers_the_wrong_number_of_results_fails_the_batch() -> None:
    group: GroupCommit[int, int] = GroupCommit(lambda items: [1])

    async def main() -> list[object]:
        return list(await asyncio.gather(*(group.submit(i) for i in range(5)), return_exceptions=True))

    try:
        answers = asyncio.run(main())
    finally:
        group.close()
    # a batch of one gets its one answer; larger batches get an error, never a wrong answer
    assert all(a == 1 or isinstance(a, RuntimeError) for a in answers)
    assert any(isinstance(a, RuntimeError) for a in answers)


def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    work = Recorder(delay_s=0.1)
    group: GroupCommit[int, int] = GroupCommit(work)

    async def main() -> list[int]:
        blocker = asyncio.ensure_future(group.submit(0))  # keeps the thread busy
        await asyncio.sleep(0.02)
        doomed = asyncio.ensure_future(group.submit(1))
        others = [asyncio.ensure_future(group.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0.01)
        doomed.cancel()
        return [await blocker, *[await f for f in others]]

    try:
        assert asyncio.run(main()) == [0, 4, 6]
    finally:
        group.close()
    assert any(1 in batch for batch in work.batches)  # what was queued still ran


def test_close_runs_what_is_queued_then_refuses_more() -> None:
    work = Recorder(delay_s=0.05)
    group: GroupCommit[int, int] = GroupCommit(work)

    async def main() -> list[int]:
        pending = [asyncio.ensure_future(group.submit(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        closing = asyncio.get_running_loop().run_in_executor(None, group.close)
        answers = [await f for f in pending]
        await closing
        return answers

    assert asyncio.run(main()) == [0, 2, 4, 6, 8]

    async def late() -> int:
        return await group.submit(9)

    with pytest.raises(GroupClosed, match="closed"):
        asyncio.run(late())


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError):
        GroupCommit(lambda items: items, max_batch=0)


@pytest.mark.parametrize("thrown", [SystemExit(3), KeyboardInterrupt(), StopIteration()])
def test_what_an_event_loop_must_not_get_reaches_callers_as_an_error_of_their_own(
        thrown: BaseException) -> None:
    calls: list[list[int]] = []

    def work(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            raise thrown
        return items

    group: GroupCommit[int, int] = GroupCommit(work)

    async def main() -> tuple[BaseException, int]:
        try:
            await group.submit(1)
        except RuntimeError as exc:
            failed: BaseException = exc
        else:
            raise AssertionError("the first batch's caller was answered")
        return failed, await group.submit(2)

    try:
        failed, later = asyncio.run(main())
    finally:
        group.close()
    assert failed.__cause__ is thrown and later == 2  # the thread lived on


def test_a_caller_past_its_timeout_is_told_and_the_item_still_runs() -> None:
    work = Recorder(delay_s=0.3)
    group: GroupCommit[int, int] = GroupCommit(work)

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await group.submit(5, timeout_s=0.05)

    try:
        asyncio.run(main())
    finally:
        group.close()
    assert work.batches == [[5]]
