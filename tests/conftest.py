"""Shared fixtures: the real local stack is started once per session (idempotent)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import redis

from choreo.config import settings
from choreo.redis_client import connect

# the workflow ``choreo.supervisor`` watches when a test imports it in process (``choreo run``
# sets it from --workflow; the tests that run a supervisor of their own name theirs)
os.environ.setdefault("SUPERVISOR_WORKFLOW", "consumers.workflow:WORKFLOW")
# tests on the open local stack publish to throwaway topics of their own, whose schemas no
# deploy registered: there producers register on first use (the secured stack's env files
# turn it off, as a deployment does)
os.environ.setdefault("SCHEMA_REGISTRY_AUTO_REGISTER", "true")

if TYPE_CHECKING:
    from tests.pipeline import Pipeline


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
    return connect(settings().redis_url)


@pytest.fixture()
def unique() -> str:
    """A short unique suffix so tests never share topics, groups or keys."""
    return uuid.uuid4().hex[:10]


@pytest.fixture()
def pipeline(stack: None) -> Iterator[Pipeline]:
    """The workflow's five services running as real processes, killed after the test."""
    from choreo import topology
    from consumers.workflow import WORKFLOW
    from tests.pipeline import Pipeline

    topology.create(WORKFLOW)
    running = Pipeline().start()
    yield running
    running.kill()
