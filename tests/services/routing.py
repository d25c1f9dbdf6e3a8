"""The real business rules on a test's private (prefixed) topics.

The ops and supervisor test pipelines register the *same handler functions* from
``consumers.*`` on prefixed topics; this wrapper runs a rule (with its batched effects) and
re-routes what it emits onto the prefixed topics too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import GeneratorType
from typing import Any

from choreo.events import Event
from choreo.service import Context, Effects, HandlerOutput, HandlerResult
from choreo.workflow import Workflow


def routed(fn: Callable[[Any, Context], HandlerOutput], model: type[Event], prefix: str,
           before: Callable[[Any, Context], None] | None = None) -> Callable[[Any, Context], Effects[None]]:
    def handler(event: Any, ctx: Context) -> Effects[None]:
        if before is not None:
            before(event, ctx)
        called = fn(event, ctx)
        result: HandlerResult = (yield from called) if isinstance(called, GeneratorType) else called
        for out in [] if result is None else [result] if isinstance(result, Event) else list(result):
            ctx.emit(out)
        for emitted in ctx.emitted:
            if not emitted.topic.startswith(prefix):
                emitted.topic = prefix + emitted.topic

    handler.__annotations__ = {"event": model, "ctx": Context, "return": None}
    handler.__name__ = getattr(fn, "__name__", "handler")
    return handler


def private_workflow(name: str, module: str, roles: tuple[str, ...], prefix: str,
                     services: dict[str, Any] | None = None) -> Workflow:
    """The test workflow; given ``services``, it uses them instead of importing ``module``."""
    flow = Workflow(name, service_refs=[f"{module}:{role}" for role in roles],
                    extra_producers={prefix + "delivery.requested": "test"})
    if services is not None:
        flow.__dict__["services"] = [services[role] for role in roles]
    return flow
