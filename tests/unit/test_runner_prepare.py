"""The runner's guard of one input (``Runner._prepare``), before any handler reads it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from choreo.envelope import Envelope
from choreo.errors import DeadLetterReason
from choreo.runner import Refused, Runner, Work
from consumers.drone_scheduler import service
from tests.factories import delivery_request


def _prepared(body_delivery: str, envelope_delivery: str, owner: str = "") -> Work | Refused | None:
    """A request whose body names ``body_delivery`` (owner-1's), read under an envelope."""
    runner: Any = object.__new__(Runner)
    runner.service = service
    runner.log = SimpleNamespace(bind=lambda **fields: fields)
    runner.decoders = {"delivery.requested": lambda value: delivery_request(body_delivery)}
    message = SimpleNamespace(topic=lambda: "delivery.requested", value=lambda: b"\x00bytes")
    return runner._prepare(message, Envelope.first("e-1", envelope_delivery, "DeliveryRequested", "test",
                                                   owner=owner))


def test_an_input_whose_body_names_another_delivery_than_its_envelope_is_refused() -> None:
    """The step, its dedupe and its fence are the envelope's delivery's, the drone the body's:
    such an input would book a drone for a delivery (one shipped, say) that nothing gives back."""
    refused = _prepared("d-shipped", "d-new")
    assert isinstance(refused, Refused) and refused.reason is DeadLetterReason.INVALID_PAYLOAD
    assert refused.detail == "its body names another delivery than its envelope (9 characters)"
    assert isinstance(_prepared("d-new", "d-new"), Work)


def test_a_request_whose_body_names_another_owner_than_its_envelope_is_refused() -> None:
    """Its outcome is told to the envelope's owner, and its status read by the body's."""
    for owner, refused in (("owner-2", True), ("owner-1", False), ("", False)):
        assert isinstance(_prepared("d-1", "d-1", owner), Refused) is refused, owner
