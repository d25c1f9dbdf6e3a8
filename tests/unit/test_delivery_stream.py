"""The event stream's own rules: its slots per client and in all, and what it sends when."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from producers.stream import StreamSlots, delivery_events


def test_slots_are_bounded_per_client_and_in_all_and_given_back() -> None:
    slots = StreamSlots(per_client=2, total=3, max_s=60)
    a1, a2 = slots.take("a"), slots.take("a")
    assert a1 is not None and a2 is not None and slots.take("a") is None  # the client's limit
    b1 = slots.take("b")
    assert b1 is not None and slots.take("c") is None  # the process's limit
    slots.give_back("a", a1)
    assert slots.take("c") is not None


def test_a_slot_never_given_back_is_free_again_after_its_streams_time() -> None:
    slots = StreamSlots(per_client=1, total=10, max_s=0)
    assert slots.take("a") is not None and slots.take("a") is None
    slots.open["a"] = [time.monotonic() - 1]  # its end has passed (the stream's clean-up never ran)
    assert slots.take("a") is not None


def frames(chunks: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for chunk in chunks:
        lines = dict(line.split(": ", 1) for line in chunk.decode().strip().splitlines() if not line.startswith(":"))
        if "event" in lines:
            found.append((lines["event"], json.loads(lines["data"])))
    return found


def run(states: list[dict[str, Any] | None], history: dict[str, Any] | None = None,
        max_s: float = 5.0, story_s: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    queue = list(states)

    async def status() -> dict[str, Any] | None:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    async def story() -> dict[str, Any] | None:
        await asyncio.sleep(story_s)  # the lookup's own time (it may wait for a slot)
        return history

    async def gone() -> bool:
        return False

    async def collect() -> list[bytes]:
        return [c async for c in delivery_events("d1", status, story, gone, poll_s=0.001, max_s=max_s,
                                                 released_story_s=0.2)]

    return frames(asyncio.run(collect()))


def step(status: str, updated: int, attempt: int = 1) -> dict[str, Any]:
    return {"status": status, "attempt": attempt, "updated_ms": updated}


def test_changes_come_in_the_order_they_happened_then_the_outcome_ends_it() -> None:
    got = run([
        {"steps": {"package": step("pending", 1), "drone": step("pending", 1)}, "outcome": None},
        {"steps": {"package": step("completed", 5), "drone": step("completed", 3)}, "outcome": None},
        {"steps": {"package": step("completed", 5), "drone": step("completed", 3),
                   "delivery": step("completed", 8)}, "outcome": "shipped"},
    ])
    assert [(e, d.get("step"), d.get("status")) for e, d in got] == [
        ("step", "drone", "pending"), ("step", "package", "pending"),
        ("step", "drone", "completed"), ("step", "package", "completed"),
        ("step", "delivery", "completed"), ("outcome", None, None)]
    assert got[-1][1] == {"delivery_id": "d1", "outcome": "shipped"}


def test_a_requeue_is_a_change_and_a_stream_with_no_outcome_times_out() -> None:
    got = run([{"steps": {"drone": step("failed", 1)}, "outcome": None},
               {"steps": {"drone": step("pending", 2, attempt=2)}, "outcome": None}], max_s=0.05)
    assert [(e, d.get("attempt")) for e, d in got] == [("step", 1), ("step", 2), ("timeout", None)]


def test_once_the_state_is_gone_the_story_comes_from_kafka() -> None:
    history = {"outcome": "failed", "history": [{"topic": "delivery.requested"}, {"topic": "delivery.failed"}]}
    got = run([None], history)
    assert [e for e, _ in got] == ["history", "history", "outcome"]
    assert got[-1][1] == {"delivery_id": "d1", "outcome": "failed", "source": "kafka"}
    assert [e for e, _ in run([None], None)] == ["unknown"]


def test_a_release_between_two_polls_tells_the_unseen_steps_from_kafka() -> None:
    seen = {"steps": {"package": step("completed", 5), "drone": step("completed", 3)}, "outcome": None}
    tombstone = {"steps": {}, "outcome": "shipped"}
    history = {"outcome": "shipped", "history": [{"topic": "delivery.requested"}, {"topic": "delivery.shipped"}]}
    got = run([seen, tombstone], history)
    assert [e for e, _ in got] == ["step", "step", "history", "history", "outcome"]
    assert got[-1][1] == {"delivery_id": "d1", "outcome": "shipped", "source": "kafka"}
    # Kafka's story out of reach, or slower than the stream waits for it: the tombstone's
    # outcome still ends the stream
    for told, story_s in ((None, 0.0), (history, 30.0)):
        started = time.monotonic()
        got = run([seen, tombstone], told, story_s=story_s)
        assert [e for e, _ in got] == ["step", "step", "outcome"]
        assert got[-1][1] == {"delivery_id": "d1", "outcome": "shipped"}
        assert time.monotonic() - started < 5
