"""Shared fixtures: the real local stack is started once per session (idempotent)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from choreo.config import settings


@pytest.fixture(scope="session")
def stack() -> Iterator[None]:
    from infra import stack as local_stack

    local_stack.start()
    yield


@pytest.fixture(scope="session")
def bootstrap(stack: None) -> str:
    return settings().kafka_bootstrap_servers


@pytest.fixture()
def redis_client(stack: None) -> redis.Redis:
    return redis.Redis.from_url(settings().redis_url)


@pytest.fixture()
def unique() -> str:
    """A short unique suffix so tests never share topics, groups or keys."""
    return uuid.uuid4().hex[:10]
