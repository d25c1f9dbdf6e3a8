"""A rolling upgrade on the real stack: version 2 of the package service runs beside
version 1 in one consumer group while deliveries flow, then version 1 stops, with no drain.

Version 2 (``tests/services/v2``) adds an optional field to the two events it produces and
two fields to the package record. The run is arranged so that each kind of crossing
happens for certain, not by the luck of a partition assignment:

1. version 1 alone prepares the packages of a first set of deliveries, with the delivery
   service stopped (nothing is decided yet);
2. version 2 joins the group beside it. The group's assignment (cooperative-sticky) gives
   it the retry topic's partitions and leaves the inputs to version 1, which the test
   checks. Version 1 prepares part of a second set; the rest (parcels it is told to put
   off) it begins and answers with a transient error, and version 2 finishes those steps
   from the retry topic, on the state version 1 left;
3. while a third set is submitted, version 1 stops (SIGTERM: it finishes its batch and
   leaves), and the rest of that set goes to version 2 alone; then the delivery service
   starts and decides everything.

So every cancel (a parcel too heavy for any drone fails its delivery, whose package is
then cancelled) is run by version 2, on records that either version wrote, and the
delivery service (version 1 of its contracts) reads packages announced by both. Every
delivery must end exactly once, every failed one's package be cancelled exactly once by
a cancel that found its record.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from choreo.envelope import derived_id
from choreo.kafka import admin, ensure_topics
from choreo.ops.records import BodyDecoder
from tests.helpers import Record, ServiceProcess, read_topic, wait_consuming, wait_for
from tests.integration.test_ops_pipeline import IsolatedPipeline, isolated, private_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

PER_SET, HEAVY_PER_SET = 12, 4  # HEAVY: 99 kg, more than any drone carries: failed, package cancelled
HANDED_OVER_KG = 7.5  # version 1 answers these with a transient error: version 2 takes them from the retry topic


def _by_delivery(records: list[Record], ids: set[str]) -> dict[str, list[Record]]:
    found: dict[str, list[Record]] = {}
    for record in records:
        key = record.key.decode() if record.key else ""
        if key in ids:
            found.setdefault(key, []).append(record)
    return found


def _schema_id(record: Record) -> int:
    return int.from_bytes((record.value or b"\0\0\0\0\0")[1:5], "big")


def _owners(group: str, prefix: str) -> tuple[set[str], set[str]]:
    """Which versions (the instance ids' ``v2`` or not) hold the package step's input
    partitions, and which its retry partitions."""
    client = admin()  # kept alive until the answer is in
    found = client.describe_consumer_groups([group], request_timeout=5)[group].result(timeout=5)
    inputs, retries = set(), set()
    for member in found.members:
        version = "v2" if member.client_id.endswith("-v2") else "v1"
        for tp in member.assignment.topic_partitions:
            if tp.topic == prefix + "delivery.requested":
                inputs.add(version)
            elif tp.topic == f"retry.{prefix}package.{prefix}delivery.requested":
                retries.add(version)
    return inputs, retries


def _submit_set(pipeline: IsolatedPipeline) -> tuple[set[str], set[str]]:
    """A set of deliveries: (all, the heavy ones)."""
    heavy = set(pipeline.submit(HEAVY_PER_SET, weight_kg=99.0))
    return set(pipeline.submit(PER_SET - HEAVY_PER_SET)) | heavy, heavy


def _prepared(pipeline: IsolatedPipeline, ids: set[str]) -> Callable[[], bool]:
    return lambda: len(_by_delivery(read_topic(pipeline.prefix + "package.ready"), ids)) == len(ids)


def test_version_2_beside_version_1_then_alone_every_delivery_ends_once(isolated: IsolatedPipeline) -> None:
    prefix, group = isolated.prefix, isolated.prefix + "package"
    ensure_topics({prefix + "compensation.log": 3}, config={"cleanup.policy": "compact"})
    isolated.env = {"OPS_PACKAGE_PUTS_OFF_KG": str(HANDED_OVER_KG)}  # version 1 leaves these to the retry topic
    isolated.start()
    isolated.supervise(f"sup-{prefix}")  # it asks for the undo of a failed delivery's package
    by_role = {proc.ref.rsplit(":", 1)[1]: proc for proc in isolated.procs}
    v1, delivery = by_role["package"], by_role["delivery"]
    delivery.stop()  # nothing is decided until version 1 is gone
    wait_consuming([group], members=1)

    first, heavy = _submit_set(isolated)
    wait_for(_prepared(isolated, first), timeout_s=60, interval_s=0.5, what="version 1 preparing the first set")

    v2 = ServiceProcess(v1.ref, instance="v2", env={**v1.env, "OPS_PACKAGE_VERSION": "2", "OPS_PACKAGE_PUTS_OFF_KG": ""},
                        workflow=v1.workflow).start()
    isolated.procs.append(v2)
    wait_consuming([group], members=2)
    inputs, retries = _owners(group, prefix)
    assert inputs == {"v1"} and retries == {"v2"}, (
        f"the group's assignment moved the retry partitions to {retries}, the inputs to {inputs}: "
        "this test hands steps from version 1 to version 2 through the retry topic")
    second, more_heavy = _submit_set(isolated)
    handed_over = set(isolated.submit(PER_SET - HEAVY_PER_SET, weight_kg=HANDED_OVER_KG))
    second |= handed_over
    heavy |= more_heavy
    wait_for(_prepared(isolated, second), timeout_s=60, interval_s=0.5, what="both versions preparing the second set")

    third, more_heavy = _submit_set(isolated)  # in flight while version 1 stops
    heavy |= more_heavy
    assert v1.stop() == 0, "version 1 did not stop cleanly"
    third_later, more_heavy = _submit_set(isolated)
    third |= third_later
    heavy |= more_heavy
    delivery.start()

    everyone = first | second | third
    ended = wait_for(lambda: (lambda c: c if len(c) == len(everyone) else None)(isolated.terminal(everyone)),
                     timeout_s=120, interval_s=1, what="every delivery to end")
    assert set(ended.values()) == {1}, f"ended more than once: {[d for d, n in ended.items() if n != 1]}"
    failed = _by_delivery(read_topic(prefix + "delivery.failed"), everyone)
    assert set(failed) == heavy, "a delivery failed that should have shipped, or the reverse"
    assert v2.alive(), "version 2 stopped"

    # who prepared what: version 1 alone the first set, version 2 alone the last; the second
    # went to whichever version its partition was assigned to
    ready = _by_delivery(read_topic(prefix + "package.ready"), everyone)
    assert all(len(records) == 1 for records in ready.values()), "a package was announced twice"
    [v1_ready] = {_schema_id(ready[d][0]) for d in first}
    prepared_by = {d: ("v1" if _schema_id(records[0]) == v1_ready else "v2") for d, records in ready.items()}
    assert {prepared_by[d] for d in third_later} == {"v2"}
    assert {prepared_by[d] for d in second - handed_over} == {"v1"}
    assert {prepared_by[d] for d in handed_over} == {"v2"}
    retried = _by_delivery(read_topic(f"retry.{prefix}package.{prefix}delivery.requested"), handed_over)
    assert set(retried) == handed_over, "a step was not begun by version 1 and finished by version 2"

    # every cancel ran on version 2 and found the record, whichever version wrote it
    cancels = wait_for(lambda: (lambda c: c if len(c) == len(heavy) else None)(
        _by_delivery(read_topic(prefix + "package.cancelled"), heavy)),
        timeout_s=60, interval_s=1, what="every failed delivery's package cancelled")
    decode = BodyDecoder()
    for delivery_id, records in cancels.items():
        assert len(records) == 1, f"{delivery_id}'s package was cancelled {len(records)} times"
        body = decode(prefix + "package.cancelled", records[0].value)
        assert isinstance(body, dict) and "label" in body, f"not cancelled by version 2: {body}"
        package_id = derived_id(delivery_id, "package")
        assert body["package_id"] == package_id, f"the cancel of {delivery_id} did not find its record"
        written_by_v2 = prepared_by[delivery_id] == "v2"
        assert (body["label"] is not None) == written_by_v2, (delivery_id, prepared_by[delivery_id], body)
    crossed = Counter(prepared_by[d] for d in heavy)
    assert crossed["v1"] > 0 and crossed["v2"] > 0, f"cancels did not cover both versions' records: {crossed}"
    print(f"rolling upgrade: {len(everyone)} deliveries ended once; side by side, version 1 prepared "
          f"{len(second - handed_over)} and version 2 finished {len(handed_over)} steps version 1 began; "
          f"{len(heavy)} cancels by version 2 of packages prepared by {dict(crossed)}")
