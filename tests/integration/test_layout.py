"""The state's layout version on the real Redis: versions of one layout keep what the other
wrote; a version never starts on a store of another layout."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from choreo import keys, layout
from choreo.publisher import Publisher
from choreo.state import STEP_FIELDS, Begin, StateTable, StepStatus, delivery_key
from consumers.workflow import WORKFLOW
from tests.factories import delivery_request
from tests.helpers import CLUSTER_URL, ServiceProcess, wait_for
from tests.integration.test_ops_pipeline import private_redis  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

# what a newer version of the same layout appended to a step record
NEWER = ["a value of a field this version does not know", 7]


def test_a_step_record_keeps_what_a_newer_version_appended(private_redis: redis.Redis) -> None:  # noqa: F811
    table = StateTable(private_redis)
    delivery_id, now = str(uuid.uuid4()), int(time.time() * 1000)
    key = delivery_key(delivery_id)
    table.open(delivery_id, "package", now + 30_000, now)
    record = json.loads(private_redis.hget(key, "package") or b"[]")
    written = record + [None] * (len(STEP_FIELDS) - len(record)) + NEWER
    private_redis.hset(key, "package", json.dumps(written))

    assert table.begin(delivery_id, "package", 1, now, 30_000, 3, "") == Begin.GO
    assert table.finish(delivery_id, "package", 1, now + 5, StepStatus.COMPLETED) == "ok"

    after = json.loads(private_redis.hget(key, "package") or b"[]")
    assert after[len(STEP_FIELDS):] == NEWER, "this version dropped what the newer one wrote"
    assert table.steps(delivery_id)["package"].status == StepStatus.COMPLETED


def test_no_process_starts_on_a_store_of_another_layout(private_redis: redis.Redis) -> None:  # noqa: F811
    url = CLUSTER_URL or "redis://{host}:{port}/0".format(**private_redis.connection_pool.connection_kwargs)
    private_redis.set(layout.LAYOUT_KEY, keys.LAYOUT + 1)

    service = ServiceProcess("consumers.package:service", instance=f"layout-{uuid.uuid4().hex[:6]}",
                             env={"REDIS_URL": url}).start()
    assert service.proc is not None
    assert service.proc.wait(60) != 0
    said = service.log_file.read_text(errors="replace")
    assert f"layout '{keys.LAYOUT + 1}'" in said and f"reads layout {keys.LAYOUT}" in said
    publisher = Publisher("test", WORKFLOW, redis_client=private_redis)
    request = delivery_request()
    with pytest.raises(layout.LayoutMismatch):
        publisher.publish(request, str(uuid.uuid4()), topic=f"layout.{uuid.uuid4().hex[:8]}")
    assert list(private_redis.scan_iter()) == [layout.LAYOUT_KEY.encode()], "a refused process wrote state"

    private_redis.delete(layout.LAYOUT_KEY)  # an empty store takes the layout of the first process
    publisher.open_steps([(request.delivery_id, "delivery.requested")])
    assert private_redis.get(layout.LAYOUT_KEY) == str(keys.LAYOUT).encode()


def test_a_running_service_stops_when_the_store_changes_layout_under_it(private_redis: redis.Redis) -> None:  # noqa: F811
    """After a FLUSHALL a process of another layout may claim the store first: a service
    already running must stop writing beside it, not go on."""
    url = CLUSTER_URL or "redis://{host}:{port}/0".format(**private_redis.connection_pool.connection_kwargs)
    service = ServiceProcess("consumers.notifier:service", instance=f"layout-{uuid.uuid4().hex[:6]}",
                             env={"REDIS_URL": url}).start()
    assert service.proc is not None
    try:
        wait_for(lambda: "service.started" in service.log_file.read_text(errors="replace"), timeout_s=60,
                 interval_s=0.5, what="the service running")
        private_redis.set(layout.LAYOUT_KEY, keys.LAYOUT + 1)
        assert service.proc.wait(60) != 0
        assert "layout.mismatch" in service.log_file.read_text(errors="replace")
    finally:
        service.kill()
