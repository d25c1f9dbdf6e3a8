"""The backlog the door compares with its limit (``Admission.lag``): the measured lag, plus
what the instance published since the measurement began, plus the publishes not confirmed
yet. The measurement itself runs against a real broker in ``test_admission.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import redis

from producers import admission as admission_module
from producers.admission import Admission, Backlog
from producers.submit import Submitter
from tests.ingestion import ingestion_settings

LIMIT = 100


class Meter:
    """Answers each measurement with the next figure given."""

    def __init__(self, *figures: Backlog) -> None:
        self.figures = list(figures)

    def measure(self) -> Backlog:
        return self.figures.pop(0)


def door(meter: Meter, monotonic: list[float], monkeypatch: pytest.MonkeyPatch) -> Admission:
    cfg = ingestion_settings("lag", INGESTION_MAX_BACKLOG=LIMIT, INGESTION_LAG_GROUPS="g",
                             INGESTION_LAG_STALE_S=3600)
    admission = Admission(cfg, redis.Redis(port=1), workflow=cast(Any, None), topic="t",
                          admin=cast(Any, object()))
    admission.meter = cast(Any, meter)
    monkeypatch.setattr(admission.inflight, "trim", lambda _now_ms: 0)
    monkeypatch.setattr(admission.inflight, "count", lambda: 0)
    monkeypatch.setattr(admission_module, "time", SimpleNamespace(monotonic=lambda: monotonic[0],
                                                                   time=time.time))
    return admission


def publish(admission: Admission, count: int) -> int:
    """Publish one at a time, as sequential requests do, each confirmed before the next
    asks: how many the door let in before it refused."""
    for published in range(count):
        allowed, _ = admission.check_backlog()
        if not allowed:
            return published
        admission.published(1)
    return count


def test_with_nothing_draining_the_door_closes_at_the_limit_between_measurements(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    admission = door(Meter(Backlog(lag=30, measured_at=10.0)), clock, monkeypatch)
    admission.tick()
    assert publish(admission, 500) == LIMIT - 30
    assert admission.lag() == LIMIT


def test_what_drained_counts_until_the_next_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    meter = Meter(Backlog(lag=30, drain_per_s=100.0, measured_at=10.0),
                  Backlog(lag=20, drain_per_s=100.0, measured_at=11.0))
    admission = door(meter, clock, monkeypatch)
    admission.tick()
    assert publish(admission, 500) == LIMIT - 30
    clock[0] = 10.9  # at the measured rate 90 would be consumed by now: the door stays shut
    assert publish(admission, 1) == 0
    clock[0] = 11.0
    admission.tick()
    assert admission.lag() == 20 and publish(admission, 500) == LIMIT - 20


def test_a_new_measurement_counts_only_what_was_admitted_while_it_ran(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10.0]
    meter = Meter(Backlog(lag=0, measured_at=10.0), Backlog(lag=40, measured_at=11.0))
    admission = door(meter, clock, monkeypatch)
    admission.tick()
    publish(admission, 40)
    # the second measurement sees those 40; what is published during it, it may not
    measure = meter.measure

    def measure_while_publishing() -> Backlog:
        publish(admission, 5)
        return measure()

    meter.measure = measure_while_publishing  # type: ignore[method-assign]
    clock[0] = 11.0
    admission.tick()
    assert admission.lag() == 45


def test_publishes_the_broker_has_not_confirmed_count_too(monkeypatch: pytest.MonkeyPatch) -> None:
    admission = door(Meter(Backlog(lag=30, measured_at=10.0)), [10.0], monkeypatch)
    admission.tick()
    assert admission.check_backlog(pending=LIMIT - 31) == (1, None)
    allowed, refused = admission.check_backlog(pending=LIMIT - 30)
    assert allowed == 0 and refused is not None and refused.reason == "backlog"


def test_a_batch_gets_only_the_room_left(monkeypatch: pytest.MonkeyPatch) -> None:
    admission = door(Meter(Backlog(lag=LIMIT - 3, measured_at=10.0)), [10.0], monkeypatch)
    admission.tick()
    allowed, refused = admission.check_backlog(wanted=500)
    assert allowed == 3 and refused is not None and refused.reason == "backlog"
    assert "100 requests behind" in str(refused)


def test_callers_on_other_threads_meet_what_was_let_in_before_it_is_published(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The submitter counts what the door let in until the producer has it: a second
    caller, between the first one's admission and its publish, finds the door shut."""
    admission = door(Meter(Backlog(lag=LIMIT - 2, measured_at=10.0)), [10.0], monkeypatch)
    admission.tick()
    submitter = Submitter(admission.cfg, redis_client=redis.Redis(port=1),
                          publisher=cast(Any, object()), admission=admission)
    assert submitter._let_in(5)[0] == 2
    allowed, refused = submitter._let_in(5)
    assert allowed == 0 and refused is not None and refused.reason == "backlog"
