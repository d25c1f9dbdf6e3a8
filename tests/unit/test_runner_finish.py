"""The finish of a batch's attempts (``Runner._finish_all``), with Redis's answers scripted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from choreo import runner as runner_module
from choreo.answers import STALE
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


@pytest.mark.parametrize("registry_down", [False, True])
def test_outputs_are_checked_before_the_step_completes_whether_the_registry_answers_or_not(
        registry_down: bool) -> None:
    """An output Avro cannot write is a bug of the rule, one too large for a consumer the
    input's refusal, and neither waits for the registry: left to the publishing when the
    registry is down, the step would complete first, and its replay would fail at every
    reading of the batch."""
    from datetime import UTC, datetime

    from choreo.errors import DeadLetterReason
    from choreo.runner import Attempt
    from choreo.serde import MAX_VALUE_BYTES, RegistryUnavailable
    from choreo.service import Emitted
    from schemas.models import DroneReleased

    def encoder(model: type, topic: str) -> Any:
        def encode(event: Any) -> bytes:
            if registry_down:
                raise RegistryUnavailable("connection refused")
            return runner_module.FRAME_BYTES * b"\0" + runner_module.avro_body(model, event.to_avro())
        return encode

    runner: Any = object.__new__(Runner)
    runner.encoder = encoder

    def checked(drone_id: str) -> Any:
        event = DroneReleased(delivery_id="d-1", drone_id=drone_id, released_at=datetime.now(UTC))
        run = Attempt(SimpleNamespace(handler=SimpleNamespace(fn=checked), encoded=None))  # type: ignore[arg-type]
        run.ctx, run.result = SimpleNamespace(emitted=[Emitted(event, "out", "e-1")], emit=None), None
        error = runner._encode_outputs(run)
        return error, run.work.encoded

    error, encoded = checked("drone-7")
    assert error is None and len(encoded) == (0 if registry_down else 1)  # down: encoded when published
    unwritable, _ = checked("drone-\ud800")
    assert unwritable.reason is DeadLetterReason.HANDLER_ERROR
    assert str(unwritable).startswith("checked emitted what Avro cannot write, Unwritable: DroneReleased: "
                                      "UnicodeEncodeError")
    too_large, _ = checked("d" * MAX_VALUE_BYTES)
    assert too_large.reason is DeadLetterReason.OVERSIZED
