"""One delivery is one trace: the ingestion's spans (the SDK's in-memory exporter, in this
process) and every service's spans (exported over OTLP/HTTP by the real service processes to
a receiver in this test) share the trace id and form one tree through the traceparent header;
each batched Redis round trip is a span linked to the handler spans it served."""

from __future__ import annotations

import gzip
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from choreo import topology, tracing
from consumers.workflow import WORKFLOW
from tests.factories import request_body
from tests.helpers import free_port, wait_for
from tests.ingestion import ingestion_settings, serving
from tests.pipeline import Pipeline, wait_terminal

pytestmark = pytest.mark.integration


@pytest.fixture()
def collector() -> Iterator[tuple[list[dict[str, Any]], int]]:
    """An OTLP/HTTP trace receiver: every span it was sent, flattened."""
    spans: list[dict[str, Any]] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                raw = gzip.decompress(raw)
            request = ExportTraceServiceRequest.FromString(raw)
            with lock:
                for resource in request.resource_spans:
                    service = next(a.value.string_value for a in resource.resource.attributes
                                   if a.key == "service.name")
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            spans.append({"service": service, "name": span.name,
                                          "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                                          "parent_id": span.parent_span_id.hex(),
                                          "links": [(link.trace_id.hex(), link.span_id.hex())
                                                    for link in span.links]})
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield spans, port
    server.shutdown()
    server.server_close()


def test_one_delivery_is_one_trace_across_ingestion_and_every_service(
        collector: tuple[list[dict[str, Any]], int], unique: str) -> None:
    received, port = collector
    memory = InMemorySpanExporter()
    tracing.install(tracing.provider("ingestion", SimpleSpanProcessor(memory)))
    topology.create(WORKFLOW)
    running = Pipeline(env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                            "OTEL_BSP_SCHEDULE_DELAY": "200"}).start()
    try:
        with serving(ingestion_settings(unique)) as url:
            answer = httpx.post(f"{url}/deliveries", json=request_body(owner_id=f"owner-{unique}"), timeout=30)
            assert answer.status_code == 202, answer.text
            delivery_id = answer.json()["delivery_id"]
        wait_terminal({delivery_id}, timeout_s=90)
        mine = [s for s in memory.get_finished_spans() if s.attributes
                and s.attributes.get("choreo.delivery_id") == delivery_id]
        root = next(s for s in mine if s.name == "ingest delivery.requested")
        assert root.parent is None
        trace_id = f"{root.context.trace_id:032x}"
        wanted = {("package", "handle delivery.requested"), ("drone-scheduler", "handle delivery.requested"),
                  ("delivery", "handle package.ready"), ("delivery", "handle drone.scheduled"),
                  ("delivery", "produce delivery.shipped"), ("notifier", "handle delivery.shipped")}
        wait_for(lambda: wanted <= {(s["service"], s["name"]) for s in received if s["trace_id"] == trace_id},
                 timeout_s=30, what="every service's spans of the delivery")
    finally:
        for proc in running.procs:
            proc.stop()
        tracing.install(None)
    spans = [s for s in received if s["trace_id"] == trace_id]
    spans += [{"service": "ingestion", "name": s.name, "trace_id": f"{s.context.trace_id:032x}",
               "span_id": f"{s.context.span_id:016x}",
               "parent_id": f"{s.parent.span_id:016x}" if s.parent else ""} for s in mine]
    assert {s["trace_id"] for s in spans} == {trace_id}
    ids = {s["span_id"] for s in spans}
    orphans = [s for s in spans if s["parent_id"] and s["parent_id"] not in ids]
    assert not orphans, orphans  # one tree: every span's parent is a span of the trace
    assert [s for s in spans if not s["parent_id"]] == [next(s for s in spans if s["name"] == "ingest delivery.requested")]

    # each batched Redis round trip is a span of its own trace (it served a whole batch, of
    # many deliveries), linked to the handler spans of the batch: the delivery's included
    handlers = {(s["trace_id"], s["span_id"]): s["service"] for s in spans if s["name"].startswith("handle ")}
    batches = [s for s in received if s["name"] == "redis batch"]
    served = [s for s in batches if any(tuple(link) in handlers for link in s["links"])]
    assert {s["service"] for s in served} >= {"package", "drone-scheduler", "delivery", "notifier"}
    assert all(not s["parent_id"] and s["trace_id"] != trace_id for s in batches)
    for s in served:  # a round trip links only to handler spans of its own service
        assert {handlers[tuple(link)] for link in s["links"] if tuple(link) in handlers} == {s["service"]}
    # every step's begin, effects and finish: several round trips served each handler
    linked = Counter(tuple(link) for s in served for link in s["links"])
    assert all(linked[key] >= 2 for key, service in handlers.items() if service in ("package", "delivery"))
