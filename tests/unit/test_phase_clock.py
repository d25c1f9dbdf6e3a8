"""A batch's phases are timed twice (``PhaseClock``): the wall time, waits included, and the
batch loop's own CPU time, so a phase that waits on Redis or Kafka is told from one that
computes, and another thread's work (librdkafka's, the release thread's) is not counted."""

from __future__ import annotations

import threading
import time

from prometheus_client import REGISTRY

from choreo.runner import PhaseClock

SERVICE = "phase-clock-test"


def _samples() -> dict[tuple[str, str], float]:
    return {(name, phase): REGISTRY.get_sample_value(name, {"service": SERVICE, "phase": phase}) or 0.0
            for name in ("choreo_batch_phase_seconds_sum", "choreo_batch_phase_seconds_count",
                         "choreo_batch_phase_cpu_seconds_total")
            for phase in ("waiting", "computing")}


def _burn(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_wait_costs_wall_time_and_a_computation_cpu_time() -> None:
    before = _samples()
    clock = PhaseClock(SERVICE)
    other = threading.Thread(target=_burn, args=(0.05,))  # another thread's CPU, during the wait
    other.start()
    time.sleep(0.05)
    other.join()
    clock.lap("waiting")
    _burn(0.03)
    clock.lap("computing")
    grew = {key: value - before[key] for key, value in _samples().items()}

    assert grew[("choreo_batch_phase_seconds_sum", "waiting")] >= 0.05
    assert grew[("choreo_batch_phase_cpu_seconds_total", "waiting")] < 0.02
    assert grew[("choreo_batch_phase_cpu_seconds_total", "computing")] >= 0.03
    assert grew[("choreo_batch_phase_seconds_count", "waiting")] == 1.0
    assert grew[("choreo_batch_phase_seconds_count", "computing")] == 1.0
