"""Contracts in the registry: which model each topic carries (from the services' own
declarations), registering them, and the deploy gate that refuses an incompatible change."""

from __future__ import annotations

from dataclasses import dataclass

from urllib.parse import quote

import httpx
from confluent_kafka.schema_registry import Schema

from choreo.config import settings
from choreo.events import Event
from choreo.serde import registry_client
from choreo.workflow import Workflow


def subject(topic: str) -> str:
    return f"{topic}-value"


def topic_models(workflow: Workflow, extra: tuple[type[Event], ...] = ()) -> dict[str, type[Event]]:
    """Every topic with the event type on it: consumed topics (retry topics included) and outputs."""
    models: dict[str, type[Event]] = {}
    for service in workflow.services:
        for topic, handler in service.handlers.items():
            models[topic] = handler.model
        for model in service.outputs:
            models.setdefault(model.topic, model)
    for model in extra:
        models.setdefault(model.topic, model)
    return models


@dataclass(frozen=True)
class CheckResult:
    subject: str
    compatible: bool
    registered: bool
    messages: list[str]


def check(models: dict[str, type[Event]], registry_url: str | None = None) -> list[CheckResult]:
    """Ask the registry whether each local schema is compatible with what it holds.

    The REST call is made directly (not through the client) because the client keeps only
    the verdict and drops the registry's verbose reasons, which are what a person needs.
    """
    base = (registry_url or settings().schema_registry_url).rstrip("/")
    results = []
    with httpx.Client(timeout=10) as http:
        for topic, model in sorted(models.items()):
            name = subject(topic)
            response = http.post(
                f"{base}/compatibility/subjects/{quote(name, safe='')}/versions/latest",
                params={"verbose": "true"},
                json={"schema": model.avro_schema(), "schemaType": "AVRO"},
                headers={"Content-Type": "application/vnd.schemaregistry.v1+json"},
            )
            if response.status_code == 404:
                results.append(CheckResult(name, True, False, ["not registered yet"]))
                continue
            response.raise_for_status()
            body = response.json()
            results.append(CheckResult(name, bool(body.get("is_compatible")), True,
                                       [str(m) for m in body.get("messages", [])]))
    return results


def register(models: dict[str, type[Event]]) -> dict[str, int]:
    """Register every schema under ``<topic>-value``; an incompatible one raises (409)."""
    client = registry_client()
    return {
        subject(topic): client.register_schema(subject(topic), Schema(model.avro_schema(), "AVRO"))
        for topic, model in sorted(models.items())
    }
