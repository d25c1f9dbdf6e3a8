"""The finish of a batch's attempts (``Runner._finish_all``), with Redis's answers scripted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from choreo import runner as runner_module
from choreo.effects import STALE
from choreo.record import Record
from choreo.runner import Runner
from consumers.drone_scheduler import service


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


@pytest.mark.parametrize("answer, published", [("ok", True), (STALE, False)])
def test_an_attempt_kept_open_whose_write_is_refused_publishes_nothing(
        answer: str, published: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step kept open has no finish to carry its writes: they run as effects, fenced like
    any. One refused (the step given away meanwhile) drops the attempt's outputs, as a late
    answer's are: its events must not tell of a write that was never made."""
    write = Record("pkg", ttl_s=60).put("d-1", status="ready")
    asked: list[Any] = []
    ctx = SimpleNamespace(keep_step_open=True, writes=[write], emitted=["an event"],
                          effect=lambda effect, keys, args: asked.append((effect, keys, args)) or "a call")
    log = _Log()
    work = SimpleNamespace(handler=SimpleNamespace(step="wait"), ctx=ctx, topic="t", log=log, span=None,
                           envelope=SimpleNamespace(correlation_id="d-1", attempt=1), encoded={})
    runner: Any = object.__new__(Runner)
    produced: list[Any] = []
    runner.service = SimpleNamespace(name="svc")
    runner.redis = None
    runner.workflow = None
    runner.state = SimpleNamespace(complete_many=lambda *args: [], open_many=lambda *args: None)
    runner._produce = lambda emitted, cause, span, value: produced.append(emitted)
    monkeypatch.setattr(runner_module, "run_all", lambda client, calls: [answer for _ in calls])
    runner._finish_all([work])
    assert asked == [(write.effect, write.keys, write.args)]
    assert produced == (["an event"] if published else [])
    assert (("step.dropped_meanwhile", {"step": "wait", "why": "stale"}) in log.events) is not published


def test_a_forward_step_fences_its_effects_and_an_undo_does_not() -> None:
    """An undo gives back what its forward step took: wanted whenever it comes, even from an
    attempt the supervisor gave up on (a slow last attempt fenced would keep the drone)."""
    by_step = {h.step: h.fenced_by for h in service.handlers.values()}
    assert by_step == {"drone": "drone", "release_drone": ""}
