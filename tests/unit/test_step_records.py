"""How a delivery's Redis records are laid out: a step's record (its ``source``, the views
Python reads it through) and the event ids in dedupe and effect field names."""

from __future__ import annotations

import base64
import json
import uuid

import pytest

from choreo.dedupe import compact_id, seen_field
from choreo.service import Service
from choreo.state import STEP_FIELDS, Source, check_step_name, flat_fields, is_step_record, parse_steps, unpack_step


def test_a_source_read_where_its_handler_subscribes_is_written_short() -> None:
    plain = Source("delivery.requested", "delivery.requested", 3, 287)
    assert plain.text() == "delivery.requested|3|287"
    assert Source.parse(plain.text()) == plain
    retried = Source("delivery.requested", "package.retry", 0, 5)
    assert retried.text() == "delivery.requested|package.retry|0|5"
    assert Source.parse(retried.text()) == retried


def test_a_malformed_source_is_no_source() -> None:
    for raw in ("", "a|b", "a|b|c|d", "a|b|1|2|3", "t|x|1"):
        assert Source.parse(raw) is None, raw


def test_records_unpack_by_position_and_leave_absent_values_out() -> None:
    record = json.dumps(["completed", 20, 2, 1, 0, 15, "t|0|1", 15, None, None, "boom"])
    assert unpack_step(record) == {"status": "completed", "complete_by": "20", "attempt": "2",
                                   "tries": "1", "failures": "0", "updated": "15", "source": "t|0|1",
                                   "completed_at": "15", "error": "boom"}
    assert len(STEP_FIELDS) == len(set(STEP_FIELDS))


def test_the_flat_view_names_step_values_and_keeps_plain_fields() -> None:
    raw = {"drone": json.dumps(["failed", 9]), "fanin.drone": "ok:drone-1", "outcome": "failed",
           "fail.detail": "[not a record]"}
    assert not is_step_record("fail.detail", raw["fail.detail"])
    assert flat_fields(raw) == {"drone.status": "failed", "drone.complete_by": "9",
                                "fanin.drone": "ok:drone-1", "outcome": "failed",
                                "fail.detail": "[not a record]"}
    steps = parse_steps(raw)
    assert list(steps) == ["drone"] and steps["drone"].attempt == 1 and steps["drone"].tries == 0


def test_event_ids_in_field_names_are_compact_and_distinct() -> None:
    ids = [str(uuid.uuid5(uuid.NAMESPACE_URL, f"e{i}")) for i in range(1000)]
    compact = {compact_id(i) for i in ids}
    assert len(compact) == len(ids) and {len(c) for c in compact} == {22}
    assert seen_field("package", ids[0], 2) == f"package:{compact_id(ids[0])}:2"
    assert compact_id("not-a-uuid:with:colons") == "not-a-uuid:with:colons"  # a foreign producer's id
    # a field is read as <service>:<event id>:<attempt>: the service's part is the one without ':'
    for name in ("", "drone:scheduler"):
        with pytest.raises(ValueError, match="no ':'"):
            Service(name)


def test_an_id_compacts_as_uuid_reads_it_in_every_form_uuid_takes() -> None:
    """A service of another version, or the rebuild, must name the same event the same way."""
    def by_uuid(event_id: str) -> str:
        try:
            return base64.urlsafe_b64encode(uuid.UUID(event_id).bytes).rstrip(b"=").decode()
        except ValueError:
            return event_id

    one = uuid.uuid4()
    forms = [str(one), str(one).upper(), one.hex, "{%s}" % one, one.urn, f" {one} ",
             str(one).replace("-", " "), str(one)[:-1] + "g", str(one)[:-1], str(one) + "\n", "", "-" * 36]
    forms += [str(uuid.uuid4()) for _ in range(1000)]
    assert [compact_id(f) for f in forms] == [by_uuid(f) for f in forms]


def test_a_step_name_must_not_clash_with_the_hash_layout() -> None:
    assert check_step_name("release_drone") == "release_drone"
    for bad in ("", "fan.in", "outcome", "done", "dead_letters", "fanin", "fail"):
        with pytest.raises(ValueError, match="step name"):
            check_step_name(bad)
