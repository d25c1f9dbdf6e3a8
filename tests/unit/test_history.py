"""A delivery's status told from Kafka: the lookups are shared out per caller (one caller
holds at most its own slots, and a lookup that fails gives its slot back), and only a
deciding event on its own topic tells an outcome."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from consumers.workflow import WORKFLOW
from choreo.ops.trace import Hop, ScanStats, Trace
from producers import history as history_module
from producers.history import History, HistoryBusy, HistoryTooLong, KafkaHistory


class Held(KafkaHistory):
    """Every read waits until released (or raises), so slots stay taken while a test looks."""

    def __init__(self, concurrency: int, per_caller: int) -> None:
        super().__init__(WORKFLOW, None, concurrency, per_caller, 64 * 1024)  # type: ignore[arg-type]
        self.release = threading.Event()
        self.reading = threading.Semaphore(0)

    def _read(self, delivery_id: str) -> History | None:
        self.reading.release()
        self.release.wait(10)
        if delivery_id == "broken":
            raise RuntimeError("the broker went away")
        return None


def held_lookup(history: Held, delivery_id: str, caller: str) -> threading.Thread:
    thread = threading.Thread(target=history.lookup, args=(delivery_id, caller), daemon=True)
    thread.start()
    assert history.reading.acquire(timeout=10)
    return thread


def test_a_caller_past_its_share_is_refused_while_another_caller_is_served() -> None:
    history = Held(concurrency=3, per_caller=1)
    first = held_lookup(history, "a", "mallory")
    with pytest.raises(HistoryBusy, match="this caller"):
        history.lookup("b", "mallory")
    second = held_lookup(history, "c", "alice")
    third = held_lookup(history, "d", "bob")
    with pytest.raises(HistoryBusy):  # every slot of the process taken
        history.lookup("e", "carol")
    history.release.set()
    for thread in (first, second, third):
        thread.join(10)
    assert history.lookup("f", "mallory") is None  # given back


def test_a_lookup_that_fails_gives_its_slots_back() -> None:
    history = Held(concurrency=1, per_caller=1)
    history.release.set()
    answers: list[Any] = []
    for _ in range(3):
        with pytest.raises(RuntimeError):
            history.lookup("broken", "alice")
        answers.append(history.lookup("fine", "alice"))
    assert answers == [None, None, None]


def hop(topic: str, event_type: str, body: dict[str, Any] | str) -> Hop:
    return Hop(topic=topic, partition=0, offset=0, kind="event", time_ms=0, since_start_ms=0,
               since_previous_ms=0, event_type=event_type, producer="x", attempt=1, hops=0, event_id="e",
               causation_id="", body=body)


def test_only_a_deciding_event_on_its_own_topic_tells_an_outcome() -> None:
    history = Held(concurrency=1, per_caller=1)
    shipped = {"delivery_id": "d", "package_id": "p", "drone_id": "r", "shipped_at": 1_700_000_000_000}
    assert history._told(hop("delivery.shipped", "DeliveryShipped", shipped), "d") == "shipped"
    # another delivery's event under this one's key
    assert history._told(hop("delivery.shipped", "DeliveryShipped", shipped), "e") is None
    # a writer of another topic naming a deciding event type in its header
    assert history._told(hop("drone.scheduled", "DeliveryShipped", shipped), "d") is None
    # a body that is no such event: told nothing, not an error answered to the owner
    assert history._told(hop("delivery.shipped", "DeliveryShipped", {"delivery_id": "d"}), "d") is None
    assert history._told(hop("delivery.shipped", "DeliveryShipped", "<12 bytes, not Confluent wire format>"), "d") is None


def test_the_owner_is_told_by_the_delivery_s_own_request_and_only_one(monkeypatch: pytest.MonkeyPatch) -> None:
    history = Held(concurrency=1, per_caller=1)
    stories: list[list[Hop]] = []
    monkeypatch.setattr(history_module, "trace", lambda *args, **kwargs: Trace("d", stories.pop(), {}, ScanStats(), 0, ""))

    def request(owner: str, delivery_id: str = "d") -> Hop:
        return hop("delivery.requested", "DeliveryRequested", {"delivery_id": delivery_id, "owner_id": owner})

    stories.append([request("alice"), request("alice")])  # a copy: the same request
    found = KafkaHistory._read(history, "d")
    assert found is not None and found.owner_id == "alice" and found.status["outcome"] is None
    stories.append([request("eve", "x"), request("alice")])  # another delivery's request under this key
    assert (found := KafkaHistory._read(history, "d")) is not None and found.owner_id == "alice"
    stories.append([request("eve"), request("alice")])  # a forged second request: no one is told
    assert KafkaHistory._read(history, "d") is None


def test_a_story_longer_than_a_lookup_keeps_tells_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded past the records a lookup keeps, the request or the outcome may be among those
    left out: neither an owner nor a status is told from the rest."""
    history = Held(concurrency=1, per_caller=1)
    padded = Trace("d", [hop("delivery.requested", "DeliveryRequested", {"delivery_id": "d", "owner_id": "alice"})],
                   {}, ScanStats(cut=True), 0, "")
    monkeypatch.setattr(history_module, "trace", lambda *args, **kwargs: padded)
    with pytest.raises(HistoryTooLong):
        KafkaHistory._read(history, "d")
