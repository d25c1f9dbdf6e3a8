"""What the rebuild takes from one record (``Rebuilder._fact``), without a broker: the
services' decoders are replaced by the body the record would decode to, and the services
take it unless a test says otherwise."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from choreo.config import settings
from choreo.envelope import H_CORRELATION_ID, Envelope
from choreo.errors import DeadLetterReason
from choreo.events import MAX_ITEMS, Event
from choreo.ops.rebuild import Rebuilder
from choreo.ops.records import Rec
from choreo.serde import MAX_VALUE_BYTES, DecodeFailure, RegistryUnavailable, forget_registry_clients
from choreo.state import MAX_ERROR_CHARS
from consumers.workflow import WORKFLOW
from schemas.models import DroneScheduled

BODY = b"\x00\x00\x00\x00\x07\x06d-1"  # schema id 7, then what the fake decoders ignore
SHIPPED = {"delivery_id": "d-1", "drone_id": "drone-00007", "package_id": "p-1", "shipped_at": "2026-12-05T00:00:00+00:00"}


def _rebuilder(body: dict[str, Any], *, taken: bool = True, decoded: bool = True) -> Rebuilder:
    """``decoded``: the services' decoders read ``body`` from any record (else they are the
    real ones, asking the registry); ``taken``: every service takes every record."""
    rebuilder = Rebuilder(WORKFLOW, redis.Redis())  # no call reaches Redis in _fact
    rebuilder.decode = lambda topic, value: body  # type: ignore[method-assign]
    if decoded:
        rebuilder.decoders = {key: _reading(key[1], body) for key in rebuilder.decoders}
    if taken:
        rebuilder.takes = lambda reader, env, r, reads: True  # type: ignore[method-assign]
    return rebuilder


def _reading(model: type[Event], body: dict[str, Any]) -> Callable[[bytes | None], Event]:
    """A decoder that reads ``body`` as ``model`` whatever the bytes, as Avro's resolution
    would: the fields the model does not know left out, a body it refuses dead-lettered."""
    def read(value: bytes | None) -> Event:
        try:
            return model.from_avro({name: v for name, v in body.items() if name in model.model_fields})
        except ValueError as exc:
            raise DecodeFailure(DeadLetterReason.INVALID_PAYLOAD, str(exc)[:100]) from exc
    return read


def _headers(envelope: Envelope) -> list[tuple[str, bytes]]:
    return [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in envelope.to_headers()]


def _shipment(headers: list[tuple[str, bytes]]) -> Rec:
    return Rec("delivery.shipped", 0, 5, 1_800_000_000_000, b"d-1", BODY, headers)


def test_a_shipment_the_services_took_gives_its_outcome() -> None:
    envelope = Envelope.first("e-1", "d-1", "DeliveryShipped", "delivery")
    rebuilder = _rebuilder(SHIPPED)
    rebuilder._fact(_shipment(_headers(envelope)), {})
    assert rebuilder.facts["d-1"].outcome == "shipped"


def test_a_shipment_whose_envelope_the_services_refuse_gives_no_fact() -> None:
    # no event id: every service dead-letters it unread, so it changed no delivery's state
    rebuilder = _rebuilder(SHIPPED)
    rebuilder._fact(_shipment([(H_CORRELATION_ID, b"d-1")]), {})
    assert not rebuilder.facts["d-1"].outcome and not rebuilder.facts["d-1"].holds


PLACE = {"lat": 59.33, "lon": 18.06, "address": "Drottninggatan 1"}
REQUEST = {"delivery_id": "d-2", "owner_id": "o-1", "pickup": PLACE, "dropoff": PLACE, "package_size": "SMALL",
           "weight_kg": 1.5, "requested_at": "2026-12-05T00:00:00+00:00"}
FAILURE = {"delivery_id": "d-1", "reason": "DEADLINE_MISSED", "detail": "", "failed_step": "drone",
           "compensate": ["package"], "failed_at": "2026-12-05T00:00:00+00:00"}


def test_a_failure_the_supervisor_has_not_read_keeps_its_state_waiting_for_it() -> None:
    """Its state then has the join's wait for the reading, not the retention: the supervisor
    asks the undos from it when it reads the failure."""
    envelope = Envelope.first("e-2", "d-1", "DeliveryFailed", "delivery")
    failure = Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-1", BODY, _headers(envelope))
    readers = [s.name for s in WORKFLOW.services if "delivery.failed" in s.handlers]
    assert readers  # the supervisor
    read, unread = _rebuilder(FAILURE), _rebuilder(FAILURE)
    read._fact(failure, {(name, "delivery.failed", 0): 6 for name in readers})
    unread._fact(failure, {(name, "delivery.failed", 0): 5 for name in readers})
    assert read.facts["d-1"].outcome == unread.facts["d-1"].outcome == "failed"
    assert (read.facts["d-1"].failure_unread, unread.facts["d-1"].failure_unread) == (False, True)


def test_a_compensation_record_whose_envelope_names_no_delivery_is_filed_under_its_key() -> None:
    """The supervisor's scan wrote some records with an empty correlation id (before they had
    an envelope of their own): keyed ``<delivery>|<step>``, they are the delivery's, not a
    delivery of that name's."""
    record = {"delivery_id": "d-1", "step": "package", "status": "COMPENSATION_FAILED", "attempt": 1,
              "reason": "", "recorded_at": "2026-12-05T00:00:00+00:00", "outcome": "", "undone": []}
    scan = Envelope.first("e-3", "", "Tick", "supervisor")
    # the last names another delivery in its envelope than in its body: its readers
    # dead-letter it unread, so it is no delivery's
    for correlation, filed in (("", {"d-1": {"package": "compensation_failed"}}),
                               ("d-1", {"d-1": {"package": "compensation_failed"}}), ("d-2", {})):
        rebuilder = _rebuilder(record)
        headers = [(k, correlation.encode() if k == H_CORRELATION_ID else v) for k, v in _headers(scan)]
        rebuilder._fact(Rec("compensation.log", 0, 5, 1_800_000_000_000, b"d-1|package", BODY, headers), {})
        assert rebuilder.compensation == filed
    # the scan never wrote a COMPENSATED one: such a record names no delivery (it would free a drone)
    rebuilder = _rebuilder({**record, "status": "COMPENSATED"})
    headers = [(k, b"" if k == H_CORRELATION_ID else v) for k, v in _headers(scan)]
    rebuilder._fact(Rec("compensation.log", 0, 5, 1_800_000_000_000, b"d-1|package", BODY, headers), {})
    assert rebuilder.compensation == {}


