"""The Kafka client settings every process shares come from one place and can be switched
by environment (an operator's tuning, a benchmark's A/B), within checked bounds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from choreo.config import settings
from choreo.kafka import (
    base_config, pipeline_producer_config, transactional_consumer_config, transactional_producer_config,
)


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    settings.cache_clear()
    yield
    settings.cache_clear()


def test_the_services_fetch_settings_default_to_returning_at_the_first_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CHOREO_KAFKA_FETCH_MIN_BYTES", "CHOREO_KAFKA_FETCH_WAIT_MS"):
        monkeypatch.delenv(name, raising=False)
    config = transactional_consumer_config("package", "package-0")
    assert config["fetch.min.bytes"] == 1 and config["fetch.wait.max.ms"] == 100
    assert config["isolation.level"] == "read_committed" and config["enable.auto.commit"] is False


def test_fetch_and_compression_switch_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHOREO_KAFKA_FETCH_MIN_BYTES", "16384")
    monkeypatch.setenv("CHOREO_KAFKA_FETCH_WAIT_MS", "20")
    monkeypatch.setenv("CHOREO_KAFKA_COMPRESSION", "none")
    config = transactional_consumer_config("package", "package-0")
    assert config["fetch.min.bytes"] == 16384 and config["fetch.wait.max.ms"] == 20
    assert pipeline_producer_config()["compression.type"] == "none"


def test_a_transactional_producer_retries_a_refused_transaction_step_soon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka's default (100 ms) held every back-to-back transaction 100 ms."""
    monkeypatch.delenv("CHOREO_KAFKA_TXN_RETRY_BACKOFF_MS", raising=False)
    config = transactional_producer_config("package-0")
    assert config["transactional.id"] == "package-0" and config["retry.backoff.ms"] == 5
    assert config["compression.type"] == pipeline_producer_config()["compression.type"]
    monkeypatch.setenv("CHOREO_KAFKA_TXN_RETRY_BACKOFF_MS", "20")
    settings.cache_clear()
    assert transactional_producer_config("package-0")["retry.backoff.ms"] == 20


@pytest.mark.parametrize("name, value", [("CHOREO_KAFKA_FETCH_MIN_BYTES", "0"),
                                         ("CHOREO_KAFKA_FETCH_WAIT_MS", "-1"),
                                         ("CHOREO_KAFKA_FETCH_WAIT_MS", "soon"),
                                         ("CHOREO_KAFKA_TXN_RETRY_BACKOFF_MS", "0"),
                                         ("CHOREO_KAFKA_TXN_RETRY_BACKOFF_MS", "1001")])
def test_a_fetch_setting_out_of_bounds_is_refused_at_start(monkeypatch: pytest.MonkeyPatch,
                                                           name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=name):
        settings()


def test_tls_and_sasl_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a secured stack's env file sets reaches every client (SASL_SSL with the local CA);
    without a protocol nothing of it is used."""
    for name in ("KAFKA_SASL_PASSWORD_FILE", "KAFKA_SECURITY_PROTOCOL", "KAFKA_SSL_CA_LOCATION"):
        monkeypatch.delenv(name, raising=False)
    assert set(base_config("h:1")) == {"bootstrap.servers"}
    monkeypatch.setenv("KAFKA_SSL_CA_LOCATION", "/secrets/tls/ca.pem")
    settings.cache_clear()
    assert set(base_config("h:1")) == {"bootstrap.servers"}  # PLAINTEXT: no CA either
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "package")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", "pw")
    settings.cache_clear()
    config = transactional_consumer_config("package", "package-0")
    assert config["security.protocol"] == "SASL_SSL" and config["ssl.ca.location"] == "/secrets/tls/ca.pem"
    assert config["sasl.username"] == "package" and config["sasl.mechanism"] == "SCRAM-SHA-256"
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    settings.cache_clear()
    assert "ssl.ca.location" not in base_config() and base_config()["security.protocol"] == "SASL_PLAINTEXT"
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SSL")  # TLS without SASL: no credentials sent
    settings.cache_clear()
    assert "sasl.username" not in base_config() and base_config()["ssl.ca.location"] == "/secrets/tls/ca.pem"
