"""The .avsc contracts are the source of truth; the pydantic models must not drift from them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import fastavro
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, conlist

from choreo.events import MAX_ITEMS, Event
from choreo.runtime_events import RUNTIME_CONTRACTS
from schemas.models import ALL_EVENTS, DeliveryFailed, DeliveryRequested, Location, PackageReady

REPO = Path(__file__).resolve().parents[2]
# every contract directory with the models mirroring it: the domain's and the runtime's own
CONTRACTS = {REPO / "schemas": ALL_EVENTS, REPO / "choreo": RUNTIME_CONTRACTS}


def _nullable(avro_type: Any) -> bool:
    return isinstance(avro_type, list) and "null" in avro_type


def _check_record(model: type[BaseModel], schema: dict[str, Any]) -> None:
    avro_fields = {f["name"]: f for f in schema["fields"]}
    assert set(avro_fields) == set(model.model_fields), f"{schema['name']}: field names differ"
    for name, field in model.model_fields.items():
        avro = avro_fields[name]
        assert ("default" in avro) == (not field.is_required()), f"{schema['name']}.{name}: default"
        if "default" in avro:
            assert avro["default"] == field.default, f"{schema['name']}.{name}: default value"
        allows_none = "None" in repr(field.annotation)
        assert _nullable(avro["type"]) == allows_none, f"{schema['name']}.{name}: optionality"
        assert avro.get("doc"), f"{schema['name']}.{name} is undocumented"


@pytest.mark.parametrize("model", ALL_EVENTS + RUNTIME_CONTRACTS, ids=lambda m: m.__name__)
def test_model_matches_contract(model: Any) -> None:
    schema = json.loads(model.schema_file.read_text())
    assert schema["name"] == model.__name__
    assert schema["namespace"] == "com.dronepipe.events"
    _check_record(model, schema)


@pytest.mark.parametrize("directory", sorted(CONTRACTS), ids=lambda d: d.name)
def test_every_contract_has_a_model(directory: Path) -> None:
    models = CONTRACTS[directory]
    assert {p.stem for p in directory.glob("*.avsc")} == {m.__name__ for m in models}
    assert {m.schema_file.parent for m in models} == {directory}


def test_nested_location_matches() -> None:
    schema = json.loads(DeliveryRequested.schema_file.read_text())
    pickup = next(f for f in schema["fields"] if f["name"] == "pickup")["type"]
    _check_record(Location, pickup)


def test_model_round_trips_through_avro() -> None:
    now = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    event = DeliveryRequested(
        delivery_id="d1", owner_id="o1",
        pickup=Location(lat=1.0, lon=2.0, address="1 Main St"),
        dropoff=Location(lat=3.0, lon=4.0, address="2 High St"),
        package_size="SMALL", weight_kg=1.5, requested_at=now,
    )
    parsed = fastavro.parse_schema(json.loads(event.avro_schema()))
    buf = BytesIO()
    fastavro.schemaless_writer(buf, parsed, event.to_avro())
    buf.seek(0)
    assert DeliveryRequested.from_avro(fastavro.schemaless_reader(buf, parsed)) == event


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_no_event_takes_a_float_json_cannot_write(value: float) -> None:
    """Avro carries NaN and infinity; JSON, where a join keeps its parts, has neither (a part
    with NaN was written as null and could not be read back, failing the delivery)."""
    with pytest.raises(ValidationError):
        PackageReady(delivery_id="d", package_id="p", package_size="SMALL", weight_kg=value,
                     ready_at=datetime(2030, 1, 1, tzinfo=UTC))


def test_a_list_of_a_byte_an_item_is_refused_past_its_bound() -> None:
    """512 KiB of Avro, an empty string a byte: half a million items, some ten megabytes in
    Python for as long as the batch holds the record. The model refuses it (the runtime's
    decoder dead-letters it ``INVALID_PAYLOAD``)."""
    parsed = fastavro.parse_schema(json.loads(DeliveryFailed.avro_schema()))
    record = {"delivery_id": "d", "reason": "r", "failed_step": "s", "compensate": [""] * 500_000,
              "failed_at": datetime(2030, 1, 1, tzinfo=UTC)}
    buf = BytesIO()
    fastavro.schemaless_writer(buf, parsed, record)
    assert buf.tell() < 512 * 1024
    buf.seek(0)
    with pytest.raises(ValidationError, match="at most 100 items"):
        DeliveryFailed.from_avro(fastavro.schemaless_reader(buf, parsed))
    assert len(DeliveryFailed.from_avro({**record, "compensate": ["s"] * MAX_ITEMS}).compensate) == MAX_ITEMS


def test_an_event_model_with_an_unbounded_list_is_refused_where_it_is_declared() -> None:
    with pytest.raises(TypeError, match=r"Stops.names, Stop.tags, Stops.legs\[\]: every list an event carries"):
        class Stop(BaseModel):
            tags: dict[str, str]

        class Stops(Event):
            names: list[str] | None = None
            where: Stop
            legs: list[list[Stop]] = Field(default=[], max_length=3)

    with pytest.raises(TypeError, match=r"Loose.names, Loose.more: every list"):
        class Loose(Event):
            names: Sequence[str] = ()
            more: tuple[str, ...] = ()

    with pytest.raises(TypeError, match=r"Hops.where, Hops.legs\[\]: every model an event carries refuses NaN"):
        class Loc(BaseModel):
            lat: float

        class Hops(Event):  # a nested model does not take Event's config: a NaN passed it
            where: Loc
            legs: list[Loc] = Field(default=[], max_length=3)

    with pytest.raises(TypeError, match="Early names a type not yet defined"):
        class Early(Event):
            legs: list[Later] = Field(max_length=3)  # noqa: F821 - defined below: it could not be checked here

    class Later(BaseModel):
        model_config = ConfigDict(allow_inf_nan=False)
        names: list[str]

    @dataclass
    class Point:
        x: float
        xs: list[float]

    with pytest.raises(TypeError, match=r"Shapes.point, Shapes.anything: every record an event carries is a "
                                        r"pydantic model.*; Shapes.ratio: every model an event carries refuses NaN"):
        class Shapes(Event):  # a dataclass takes NaN and any number of items; Any is not walked
            point: Point
            anything: Any
            ratio: float = Field(allow_inf_nan=True)

    class FiniteLoc(BaseModel):
        model_config = ConfigDict(allow_inf_nan=False)
        lat: float

    class FiniteHops(Event):
        where: FiniteLoc

    with pytest.raises(ValidationError, match="finite number"):
        FiniteHops.model_validate({"where": {"lat": float("nan")}})

    class Bounded(Event):  # each list at each depth declared, whichever way
        legs: list[Annotated[list[str], Field(max_length=4)]] | None = Field(default=None, max_length=3)
        tags: conlist(str, max_length=5) = []  # type: ignore[valid-type]
        pair: tuple[str, str] = ("a", "b")