def test_reports_and_compensation_records_of_no_step_restore_nothing_and_errors_are_cut() -> None:
    """A report or a record naming a field of the delivery's state that is no step (say
    ``fanin.package``) was written into the state table and stopped the rebuild; an error of
    megabytes was kept for the whole rebuild."""
    envelope = Envelope.first("e-6", "d-1", "StepReport", "drone-scheduler")
    report = {"delivery_id": "d-1", "step": "drone", "kind": "FAILED", "attempt": 1, "service": "drone-scheduler",
              "source_topic": "delivery.requested", "source_event_id": "e-0", "error": "x" * 100_000,
              "reported_at": "2026-12-05T00:00:00+00:00"}
    for step, filed in (("drone", 1), ("fanin.package", 0), ("outcome", 0)):
        rebuilder = _rebuilder({**report, "step": step})
        rebuilder._fact(Rec("recovery", 0, 5, 1_800_000_000_000, b"d-1", BODY, _headers(envelope)), {})
        assert len(rebuilder.reports.get("d-1", {})) == filed
        assert all(len(error) == MAX_ERROR_CHARS for error in rebuilder.reports.get("d-1", {}).values())
    record = {"delivery_id": "d-1", "step": "fanin.package", "status": "COMPENSATED", "attempt": 1,
              "reason": "", "recorded_at": "2026-12-05T00:00:00+00:00", "outcome": "", "undone": []}
    rebuilder = _rebuilder(record)
    rebuilder._fact(Rec("compensation.log", 0, 5, 1_800_000_000_000, b"d-1|fanin.package", BODY,
                        _headers(Envelope.first("e-7", "d-1", "CompensationRecord", "supervisor"))), {})
    assert rebuilder.compensation == {}
    # a value its readers refuse for its size is not even decoded
    rebuilder = _rebuilder(report)
    rebuilder.decode = lambda topic, value: pytest.fail("decoded")  # type: ignore[method-assign]
    rebuilder._fact(Rec("recovery", 0, 5, 1_800_000_000_000, b"d-1", BODY + b"x" * MAX_VALUE_BYTES,
                        _headers(envelope)), {})
    assert rebuilder.reports == {}


