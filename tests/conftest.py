"""Shared fixtures: the real local stack is started once per session (idempotent)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import redis

# set before anything imports ``choreo``, whose modules may read the settings (and cache them)
# as they load. The workflow ``choreo.supervisor`` watches when a test imports it in process
# (``choreo run`` sets it from --workflow; the tests that run a supervisor of their own name
# theirs)
os.environ.setdefault("SUPERVISOR_WORKFLOW", "consumers.workflow:WORKFLOW")
# tests on the open local stack publish to throwaway topics of their own, whose schemas no
# deploy registered: there producers register on first use (the secured stack's env files
# turn it off, as a deployment does)
os.environ.setdefault("SCHEMA_REGISTRY_AUTO_REGISTER", "true")

from choreo.config import settings  # noqa: E402
from choreo.redis_client import connect  # noqa: E402

if TYPE_CHECKING:
    from tests.pipeline import Pipeline


# the ``unique`` suffixes this session handed out: its tests' own topics carry them, and
# the session deletes those topics at its end (only its own: another session may run beside
# it), or a day of runs leaves the broker tens of thousands of partition directories and it
# runs out of file descriptors
SESSION_SUFFIXES: set[str] = set()


@pytest.fixture(scope="session")
def stack() -> Iterator[None]:
    from choreo import topology
    from consumers.workflow import WORKFLOW
    from infra import stack as local_stack

    local_stack.start()
    # the workflow's own topics, as a deploy creates them first: a test's prefixed flow names
    # its outputs by model (unprefixed), and would otherwise create them with its own count
    topology.create(WORKFLOW)
    yield
    delete_session_topics()


def delete_session_topics() -> None:
    """Best effort: a broker that is down or slow by now fails no test."""
    from confluent_kafka import KafkaException

    from choreo.kafka import admin

    client = admin()
    try:
        names = [name for name in client.list_topics(timeout=10).topics
                 if any(suffix in name for suffix in SESSION_SUFFIXES)]
        for start in range(0, len(names), 200):
            for future in client.delete_topics(names[start:start + 200], operation_timeout=30).values():
                future.exception(timeout=60)
    except (KafkaException, TimeoutError):
        pass


@pytest.fixture(scope="session")
def bootstrap(stack: None) -> str:
    return settings().kafka_bootstrap_servers


@pytest.fixture()
def redis_client(stack: None) -> redis.Redis:
    return connect(settings().redis_url)


@pytest.fixture()
def unique() -> str:
    """A short unique suffix so tests never share topics, groups or keys."""
    suffix = uuid.uuid4().hex[:10]
    SESSION_SUFFIXES.add(suffix)
    return suffix


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
