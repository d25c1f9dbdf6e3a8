"""Prometheus metrics of the runtime, labelled by service and topic.

``/metrics`` answers anyone who reaches it, without a token: topic, service and group names,
rates and lag. So it binds loopback unless ``CHOREO_METRICS_HOST`` (``choreo run
--metrics-host``) names another address, and an address beyond loopback must be asked for
as well (``CHOREO_METRICS_PUBLIC=true``, ``--metrics-public``), as ``choreo serve`` asks
``--insecure`` to serve beyond loopback without tokens: a scraper on another host, or a pod's
address, is then a deliberate choice, never a typo's.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from choreo.http_serving import loopback

DEFAULT_HOST = "127.0.0.1"

EVENTS_IN = Counter("choreo_events_in_total", "Events consumed", ["service", "topic"])
EVENTS_OUT = Counter("choreo_events_out_total", "Events produced", ["service", "topic"])
DEAD_LETTERS = Counter("choreo_dead_letters_total", "Events dead-lettered", ["service", "topic", "reason"])
RETRIES = Counter("choreo_retries_total", "In-process handler retries", ["service", "topic"])
REPORTS = Counter("choreo_recovery_reports_total", "Steps reported to the supervisor", ["service", "kind"])
IGNORED = Counter("choreo_ignored_total", "Late or stale events ignored", ["service", "topic", "why"])
HANDLER_SECONDS = Histogram("choreo_handler_seconds", "Handler latency", ["service", "topic"],
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
BATCH_SIZE = Histogram("choreo_batch_size", "Events per transaction", ["service"],
                       buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2000))
EFFECTS_PER_ROUND_TRIP = Histogram("choreo_effects_per_round_trip", "Handler effects sent to Redis together",
                                   ["service"], buckets=(1, 2, 5, 10, 50, 100, 250, 500, 1000))
# where a batch's time goes, phase by phase: a transaction's latency is the sum, and every
# hop of a delivery waits one whole batch (bench/README.md, "Latency below capacity")
BATCH_PHASE_SECONDS = Histogram("choreo_batch_phase_seconds", "Seconds per batch in each phase",
                                ["service", "phase"],
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
# the same phases in the batch loop's CPU time: the wall time above also holds the waits on
# Redis, on Kafka and, on a busy machine, on a core; this is what each phase costs the loop
# itself (not the work it causes in Redis, the broker or librdkafka's threads)
BATCH_PHASE_CPU_SECONDS = Counter("choreo_batch_phase_cpu_seconds",
                                  "CPU seconds of the batch loop's thread in each phase",
                                  ["service", "phase"])
# every item of the runtime's batched scripts (``choreo.batch``): what a delivery costs Redis
# in script runs, whatever the round trips carrying them (bench/README.md)
SCRIPT_ITEMS = Counter("choreo_redis_script_items_total", "Items run by the runtime's batched Redis scripts",
                       ["script"])
OFFSET_COMMITS = Counter("choreo_offset_commits_total",
                         "Batches' offset commits: in the batch's transaction, or plain where it wrote nothing",
                         ["service", "how"])
OFFSET_COMMIT_REFUSALS = Counter("choreo_offset_commit_refusals_total",
                                 "Plain offset commits refused (the group moved on): the batch is read again",
                                 ["service"])
TXN_ABORTS = Counter("choreo_transaction_aborts_total", "Aborted transactions (replayed)", ["service"])
LAG = Gauge("choreo_consumer_lag", "Consumer lag per partition", ["service", "topic", "partition"])


@functools.lru_cache(maxsize=4096)
def child(metric: Counter | Gauge | Histogram, *values: str) -> Any:
    """``metric.labels(*values)``, remembered: ``labels`` checks and locks on every call,
    and the runtime counts per event (1-4 % of a service's CPU in a profile)."""
    return metric.labels(*values)


class MetricsRefused(ValueError):
    """A metrics address beyond loopback that was not asked for as such."""


def bind_host() -> str:
    """Where ``/metrics`` binds (``CHOREO_METRICS_HOST``, loopback by default); raises
    ``MetricsRefused`` for an address beyond loopback without ``CHOREO_METRICS_PUBLIC=true``."""
    host = os.environ.get("CHOREO_METRICS_HOST", "").strip() or DEFAULT_HOST
    if not loopback(host) and os.environ.get("CHOREO_METRICS_PUBLIC", "").lower() != "true":
        raise MetricsRefused(f"metrics on {host}: not a loopback address, and /metrics has no token; "
                             "set CHOREO_METRICS_PUBLIC=true (--metrics-public) to serve it there")
    return host


def serve(port: int) -> None:
    """Expose /metrics on ``bind_host()``; port 0 disables it (tests run many instances)."""
    if port:
        start_http_server(port, addr=bind_host().strip("[]"))
