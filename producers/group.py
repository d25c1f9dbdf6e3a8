"""Group commit for concurrent callers: one thread does the work of many requests at once.

Each HTTP request used to take a thread of a pool and make its own Redis round trips
(admission, the state table), its own ``produce`` and its own wake-up of the event loop:
2.3-2.9 ms of the server's CPU per request and 315-410 requests/s on two cores
(bench/README.md, "HTTP ingestion").

Here a request is queued, and one thread takes whatever has queued and runs it as one
batch (one admission script, one state-table call, one ``produce`` loop). There is no timer:
a request that finds the thread idle goes at once, alone; requests that arrive while a batch
runs go together in the next. So one caller waits no longer than before, and under load the
round trips are shared by up to ``max_batch`` requests. Each batch's answers reach the
event loop in one wake-up (``call_soon_threadsafe`` once per batch, not per request).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class _Waiting(Generic[Item, Result]):
    item: Item
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future[Result]


class GroupClosed(RuntimeError):
    """Submitted after ``close``: nothing will run it."""


class GroupCommit(Generic[Item, Result]):
    """Runs ``work`` (a list of items in, one result per item out, in order) on its own
    thread, for batches of items submitted from an event loop."""

    def __init__(self, work: Callable[[list[Item]], Sequence[Result]], max_batch: int = 500,
                 name: str = "group-commit") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._work = work
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Waiting[Item, Result] | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # nothing is queued behind the stop
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def submit(self, item: Item, timeout_s: float | None = None) -> Result:
        """``item``'s result, once the batch it went in has run; ``work``'s exception, if it
        raised, for every item of that batch. ``TimeoutError`` past ``timeout_s``: the item
        may still run (the caller is no longer told)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Result] = loop.create_future()
        with self._closing:
            if self._closed:
                raise GroupClosed("the group commit is closed")
            self._queue.put(_Waiting(item, loop, answer))
        if timeout_s is None:
            return await answer
        return await asyncio.wait_for(answer, timeout_s)  # a future: no task of its own

    def close(self, timeout_s: float = 30.0) -> None:
        """Run what is queued, then stop the thread."""
        with self._closing:
            self._closed = True
            self._queue.put(None)  # what was queued before it still runs
        self._thread.join(timeout=timeout_s)

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            entry = self._queue.get()
            if entry is None:
                return
            batch = [entry]
            while len(batch) < self.max_batch:
                try:
                    entry = self._queue.get_nowait()
                except queue.Empty:
                    break
                if entry is None:
                    stopping = True
                    break
                batch.append(entry)
            self._run(batch)

    def _run(self, batch: list[_Waiting[Item, Result]]) -> None:
        outcomes: list[Any]
        try:
            results = self._work([waiting.item for waiting in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} items")
            outcomes, raised = list(results), False
        except BaseException as exc:  # every caller of the batch is told; the thread lives on
            failure: BaseException = exc
            if not isinstance(exc, Exception) or isinstance(exc, StopIteration):
                # what a future cannot carry (StopIteration) or an event loop must not get
                # (SystemExit, KeyboardInterrupt) reaches the callers as an error of their own
                failure = RuntimeError(f"the group's work failed: {exc!r}")
                failure.__cause__ = exc
            outcomes, raised = [failure] * len(batch), True
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for waiting, outcome in zip(batch, outcomes):
            by_loop.setdefault(waiting.loop, []).append((waiting.answer, outcome))
        for loop, answers in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, answers, raised)
            except RuntimeError:  # that loop is closed: nobody awaits its answers any more
                pass


def _settle_all(answers: list[tuple[asyncio.Future[Any], Any]], raised: bool) -> None:
    for answer, outcome in answers:
        if answer.done():  # its caller was cancelled (the client went away)
            continue
        if raised:
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)
