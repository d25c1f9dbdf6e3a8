"""Kafka client configuration and topic administration, in one place for every process."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from choreo.config import settings


def base_config(bootstrap: str | None = None) -> dict[str, Any]:
    """Connection settings every client shares: the bootstrap servers and, when configured,
    SASL credentials (each service runs as its own principal under the broker's ACLs)."""
    cfg = settings()
    config: dict[str, Any] = {"bootstrap.servers": bootstrap or cfg.kafka_bootstrap_servers}
    if cfg.kafka_security_protocol != "PLAINTEXT":
        password = cfg.kafka_sasl_password
        if cfg.kafka_sasl_password_file is not None:
            password = cfg.kafka_sasl_password_file.read_text().strip()
        config.update({
            "security.protocol": cfg.kafka_security_protocol,
            "sasl.mechanism": cfg.kafka_sasl_mechanism,
            "sasl.username": cfg.kafka_sasl_username,
            "sasl.password": password,
        })
    return config


def admin(bootstrap: str | None = None) -> AdminClient:
    return AdminClient(base_config(bootstrap))


def ensure_topics(
    topics: Iterable[str] | Mapping[str, int],
    partitions: int = 6,
    replication: int = -1,
    config: Mapping[str, str] | None = None,
    bootstrap: str | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Create the topics that do not exist yet; an existing topic is left as it is.

    ``topics`` may map names to partition counts (fan-in topics must share theirs).
    """
    counts = dict(topics) if isinstance(topics, Mapping) else {t: partitions for t in topics}
    client = admin(bootstrap)
    existing = set(client.list_topics(timeout=timeout_s).topics)
    new = [
        NewTopic(name, num_partitions=n, replication_factor=replication, config=dict(config or {}))
        for name, n in counts.items()
        if name not in existing
    ]
    if not new:
        return
    for name, future in client.create_topics(new, request_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
