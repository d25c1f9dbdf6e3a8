"""OpenTelemetry spans of a delivery's story, joined through the envelope's ``traceparent``.

One delivery is one trace: the entry point's ``ingest`` span is its root and carries the
ids the first envelope's ``traceparent`` names (``EnvelopeIds``), each handler's span is a
child of the span that produced its input, and each produce's span is the parent the
output's ``traceparent`` names. The ids are the envelope's own (W3C), so the logs'
``trace_id`` and the tracing backend's are the same.

A batched Redis round trip (``choreo.batch.run_together``) serves every event of the batch,
of many deliveries: no one delivery's trace can hold it. Its ``redis batch`` span starts a
trace of its own and is linked to each handler span open on the thread (the batch's), so a
backend shows, from either side, which round trips a handler waited for and whom a round
trip served (OpenTelemetry's way for work done for many).

The standard ``OTEL_*`` variables choose the exporter: ``OTEL_TRACES_EXPORTER=otlp`` or an
``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT`` exports over OTLP/HTTP with a batching processor
(``OTEL_BSP_*``); ``OTEL_SERVICE_NAME`` overrides the service's name. With none set (or
``OTEL_SDK_DISABLED=true``) tracing is off and costs one flag test per span site.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, TraceFlags
from opentelemetry.trace import SpanKind as SpanKind  # re-exported: the runtime names span kinds by it

_forced: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("forced_ids", default=None)
_provider: TracerProvider | None = None
_handling = threading.local()  # .spans: the handler spans started on this thread, maybe open


class EnvelopeIds(RandomIdGenerator):
    """Random ids, except for a span that must carry ids already written in an envelope."""

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced else super().generate_span_id()

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced else super().generate_trace_id()


def wanted() -> bool:
    """Whether the environment asks for traces to be exported."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def provider(service: str, *processors: SpanProcessor) -> TracerProvider:
    """A tracer provider whose spans can take an envelope's ids (tests add their own
    processor, e.g. one over the SDK's in-memory exporter)."""
    made = TracerProvider(resource=Resource.create({"service.name": service}), id_generator=EnvelopeIds())
    for processor in processors:
        made.add_span_processor(processor)
    return made


def install(made: TracerProvider | None) -> None:
    """Trace this process with ``made`` from now on (None: tracing off again)."""
    global _provider
    _provider = made


def configure(service: str) -> None:
    """Export this process's spans as the environment asks (nothing when it asks nothing)."""
    if _provider is not None or not wanted():
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    made = provider(os.environ.get("OTEL_SERVICE_NAME") or service, BatchSpanProcessor(OTLPSpanExporter()))
    install(made)
    atexit.register(made.shutdown)


def enabled() -> bool:
    return _provider is not None


def shutdown() -> None:
    """Export what is buffered (a stopping service)."""
    if _provider is not None:
        _provider.shutdown()


def _tracer() -> trace.Tracer:
    assert _provider is not None
    return _provider.get_tracer("choreo")


def parse(traceparent: str) -> tuple[int, int] | None:
    """(trace id, span id) of a W3C ``traceparent``; None if it is not one."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        ids = int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
    return ids if all(ids) else None


def traceparent(span: Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"


def _parent(traceparent_text: str) -> Any:
    ids = parse(traceparent_text)
    if ids is None:
        return None
    remote = SpanContext(ids[0], ids[1], is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(remote))


def start_root(name: str, traceparent_text: str, attributes: dict[str, Any]) -> Span | None:
    """The story's first span, with the ids its first envelope already carries."""
    ids = parse(traceparent_text)
    if not enabled() or ids is None:
        return None
    token = _forced.set(ids)
    try:
        return _tracer().start_span(name, context=trace.set_span_in_context(trace.INVALID_SPAN),
                                    kind=SpanKind.PRODUCER, attributes=attributes)
    finally:
        _forced.reset(token)


def start_child(name: str, parent: Span | str, kind: SpanKind, attributes: dict[str, Any]) -> Span | None:
    """A span under ``parent``: a span of this process, or a ``traceparent`` from a header."""
    if not enabled():
        return None
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else _parent(parent)
    span = _tracer().start_span(name, context=context, kind=kind, attributes=attributes)
    if kind is SpanKind.CONSUMER:  # a handler's: what this thread's Redis batches link to
        _handlers().append(span)
    return span


def _handlers() -> list[Span]:
    spans: list[Span] | None = getattr(_handling, "spans", None)
    if spans is None:
        spans = _handling.spans = []
    return spans


def start_redis_batch(calls: int, items: int) -> Span | None:
    """The span of one batched Redis round trip: a root, linked to the handler spans still
    open on this thread (the ended ones are forgotten here)."""
    if not enabled():
        return None
    handling = _handling.spans = [span for span in _handlers() if span.is_recording()]
    return _tracer().start_span(
        "redis batch", context=trace.set_span_in_context(trace.INVALID_SPAN), kind=SpanKind.CLIENT,
        links=[Link(span.get_span_context()) for span in handling],
        attributes={"db.system": "redis", "db.operation.name": "EVALSHA", "choreo.redis.calls": calls,
                    "choreo.redis.items": items})


@contextmanager
def spanning(span: Span | None) -> Iterator[Span | None]:
    """End ``span`` (if any) when the block ends; an error is recorded on it."""
    try:
        yield span
    except BaseException as exc:
        if span is not None:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        if span is not None:
            span.end()
