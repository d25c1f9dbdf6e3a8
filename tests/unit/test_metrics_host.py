"""Where /metrics binds: loopback unless told, and beyond loopback only when asked for."""

from __future__ import annotations

import pytest

from choreo.metrics import DEFAULT_HOST, MetricsRefused, bind_host


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHOREO_METRICS_HOST", raising=False)
    monkeypatch.delenv("CHOREO_METRICS_PUBLIC", raising=False)


def test_loopback_by_default_and_any_loopback_address_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bind_host() == DEFAULT_HOST == "127.0.0.1"
    for host in ("127.0.0.2", "::1", "[::1]", "localhost"):
        monkeypatch.setenv("CHOREO_METRICS_HOST", host)
        assert bind_host() == host


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "metrics.example.com"])
def test_beyond_loopback_only_when_asked_for(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.setenv("CHOREO_METRICS_HOST", host)
    with pytest.raises(MetricsRefused, match="CHOREO_METRICS_PUBLIC"):
        bind_host()
    monkeypatch.setenv("CHOREO_METRICS_PUBLIC", "yes")  # only "true" asks
    with pytest.raises(MetricsRefused):
        bind_host()
    monkeypatch.setenv("CHOREO_METRICS_PUBLIC", "true")
    assert bind_host() == host
