"""The ingestion edge's pure logic: request validation, content types, ids, CLI parsing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import typer

from producers.cli import parse_location
from producers.ingestion import canonical_uuid, is_json
from producers.model import DeliveryRequestIn, InvalidRequest, parse_request
from producers.submit import event_id_for, idempotency_redis_key
from tests.factories import request_body


def errors_of(data: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(data)
    return caught.value


def fields_of(data: Any) -> set[str]:
    return {e["field"] for e in errors_of(data).errors}


def test_a_valid_body_becomes_the_event_with_the_contract_types() -> None:
    request = parse_request(json.dumps(request_body()))
    event = request.to_event("d-1", datetime.now(UTC))
    assert event.delivery_id == "d-1" and event.owner_id == "owner-1"
    assert type(event.pickup).__name__ == "Location"  # the contract's type, not the edge's
    assert event.weight_kg == 1.5 and event.deadline is None


@pytest.mark.parametrize("form", ["json", "dict"])
def test_same_validation_from_json_and_from_python(form: str) -> None:
    body = request_body(pickup={"lat": 91, "lon": 0, "address": "x"})
    data = json.dumps(body) if form == "json" else body
    assert fields_of(data) == {"pickup.lat"}


@pytest.mark.parametrize("overrides, field", [
    ({"weight_kg": -1}, "weight_kg"),
    ({"weight_kg": 0}, "weight_kg"),
    ({"weight_kg": 5000}, "weight_kg"),
    ({"weight_kg": "1.5"}, "weight_kg"),  # strict: a string is not a number
    ({"package_size": "HUGE"}, "package_size"),
    ({"owner_id": ""}, "owner_id"),
    ({"owner_id": "a b"}, "owner_id"),
    ({"owner_id": "x" * 200}, "owner_id"),
    ({"dropoff": {"lat": 0, "lon": 181, "address": "x"}}, "dropoff.lon"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "x" * 501}}, "dropoff.address"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "   "}}, "dropoff.address"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "a\u0000b"}}, "dropoff.address"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "\x1b[31mred"}}, "dropoff.address"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "evil\u202etxt.exe"}}, "dropoff.address"),
    ({"dropoff": {"lat": 0, "lon": 1, "address": "x", "extra": 1}}, "dropoff.extra"),
    ({"deadline": "2001-01-01T00:00:00Z"}, "deadline"),
    ({"deadline": "9999-12-31T00:00:00Z"}, "deadline"),
    ({"deadline": "2030-01-01T00:00:00"}, "deadline"),  # naive: ambiguous
    ({"deadline": "tomorrow"}, "deadline"),
    ({"reply_topic": "bad topic!"}, "reply_topic"),
    ({"reply_topic": ".."}, "reply_topic"),
    ({"reply_topic": "delivery.shipped"}, "reply_topic"),  # a feedback loop into the pipeline
    ({"reply_topic": "__consumer_offsets"}, "reply_topic"),
    ({"reply_topic": "acme.outcomes"}, "reply_topic"),  # not under the reply prefix (the ACL)
    ({"reply_topic": "replies."}, "reply_topic"),
    ({"unexpected": True}, "unexpected"),
])
def test_invalid_fields_are_named(overrides: dict[str, Any], field: str) -> None:
    assert field in fields_of(json.dumps(request_body(**overrides)))


def test_missing_fields_are_each_reported() -> None:
    body = request_body()
    del body["weight_kg"], body["pickup"]
    assert fields_of(json.dumps(body)) == {"weight_kg", "pickup"}


def test_nan_and_infinity_are_refused() -> None:
    text = json.dumps(request_body()).replace("1.5", "NaN")
    assert "weight_kg" in fields_of(text)
    assert "weight_kg" in fields_of(request_body(weight_kg=float("inf")))


@pytest.mark.parametrize("raw", [b"{", b"", b"\xff\xfe{}", b"[" * 5000 + b"]" * 5000,
                                 b'{"owner_id": ' + b"[" * 3000 + b"]" * 3000 + b"}"])
def test_malformed_json_is_flagged_as_such(raw: bytes) -> None:
    assert errors_of(raw).malformed


def test_errors_never_echo_the_input() -> None:
    secret = "Secret Street 7"
    exc = errors_of(json.dumps(request_body(pickup={"lat": 100, "lon": 0, "address": secret + "\u0000"})))
    assert secret not in json.dumps(exc.errors) and secret not in str(exc)


def test_a_body_of_thousands_of_unknown_keys_is_told_by_its_first_errors() -> None:
    """Each unknown key is an error naming its key: told whole, 64 KiB of them would make an
    answer ten times the body."""
    body = {**request_body(), **{str(n) + "k" * 200: 0 for n in range(3_000)}}
    with pytest.raises(InvalidRequest) as info:
        parse_request(json.dumps(body))
    assert info.value.total == 3_000 and len(info.value.errors) == 20
    assert max(len(e["field"]) for e in info.value.errors) == 100


def test_a_valid_deadline_and_reply_topic_pass() -> None:
    deadline = datetime.now(UTC) + timedelta(hours=3)
    request = parse_request(request_body(deadline=deadline.isoformat(), reply_topic="replies.acme.outcomes"))
    assert request.deadline == deadline and request.deadline_ms == int(deadline.timestamp() * 1000)


def test_fingerprint_ignores_how_the_json_was_written() -> None:
    a = parse_request(json.dumps(request_body()))
    b = parse_request(json.dumps(request_body(), indent=4, sort_keys=True))
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != parse_request(request_body(weight_kg=2)).fingerprint()


def test_the_model_instance_passes_through() -> None:
    request = DeliveryRequestIn.model_validate(request_body())
    assert parse_request(request) is request


@pytest.mark.parametrize("value, ok", [
    ("application/json", True), ("Application/JSON; charset=UTF-8", True),
    ('application/json; charset="utf-8"', True), ("application/json; charset=latin-1", False),
    ("text/plain", False), ("application/xml", False), ("", False), (None, False),
    ("application/jsonp", False), ("multipart/form-data; boundary=x", False),
])
def test_content_types(value: str | None, ok: bool) -> None:
    assert is_json(value) is ok


def test_delivery_ids_must_be_canonical_uuids() -> None:
    assert canonical_uuid("2797d0c4-c56b-4972-806d-1f466b075f5d")
    assert canonical_uuid("2797D0C4-C56B-4972-806D-1F466B075F5D")
    for bad in ("nope", "2797d0c4c56b4972806d1f466b075f5d", "{2797d0c4-c56b-4972-806d-1f466b075f5d}",
                "../../etc/passwd", ""):
        assert not canonical_uuid(bad)


def test_event_id_is_stable_per_delivery_and_keys_are_scoped_by_owner() -> None:
    assert event_id_for("d-1") == event_id_for("d-1") != event_id_for("d-2")
    assert idempotency_redis_key("a", "k") != idempotency_redis_key("b", "k")
    assert len(idempotency_redis_key("a", "k" * 255)) < 60


def test_cli_locations() -> None:
    assert parse_location("--pickup", "52.5,13.4,Main St 1, Berlin") == {
        "lat": 52.5, "lon": 13.4, "address": "Main St 1, Berlin"}
    for bad in ("52.5,13.4", "north,13.4,x"):
        with pytest.raises(typer.BadParameter):
            parse_location("--pickup", bad)
