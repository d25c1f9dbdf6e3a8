"""Which addresses a request may reach when it is not marked internal (no DNS needed: the
names are addresses)."""

from __future__ import annotations

import httpcore
import pytest

from choreo.bounded_http import public_address


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.10", "169.254.169.254", "100.64.0.1",
                                  "0.0.0.0", "fe80::1", "fd00::1"])
def test_a_loopback_private_or_link_local_address_is_refused(host: str) -> None:
    with pytest.raises(httpcore.ConnectError, match="no public address"):
        public_address(host, 443)


def test_a_public_address_is_reached() -> None:
    assert public_address("8.8.8.8", 443) == "8.8.8.8"
    assert public_address("2001:4860:4860::8888", 443) == "2001:4860:4860::8888"
