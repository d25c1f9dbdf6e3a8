"""The chaos runner's own plumbing (the run itself is tests/chaos)."""

from __future__ import annotations

from choreo.serde import registry_client
from infra.chaos import using

URL = "http://127.0.0.1:18081"  # the private registry of every chaos run (never contacted here)


def test_each_private_stack_gets_registry_clients_of_its_own() -> None:
    """A second run in one process starts a new, empty registry on the same port: a client
    kept from the first answered registrations from its cache with the first registry's
    ids, and every service dead-lettered the requests as UNKNOWN_SCHEMA."""
    first = registry_client(URL)
    with using({"SCHEMA_REGISTRY_URL": URL}):
        during = registry_client(URL)
        assert during is not first
        assert registry_client(URL) is during  # still one client per URL within a run
    assert registry_client(URL) is not during
