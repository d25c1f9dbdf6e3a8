"""What operators see of a running service: JSON logs with the delivery, event and trace
ids bound and no customer data, and Prometheus metrics on a port."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from choreo.kafka import ensure_topics
from choreo.publisher import Publisher
from tests.factories import delivery_request
from tests.helpers import ServiceProcess, free_port, read_topic, wait_for

pytestmark = pytest.mark.integration


def test_logs_are_json_with_ids_and_no_customer_data_and_metrics_are_served(stack: None,
                                                                          unique: str) -> None:
    topic = f"t.obs.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq", f"retry.probe-{topic}.{topic}", "recovery"],
                  partitions=2)
    port = free_port()
    proc = ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic},
                          args=["--metrics-port", str(port)]).start()
    try:
        publisher = Publisher("test")
        good, hopeless = delivery_request(), delivery_request(weight_kg=9)  # 9 kg: retried, reported
        for request in (good, hopeless):
            publisher.publish(request, str(uuid.uuid4()), topic=topic)
        publisher.flush(10)
        wait_for(lambda: read_topic(f"{topic}.out"), what="the good one handled")
        # both read (they may be on two partitions, the good one's batch first), once each
        counted = f'choreo_events_in_total{{service="probe-{topic}",topic="{topic}"}} 2.0'
        metrics = wait_for(lambda: (t := httpx.get(f"http://127.0.0.1:{port}/metrics").text) and counted in t and t,
                           what="both events counted in the metrics")
        assert "choreo_handler_seconds_bucket" in metrics and "choreo_retries_total" in metrics

        def reported() -> list[dict]:
            lines = [json.loads(line) for line in proc.log_file.read_text().splitlines()
                     if line.startswith("{")]
            return [r for r in lines if r.get("event") == "step.reported"
                    and r.get("delivery_id") == hopeless.delivery_id]

        record = wait_for(reported, what="the report logged")[0]
        assert record["event_id"] and len(record["trace_id"]) == 32 and record["level"] == "warning"
        text = proc.log_file.read_text()
        for secret in (good.pickup.address, good.dropoff.address):
            assert secret not in text
    finally:
        proc.kill()


def test_metrics_bind_the_address_asked_for_and_beyond_loopback_only_when_asked(stack: None, unique: str) -> None:
    topic = f"t.obs.{unique}"
    ensure_topics([topic, f"{topic}.out", f"{topic}.dlq", f"retry.probe-{topic}.{topic}", "recovery"],
                  partitions=2)
    refused = ServiceProcess("tests.services.probe:service", instance="public", env={"PROBE_TOPIC": topic},
                             args=["--metrics-port", str(free_port()), "--metrics-host", "0.0.0.0"]).start()
    assert refused.proc is not None and refused.proc.wait(60) == 2
    assert "CHOREO_METRICS_PUBLIC" in refused.log_file.read_text()
    port = free_port()
    proc = ServiceProcess("tests.services.probe:service", env={"PROBE_TOPIC": topic},
                          args=["--metrics-port", str(port), "--metrics-host", "127.0.0.2"]).start()
    try:
        text = wait_for(lambda: (t := _metrics(f"http://127.0.0.2:{port}/metrics")) and t, what="metrics on 127.0.0.2")
        assert "choreo_events_in_total" in text
        with pytest.raises(httpx.ConnectError):  # only where it was asked to bind
            httpx.get(f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.kill()


def _metrics(url: str) -> str | None:
    try:
        return httpx.get(url).text
    except httpx.ConnectError:
        return None
