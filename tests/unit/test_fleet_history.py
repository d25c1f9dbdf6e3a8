"""The double-booking check over a fleet history that spans a Redis loss (infra/chaos.py)."""

from __future__ import annotations

from infra.chaos import FleetHistory


def entry(action: str, drone: str, delivery: str) -> tuple[bytes, dict[bytes, bytes]]:
    return b"0-0", {b"action": action.encode(), b"drone": drone.encode(), b"delivery": delivery.encode()}


def test_a_drone_reserved_while_held_is_a_double_booking() -> None:
    history = FleetHistory([], [entry("reserve", "d1", "a"), entry("reserve", "d1", "b")])
    assert history.double_bookings({}) == (["d1 reserved for b while held by a"], 0)


def test_a_release_frees_the_drone() -> None:
    history = FleetHistory([], [entry("reserve", "d1", "a"), entry("return", "d1", "a"),
                                entry("reserve", "d1", "b")])
    assert history.double_bookings({}) == ([], 0)


def test_a_hold_that_never_reached_kafka_is_forgotten_with_redis() -> None:
    history = FleetHistory([entry("reserve", "d1", "a")], [entry("reserve", "d1", "b")])
    assert history.double_bookings({"b": "d1"}) == ([], 1)


def test_a_committed_hold_lost_by_the_rebuild_is_a_double_booking() -> None:
    history = FleetHistory([entry("reserve", "d1", "a")], [entry("reserve", "d1", "b")])
    assert history.double_bookings({"a": "d1"}) == (["d1 reserved for b while held by a"], 0)


def test_a_committed_hold_restored_by_the_rebuild_is_no_violation() -> None:
    history = FleetHistory([entry("reserve", "d1", "a")],
                           [entry("reserve", "d1", "a"), entry("return", "d1", "a"), entry("reserve", "d1", "b")])
    assert history.double_bookings({"a": "d1"}) == ([], 0)


def test_a_hold_whose_booking_was_committed_only_after_the_loss_was_forgotten() -> None:
    """Full chaos run at 538d3f9: a reservation in flight at the loss was redone after the
    rebuild and happened to pick the same drone; its committed booking is that later one."""
    history = FleetHistory([entry("reserve", "d1", "a")],
                           [entry("reserve", "d1", "b"), entry("return", "d1", "b"),
                            entry("reserve", "d1", "a")], lost_at_ms=1_000)
    assert history.double_bookings({"a": "d1"}, {"a": 2_000}) == ([], 1)
    # committed before the loss, the same history is a double booking
    assert history.double_bookings({"a": "d1"}, {"a": 500}) == (["d1 reserved for b while held by a"], 0)


def test_a_hold_whose_delivery_shipped_before_the_loss_had_ended() -> None:
    """A shipped delivery's drone comes back when the supervisor records the shipment, which a
    Redis loss may have come before; the rebuild frees it at once
    (the flight is over), so its next reservation is no double booking."""
    history = FleetHistory([entry("reserve", "d1", "a")], [entry("reserve", "d1", "b")], lost_at_ms=1_000)
    assert history.double_bookings({"a": "d1"}, {"a": 500}, {"a": 800}) == ([], 0)
    # shipped only after the loss, it was still flying: the same history is a double booking
    assert history.double_bookings({"a": "d1"}, {"a": 500}, {"a": 1_200}) == (["d1 reserved for b while held by a"], 0)
