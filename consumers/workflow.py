"""The drone-delivery workflow: which services belong to it. Everything else (topics, steps,
deadlines, fan-in) is read from their own declarations."""

from __future__ import annotations

from choreo import Workflow

WORKFLOW = Workflow(
    "drone-delivery",
    service_refs=[
        "consumers.package:service",
        "consumers.drone_scheduler:service",
        "consumers.delivery:service",
        "consumers.notifier:service",
        "choreo.supervisor:service",
    ],
    extra_producers={"delivery.requested": "ingestion"},
)