def test_a_failure_whose_body_names_another_delivery_fails_none() -> None:
    """The supervisor dead-letters such a failure unread: the rebuild neither fails the
    delivery its envelope names nor the one its body names."""
    envelope = Envelope.first("e-4", "d-2", "DeliveryFailed", "delivery")
    rebuilder = _rebuilder(FAILURE)  # its body names d-1
    rebuilder._fact(Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-2", BODY, _headers(envelope)), {})
    assert not rebuilder.facts["d-2"].outcome and not rebuilder.facts["d-2"].undo
    assert "d-1" not in rebuilder.facts


def test_a_report_whose_body_names_another_delivery_is_not_filed() -> None:
    """The supervisor dead-letters such a report unread; a report whose body agrees is kept
    for the step it names."""
    report = {"delivery_id": "d-1", "step": "drone", "kind": "FAILED", "attempt": 1, "service": "drone-scheduler",
              "source_topic": "delivery.requested", "source_event_id": "e-0", "error": "x",
              "reported_at": "2026-12-05T00:00:00+00:00"}
    for correlation, filed in (("d-2", {}), ("d-1", {"d-1": {("drone", 1): "FAILED: x"}})):
        rebuilder = _rebuilder(report)
        envelope = Envelope.first("e-5", correlation, "StepReport", "drone-scheduler")
        rebuilder._fact(Rec("recovery", 0, 5, 1_800_000_000_000, correlation.encode(), BODY,
                            _headers(envelope)), {})
        assert rebuilder.reports == filed


def test_a_record_whose_body_names_another_delivery_begins_no_step_and_gives_no_fact() -> None:
    """The services dead-letter such a record unread (``events.disagrees_with``): it
    is no trigger of the envelope's delivery's steps (a requeue of it would be refused again
    and fail the delivery), and a shipment of that form ships nothing and ends no hold."""
    for body, begun in (({**REQUEST, "delivery_id": "d-1"}, set()), (REQUEST, {"package", "drone"})):
        rebuilder = _rebuilder(body, taken=False)
        envelope = Envelope.first("e-6", "d-2", "DeliveryRequested", "ingestion")
        consumed = {(s.name, "delivery.requested", 0): 6 for s in WORKFLOW.services}
        rebuilder._fact(Rec("delivery.requested", 0, 5, 1_800_000_000_000, b"d-2", BODY,
                            _headers(envelope)), consumed)
        assert set(rebuilder.facts["d-2"].triggers) == begun
        assert len(rebuilder.seen) == 2  # both readers consumed it: their dedupe saw it either way
    rebuilder = _rebuilder(SHIPPED)  # its body names d-1
    rebuilder._fact(_shipment(_headers(Envelope.first("e-7", "d-2", "DeliveryShipped", "delivery"))), {})
    assert not rebuilder.facts["d-2"].outcome and not rebuilder.facts["d-2"].ended
    assert "d-1" not in rebuilder.facts


CONSUMED = {(s.name, "delivery.requested", 0): 6 for s in WORKFLOW.services}


def _request(envelope: Envelope, value: bytes) -> Rec:
    return Rec("delivery.requested", 0, 5, 1_800_000_000_000, b"d-2", value, _headers(envelope))


def test_a_record_its_services_cannot_decode_begins_no_step() -> None:
    """The services dead-letter it unread (``Runner._prepare``): restored as a trigger, its
    step would be requeued with the same bytes and fail the delivery, or stand for a step
    that began on another record. Their dedupe saw it all the same."""
    envelope = Envelope.first("e-8", "d-2", "DeliveryRequested", "ingestion")
    rebuilder = _rebuilder(REQUEST, taken=False, decoded=False)  # the services' own decoders: these bytes are no Avro
    rebuilder._fact(_request(envelope, b"not avro at all"), CONSUMED)
    assert rebuilder.facts["d-2"].triggers == {}
    assert len(rebuilder.seen) == 2


def test_a_record_past_its_services_hop_limit_begins_no_step() -> None:
    envelope = Envelope.first("e-9", "d-2", "DeliveryRequested", "ingestion")
    limit = max(s.max_hops for s in WORKFLOW.services if "delivery.requested" in s.handlers)
    for hops, begun in ((limit + 1, set()), (limit, {"package", "drone"})):
        rebuilder = _rebuilder(REQUEST, taken=False)
        rebuilder._fact(_request(replace(envelope, hops=hops), BODY), CONSUMED)
        assert set(rebuilder.facts["d-2"].triggers) == begun, hops


@pytest.fixture()
def no_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry's URL is a port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SCHEMA_REGISTRY_URL", f"http://127.0.0.1:{port}")
    settings.cache_clear()
    forget_registry_clients()
    yield
    monkeypatch.undo()
    settings.cache_clear()
    forget_registry_clients()


def test_the_rebuild_stops_when_the_registry_does_not_answer(no_registry: None) -> None:
    """A body read as undecodable for want of a registry would be a fact missed (a booking
    not restored frees a drone still booked): the rebuild waits for it a while, then stops
    and says why."""
    rebuilder = Rebuilder(WORKFLOW, redis.Redis(), registry_wait_s=0.5)
    envelope = Envelope.first("e-10", "d-2", "DeliveryShipped", "delivery")
    with pytest.raises(RuntimeError, match="schema registry did not answer"):
        rebuilder._fact(_shipment(_headers(envelope)), {})


def test_a_record_its_reader_dead_letters_unread_gives_nothing_that_reader_does() -> None:
    """What a service does on reading a record (a record it keeps, a failure it reads) is
    restored only where it read it: committed past a shipment it dead-lettered unread, the
    notifier recorded no notification; past such a failure, the supervisor read none (the
    delivery's state waits for a reading, as it does in Redis)."""
    hostile = 10_000  # past every service's hop limit
    shipment = Envelope.first("e-11", "d-1", "DeliveryShipped", "delivery")
    consumed = {(s.name, topic, 0): 6 for s in WORKFLOW.services for topic in s.handlers}
    took, refused = _rebuilder(SHIPPED), _rebuilder(SHIPPED, taken=False)
    took._fact(_shipment(_headers(shipment)), consumed)
    refused._fact(_shipment(_headers(replace(shipment, hops=hostile))), consumed)
    assert took.facts["d-1"].records == {"notified": {"drone": "drone-00007"}}
    assert refused.facts["d-1"].records == {}
    assert refused.facts["d-1"].outcome == "shipped"  # the shipment itself stands: it was written
    failure = Envelope.first("e-12", "d-1", "DeliveryFailed", "delivery")
    took, refused = _rebuilder(FAILURE), _rebuilder(FAILURE, taken=False)
    took._fact(Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-1", BODY, _headers(failure)), consumed)
    refused._fact(Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-1", BODY,
                      _headers(replace(failure, hops=hostile))), consumed)
    assert (took.facts["d-1"].failure_unread, refused.facts["d-1"].failure_unread) == (False, True)


def test_a_part_or_a_failure_its_reader_would_dead_letter_restores_neither_result_nor_undo() -> None:
    """The join records a part's result on reading it, and the supervisor a failure's undo
    order: from a record they would dead-letter unread, consumed or not, neither is
    restored. Restored, such a part decided a join that never had it (a shipment after the
    rebuild), and such a failure's order stood before the real one's."""
    scheduled = {"delivery_id": "d-1", "drone_id": "drone-00007", "scheduled_at": "2026-12-05T00:00:00+00:00"}
    part = Envelope.first("e-13", "d-1", "DroneScheduled", "drone-scheduler")
    for hops, results in ((0, {"drone"}), (10_000, set())):
        rebuilder = _rebuilder(scheduled, taken=False)
        rebuilder.takes = lambda reader, env, r, decoded: env.hops <= reader.max_hops  # type: ignore[method-assign]
        rebuilder._fact(Rec("drone.scheduled", 0, 5, 1_800_000_000_000, b"d-1", BODY,
                            _headers(replace(part, hops=hops))), {})
        assert set(rebuilder.facts["d-1"].results) == results, hops
    failure = Envelope.first("e-14", "d-1", "DeliveryFailed", "delivery")
    for hops, undone in ((0, True), (10_000, False)):
        rebuilder = _rebuilder(FAILURE, taken=False)
        rebuilder.takes = lambda reader, env, r, decoded: env.hops <= reader.max_hops  # type: ignore[method-assign]
        rebuilder._fact(Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-1", BODY,
                            _headers(replace(failure, hops=hops))), {})
        assert bool(rebuilder.facts["d-1"].undo) == undone, hops


