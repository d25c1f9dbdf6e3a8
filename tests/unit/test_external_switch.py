"""``CHOREO_EXTERNAL``: which servers are someone else's, read once for the stack and the
benchmarks alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pipeline import Private
from infra import stack
from infra.process import StackError


@pytest.mark.parametrize(("value", "expected"), [
    ("", set()), ("registry", {"registry"}), (" Kafka , redis,", {"kafka", "redis"}),
    ("kafka,redis,registry", {"kafka", "redis", "registry"})])
def test_the_switch_names_the_external_parts(value: str, expected: set[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stack.EXTERNAL_ENV, value)
    assert stack.external() == expected


def test_an_unknown_part_is_refused_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stack.EXTERNAL_ENV, "registry,zookeeper")
    with pytest.raises(StackError, match="zookeeper"):
        stack.external()


def test_the_benchmark_keeps_the_environments_address_for_an_external_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    private = Private(Path("/nonexistent"), kafka=19000, redis=19001, registry=19002, owned_dir=False)
    monkeypatch.setenv(stack.EXTERNAL_ENV, "")
    assert set(private.env) == {"KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "SCHEMA_REGISTRY_URL", "CHOREO_DATA_DIR"}
    monkeypatch.setenv(stack.EXTERNAL_ENV, "redis,registry")
    assert private.env == {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:19000", "CHOREO_DATA_DIR": "/nonexistent"}
