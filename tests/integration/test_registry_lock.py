"""The registry keeps answering the lookups every consumer depends on while a large schema
is checked for compatibility, and stops a check that takes too long.

Real registry processes (own port, own store topic), started as the stack starts them.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from tests.integration.test_registry_instances import Starter, instances  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

CT = {"Content-Type": "application/vnd.schemaregistry.v1+json"}
SMALL = json.dumps({"type": "record", "name": "Small", "namespace": "avail",
                    "fields": [{"name": "id", "type": "string"}]})


def big(extra: bool = False) -> str:
    """Eight records of 999 int fields each, in one (the bounds allow 1,000 fields a record
    and 256 KiB of text); ``extra`` adds an optional field, so ``big(True)`` is a
    BACKWARD-compatible successor of ``big()``. avro's checker takes time quadratic in a
    record's fields: seconds for it here, when two run at once."""
    parts: list[dict[str, Any]] = [
        {"name": f"p{j}", "type": {"type": "record", "name": f"Part{j}",
                                   "fields": [{"name": f"f{i:03d}", "type": "int"} for i in range(999)]}}
        for j in range(8)]
    if extra:
        parts.append({"name": "extra", "type": ["null", "int"], "default": None})
    return json.dumps({"type": "record", "name": "Big", "namespace": "avail", "fields": parts}, separators=(",", ":"))


def test_lookups_answer_fast_while_a_large_schema_is_checked(instances: Starter) -> None:
    _, url = instances("lock", SCHEMA_REGISTRY_COMPAT_TIMEOUT_S="60")
    with httpx.Client(base_url=url, timeout=60) as http:
        small_id = http.post("/subjects/small/versions", json={"schema": SMALL}, headers=CT).json()["id"]
        assert http.post("/subjects/big/versions", json={"schema": big()}, headers=CT).status_code == 200

    checking = threading.Event()
    answers: list[int] = []
    check_seconds: list[float] = []  # each whole check, as long as a lookup held by it would wait
    successor = big(True)

    def check_again_and_again(path: str, until: float) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < until:
                checking.set()
                started = time.monotonic()
                answers.append(http.post(path, json={"schema": successor}, headers=CT).status_code)
                check_seconds.append(time.monotonic() - started)

    until = time.monotonic() + 6
    checkers = [threading.Thread(target=check_again_and_again, args=(path, until), daemon=True)
                for path in ("/compatibility/subjects/big/versions/latest", "/compatibility/subjects/big/versions")]
    for thread in checkers:
        thread.start()
    assert checking.wait(10)
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=60) as http:
        time.sleep(0.5)  # the first checks are under way
        while time.monotonic() < until - 0.5:
            started = time.monotonic()
            assert http.get(f"/schemas/ids/{small_id}").status_code == 200
            assert http.post("/subjects/small", json={"schema": SMALL}, headers=CT).json()["id"] == small_id
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
        # a registration's own check runs outside the lock as well
        registering = threading.Thread(target=lambda: answers.append(http.post(
            "/subjects/big/versions", json={"schema": successor}, headers=CT).status_code))
        registering.start()
        time.sleep(0.3)
        started = time.monotonic()
        assert http.get(f"/schemas/ids/{small_id}").status_code == 200
        slowest = max(slowest, time.monotonic() - started)
        registering.join(60)
    for thread in checkers:
        thread.join(60)
    assert answers and set(answers) == {200}, answers
    # a lookup held by a check waits for the rest of it: the slowest of some twenty would
    # wait most of one (the checks take seconds here, the lookups a fraction of one)
    assert slowest < 0.5 * min(check_seconds), (
        f"a lookup took {slowest:.2f} s while a schema was being checked (checks took "
        f"{min(check_seconds):.2f}-{max(check_seconds):.2f} s)")


def test_a_check_past_its_deadline_is_refused_clearly(instances: Starter) -> None:
    _, url = instances("deadline", SCHEMA_REGISTRY_COMPAT_TIMEOUT_S="0.2")
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/subjects/big/versions", json={"schema": big()}, headers=CT).status_code == 200
        successor = big(True)
        for path in ("/subjects/big/versions", "/compatibility/subjects/big/versions/latest"):
            started = time.monotonic()
            refused = http.post(path, json={"schema": successor}, headers=CT)
            assert time.monotonic() - started < 2.0
            assert refused.status_code == 409, refused.text
            assert refused.json()["error_code"] == 409
            assert "0.2 s" in refused.json()["message"], refused.text
        assert http.get("/subjects/big/versions").json() == [1]  # nothing was registered
