"""The real Redis through the configured URL, with append-only persistence on."""

from __future__ import annotations

import pytest
import redis

pytestmark = pytest.mark.integration


def test_set_get_through_configured_url(redis_client: redis.Redis, unique: str) -> None:
    key = f"test:{unique}"
    redis_client.set(key, "value", ex=60)
    assert redis_client.get(key) == b"value"
    assert redis_client.config_get("appendonly")["appendonly"] == "yes"
