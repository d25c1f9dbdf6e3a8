"""Derived event ids: deterministic (a redo gets the same id, so consumers dedupe it), and
exactly the UUIDv5 they always were (ids already in topics and Redis must still match)."""

from __future__ import annotations

import uuid

from hypothesis import given, strategies as st

from choreo.envelope import ID_NAMESPACE, derived_id

# text that UTF-8 can encode (no lone surrogates), as every id part is
parts = st.lists(st.text(st.characters(blacklist_categories=("Cs",))), min_size=1, max_size=4)


@given(parts)
def test_a_derived_id_is_the_uuid5_of_its_parts(values: list[str]) -> None:
    assert derived_id(*values) == str(uuid.uuid5(ID_NAMESPACE, "\x1f".join(values)))


def test_a_derived_id_is_a_version_5_uuid_and_tells_its_inputs_apart() -> None:
    made = uuid.UUID(derived_id("delivery-1", "package.ready"))
    assert made.version == 5 and made.variant == uuid.RFC_4122
    assert derived_id("a", "bc") != derived_id("ab", "c")  # the separator keeps parts apart
