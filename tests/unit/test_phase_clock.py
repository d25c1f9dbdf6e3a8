"""A batch's phases are timed twice (``PhaseClock``): the wall time, waits included, and the
loop's CPU time, so a phase that waits on Redis or Kafka is told from one that computes."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from choreo.runner import PhaseClock


def _sample(name: str, phase: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": "phase-clock-test", "phase": phase}) or 0.0


def test_a_wait_costs_wall_time_and_a_computation_cpu_time() -> None:
    clock = PhaseClock("phase-clock-test")
    time.sleep(0.05)
    clock.lap("waiting")
    busy_until = time.thread_time() + 0.03
    while time.thread_time() < busy_until:
        pass
    clock.lap("computing")

    assert _sample("choreo_batch_phase_seconds_sum", "waiting") >= 0.05
    assert _sample("choreo_batch_phase_cpu_seconds_total", "waiting") < 0.01
    assert _sample("choreo_batch_phase_cpu_seconds_total", "computing") >= 0.03
    assert _sample("choreo_batch_phase_seconds_count", "computing") == 1.0
