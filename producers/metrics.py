"""Prometheus metrics of the submit path: what was accepted, refused and why, and the
figures admission control decides on (so an operator sees the same numbers it does)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ACCEPTED = Counter("ingestion_accepted_total", "Deliveries accepted (broker confirmed)", ["entry"])
REPLAYED = Counter("ingestion_idempotent_replays_total", "Retries answered from an idempotency key")
REFUSED = Counter("ingestion_refused_total", "Submissions refused by admission control", ["reason"])
REJECTED = Counter("ingestion_rejected_total", "Requests rejected as invalid", ["reason"])
PUBLISH_FAILED = Counter("ingestion_publish_failed_total", "Publishes the broker did not confirm")
INFLIGHT = Gauge("ingestion_in_flight", "Deliveries accepted and not yet terminal (last count)")
INFLIGHT_EXPIRED = Counter("ingestion_in_flight_expired_total",
                           "In-flight entries dropped for age without an outcome")
BACKLOG = Gauge("ingestion_backlog", "Lag of the slowest step consumer on delivery.requested")
PENDING = Gauge("ingestion_pending_confirmations", "Publishes awaiting the broker's confirmation")
CONFIRM_SECONDS = Histogram(
    "ingestion_confirm_seconds", "Submit to broker confirmation",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
)
GROUP_COMMIT_SIZE = Histogram(
    "ingestion_group_commit_requests", "HTTP requests admitted and published together (producers.group)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 500),
)
