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
           before: Callable[[Any, Context], None] | None = None,
           after_first_op: Callable[[Any, Context], None] | None = None) -> Callable[[Any, Context], Effects[None]]:
    """``before`` runs before the rule; ``after_first_op`` once the rule's first operation is
    answered (a rule declared ``first_op_in_begin`` must do nothing before it)."""
    def handler(event: Any, ctx: Context) -> Effects[None]:
        if before is not None:
            before(event, ctx)
        called = fn(event, ctx)
        result: HandlerResult = (yield from _hooked(called, event, ctx, after_first_op)) \
            if isinstance(called, GeneratorType) else called
        for out in [] if result is None else [result] if isinstance(result, Event) else list(result):
            ctx.emit(out)
        for emitted in ctx.emitted:
            if not emitted.topic.startswith(prefix):
                emitted.topic = prefix + emitted.topic

    handler.__annotations__ = {"event": model, "ctx": Context, "return": None}
    handler.__name__ = getattr(fn, "__name__", "handler")
    return handler


def _hooked(rule: Any, event: Any, ctx: Context, after_first_op: Callable[[Any, Context], None] | None) -> Any:
    """The rule's run, with ``after_first_op`` called when its first operation is answered."""
    if after_first_op is None:
        return (yield from rule)
    try:
        op = next(rule)
        answer = yield op
        after_first_op(event, ctx)
        while True:
            answer = yield rule.send(answer)
    except StopIteration as done:
        return done.value
    finally:
        rule.close()  # the runner closes a handler it only probed for its first operation


def private_workflow(name: str, module: str, roles: tuple[str, ...], prefix: str,
                     services: dict[str, Any] | None = None) -> Workflow:
    """The test workflow; given ``services``, it uses them instead of importing ``module``."""
    flow = Workflow(name, service_refs=[f"{module}:{role}" for role in roles],
                    extra_producers={prefix + "delivery.requested": "test"})
    if services is not None:
        flow.__dict__["services"] = [services[role] for role in roles]
    return flow