def test_a_schema_id_no_registry_holds_stops_no_rebuild(no_registry: None) -> None:
    """Four bytes of 0xff where the schema id goes: refused before any registry is asked (no
    registry answers here), so the rebuild neither waits nor stops, and begins no step."""
    rebuilder = Rebuilder(WORKFLOW, redis.Redis(), registry_wait_s=0.0)
    envelope = Envelope.first("e-15", "d-2", "DeliveryRequested", "ingestion")
    rebuilder._fact(_request(envelope, b"\x00\xff\xff\xff\xff" + b"\x02" * 40), CONSUMED)
    assert rebuilder.facts["d-2"].triggers == {}


def test_the_rebuild_stops_when_the_registry_is_silent_for_a_services_decoder() -> None:
    rebuilder = _rebuilder(REQUEST, taken=False)
    rebuilder.registry_wait_s = 0.0

    def silent(value: bytes | None) -> None:
        raise RegistryUnavailable("connection refused")

    rebuilder.decoders = dict.fromkeys(rebuilder.decoders, silent)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="schema registry did not answer"):
        rebuilder._fact(_request(Envelope.first("e-16", "d-2", "DeliveryRequested", "ingestion"), BODY),
                        CONSUMED)


def test_a_record_a_newer_writer_wrote_restores_what_its_first_version_would() -> None:
    """A v2 of a service adds an optional field to its event (the registry's BACKWARD
    check). Where no service of the workflow reads a fact's event, the rebuild reads the
    body as its writer wrote it: the field the model does not know is left out, as the
    services' decoder leaves it out, or the model would refuse the whole body, and a v2's
    bookings and parts would not be restored (a drone free while booked)."""
    scheduled = {"delivery_id": "d-1", "drone_id": "drone-00007", "scheduled_at": "2026-12-05T00:00:00+00:00",
                 "note": "a field of v2"}
    rebuilder = _rebuilder(scheduled)
    rebuilder.decoders.pop(("drone.scheduled", DroneScheduled))  # read from the writer's body
    rebuilder.takes = lambda reader, env, r, reads: True  # type: ignore[method-assign]
    envelope = Envelope.first("e-17", "d-1", "DroneScheduled", "drone-scheduler")
    rebuilder._fact(Rec("drone.scheduled", 0, 5, 1_800_000_000_000, b"d-1", BODY, _headers(envelope)), {})
    assert rebuilder.facts["d-1"].holds["fleet"].member == "drone-00007"
    assert set(rebuilder.facts["d-1"].results) == {"drone"}


def test_a_failure_listing_a_step_many_times_restores_it_once_in_the_undo_order() -> None:
    """As the supervisor records it (``outcomes.undoes``): a step listed a hundred times would
    be walked a hundred times by every script that reads the order (more, and the failure is
    refused: ``events.MAX_ITEMS``)."""
    rebuilder = _rebuilder({**FAILURE, "compensate": ["package"] * MAX_ITEMS})
    envelope = Envelope.first("e-18", "d-1", "DeliveryFailed", "delivery")
    rebuilder._fact(Rec("delivery.failed", 0, 5, 1_800_000_000_000, b"d-1", BODY, _headers(envelope)), {})
    assert rebuilder.facts["d-1"].undo["undo.order"] == "package"
