"""``X-Choreo-Id`` is the deciding event's id, which its writer chose: it goes as it is only
when a header can carry it."""

from __future__ import annotations

import hashlib

from choreo.webhooks import header_id


def test_an_ordinary_id_goes_as_it_is() -> None:
    assert header_id("3f1c2a9e-6b1d-4c55-9f0e-0a4a7c1b2d3e") == "3f1c2a9e-6b1d-4c55-9f0e-0a4a7c1b2d3e"


def test_an_id_a_header_cannot_carry_goes_as_its_digest() -> None:
    for hostile in ("a\r\nX-Injected: 1", "é", "tab\there", "\udcff"):
        sent = header_id(hostile)
        assert sent == hashlib.sha256(hostile.encode(errors="surrogatepass")).hexdigest()
        assert len(sent) == 64 and sent.isascii() and sent.isprintable()
