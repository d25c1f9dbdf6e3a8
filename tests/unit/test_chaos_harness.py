"""The chaos runner's own plumbing (the run itself is tests/chaos)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from choreo.serde import registry_client
from infra.chaos import EDGE_TOPIC, Findings, FleetHistory, Submitter, drones_kept, judge, make_plan, using

URL = "http://127.0.0.1:18081"  # the private registry of every chaos run (never contacted here)


def test_each_private_stack_gets_registry_clients_of_its_own() -> None:
    """A second run in one process starts a new, empty registry on the same port: a client
    kept from the first answered registrations from its cache with the first registry's
    ids, and every service dead-lettered the requests as UNKNOWN_SCHEMA."""
    first = registry_client(URL)
    with using({"SCHEMA_REGISTRY_URL": URL}):
        during = registry_client(URL)
        assert during is not first
        assert registry_client(URL) is during  # still one client per URL within a run
    assert registry_client(URL) is not during


def test_a_request_written_twice_by_the_edge_is_counted_and_a_duplicate_output_is_a_violation() -> None:
    """The edge's idempotent producer wrote 226 requests twice in a run with the 20 s leader
    hand-back (librdkafka #4953): consumers drop such a copy by its event id, so it is counted
    apart; the same id twice in a service's output topic stays a violation."""
    submitter = Submitter(make_plan(2, 1, True, services=10))
    submitter.accepted = {"d1": 0.0, "d2": 0.0}
    found = Findings(requested={"d1", "d2"})
    found.terminal.update({"d1": 1, "d2": 1})
    found.shipped = {"d1", "d2"}
    for topic, event in ((EDGE_TOPIC, "r1"), (EDGE_TOPIC, "r1"), ("package.ready", "p2"),
                         ("package.ready", "p2"), ("package.ready", "p1")):
        found.ids[topic][event] += 1
    edge_copy = f"r1 first {EDGE_TOPIC}|4|59@1 by chaos, again {EDGE_TOPIC}|4|91@1 by chaos"
    output_copy = "p2 first package.ready|1|5@2 by package, again package.ready|1|9@3 by package"
    found.duplicate_at.update({EDGE_TOPIC: [edge_copy], "package.ready": [output_copy]})
    result = judge(submitter, found, FleetHistory([], []), late=[])
    assert result["edge_duplicates"] == 1
    assert result["duplicates_by_topic"] == {"package.ready": 1}
    assert result["violations"]["duplicate_event_ids"] == 1
    assert result["violation_examples"]["duplicate_event_ids"] == [output_copy]
    assert result["edge_duplicate_examples"] == [edge_copy]


def test_a_drone_booked_for_an_ended_delivery_is_kept_and_one_of_a_pending_delivery_is_not() -> None:
    """The check of drones lost to the fleet: a booking of a delivery still under way is fine,
    one of an ended delivery is reported once the wait is over."""
    booking = {b"d-shipped": b"drone-1", b"d-pending": b"drone-2"}
    fleet = SimpleNamespace(booking_key="fleet:{fleet}:booking")
    client = SimpleNamespace(hgetall=lambda key: booking if key == fleet.booking_key else {})
    kept = drones_kept(cast(Any, client), cast(Any, fleet), {"d-shipped", "d-failed"}, timeout_s=0)
    assert kept == {"d-shipped": "drone-1"}
    booking.pop(b"d-shipped")
    assert drones_kept(cast(Any, client), cast(Any, fleet), {"d-shipped", "d-failed"}, timeout_s=0) == {}
