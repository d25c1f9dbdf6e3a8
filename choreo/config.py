"""Settings shared by every process, read from the environment with the names people already use."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Local-stack defaults; production points the same variables at real clusters."""

    model_config = SettingsConfigDict(env_prefix="", extra="ignore", populate_by_name=True)

    kafka_bootstrap_servers: str = Field("127.0.0.1:9092", validation_alias="KAFKA_BOOTSTRAP_SERVERS")
    redis_url: str = Field("redis://127.0.0.1:6379/0", validation_alias="REDIS_URL")
    schema_registry_url: str = Field("http://127.0.0.1:8081", validation_alias="SCHEMA_REGISTRY_URL")
    # how long one request to the registry may take: its client waits for ever by default,
    # and a registry that accepts a connection and never answers would stall every consumer
    # that meets a schema id it has not cached (retried twice, then the batch is retried).
    # A fresh registry's first write creates its Kafka writer, which takes seconds
    registry_timeout_s: float = Field(10.0, gt=0, le=15, validation_alias="CHOREO_REGISTRY_TIMEOUT_S")
    # off: producers only look their schema up (contracts are registered at deploy time by
    # ``choreo schemas register``); on: a development convenience for throwaway topics
    schema_registry_auto_register: bool = Field(False, validation_alias="SCHEMA_REGISTRY_AUTO_REGISTER")
    # TLS: the CA librdkafka trusts on an SSL or SASL_SSL listener (``ssl.ca.location``; unset:
    # the system's CAs). HTTPS clients (httpx, the registry client) read the standard
    # SSL_CERT_FILE themselves, and redis-py ``ssl_ca_certs`` from a ``rediss://`` URL.
    kafka_ssl_ca_location: Path | None = Field(None, validation_alias="KAFKA_SSL_CA_LOCATION")
    # TLS of this process's HTTP server (ingestion, the registry, the ops view): with both
    # set, uvicorn serves HTTPS only (``choreo.http_serving.uvicorn_config``)
    http_tls_cert_file: Path | None = Field(None, validation_alias="CHOREO_HTTP_TLS_CERT_FILE")
    http_tls_key_file: Path | None = Field(None, validation_alias="CHOREO_HTTP_TLS_KEY_FILE")
    data_dir: Path = Field(REPO_ROOT / ".stack", validation_alias="CHOREO_DATA_DIR")
    kafka_libs: Path = Field(
        Path.home() / ".cache" / "dronepipe" / "kafka-4.1.2" / "libs", validation_alias="KAFKA_LIBS"
    )
    kafka_heap: str = Field("-Xms256m -Xmx768m", validation_alias="KAFKA_HEAP_OPTS")
    start_timeout_s: float = Field(90.0, validation_alias="CHOREO_START_TIMEOUT")
    dedupe_ttl_s: int = Field(24 * 3600, ge=1, validation_alias="CHOREO_DEDUPE_TTL_S")
    # the pipeline's producers (services, ingestion); an A/B switch for the benchmark too
    kafka_compression: str = Field("lz4", validation_alias="CHOREO_KAFKA_COMPRESSION")
    # the services' fetches: how many bytes the broker waits for, and for how long at most
    # (bench/README.md, "Settings, and why they are set as they are")
    kafka_fetch_min_bytes: int = Field(1, ge=1, validation_alias="CHOREO_KAFKA_FETCH_MIN_BYTES")
    kafka_fetch_wait_max_ms: int = Field(100, ge=0, validation_alias="CHOREO_KAFKA_FETCH_WAIT_MS")
    # a service's batch: its first record, then what else arrives within this many ms, up to
    # the batch size (bench/README.md, "The batch loop")
    batch_gather_ms: int = Field(5, ge=0, le=1000, validation_alias="CHOREO_BATCH_GATHER_MS")
    # how long a starting service waits for the broker's first answer before it says so and
    # exits (a supervisor such as ``choreo up`` restarts it with back-off)
    kafka_connect_timeout_s: float = Field(10.0, gt=0, le=300, validation_alias="CHOREO_KAFKA_CONNECT_TIMEOUT_S")
    # how long a transactional producer waits before retrying a request the broker refused
    # for now: a transaction begun right after a commit meets CONCURRENT_TRANSACTIONS until
    # the last one's markers are written (bench/README.md, "Settings, and why they are set as they are")
    kafka_txn_retry_backoff_ms: int = Field(5, ge=1, le=1000, validation_alias="CHOREO_KAFKA_TXN_RETRY_BACKOFF_MS")
    # Kafka security (SASL/SCRAM over the local stack's SASL listener); secrets may come
    # from a file (``KAFKA_SASL_PASSWORD_FILE``), never from the repository
    kafka_security_protocol: str = Field("PLAINTEXT", validation_alias="KAFKA_SECURITY_PROTOCOL")
    kafka_sasl_mechanism: str = Field("SCRAM-SHA-256", validation_alias="KAFKA_SASL_MECHANISM")
    kafka_sasl_username: str = Field("", validation_alias="KAFKA_SASL_USERNAME")
    kafka_sasl_password: str = Field("", validation_alias="KAFKA_SASL_PASSWORD")
    kafka_sasl_password_file: Path | None = Field(None, validation_alias="KAFKA_SASL_PASSWORD_FILE")
    log_level: str = Field("INFO", validation_alias="CHOREO_LOG_LEVEL")
    # Redis replicates asynchronously: a master that fails before its replica has a write
    # loses it. When set, every batch of script calls waits until this many replicas of each
    # master it wrote to have it (WAIT), and fails (the Kafka transaction aborts) when they
    # do not within the time, so nothing committed to Kafka rests on a write a failover can
    # lose. 0: off (a single node, or loss accepted and rebuilt from Kafka).
    redis_wait_replicas: int = Field(0, ge=0, validation_alias="CHOREO_REDIS_WAIT_REPLICAS")
    redis_wait_ms: int = Field(500, ge=1, validation_alias="CHOREO_REDIS_WAIT_MS")


@lru_cache(maxsize=1)
def settings() -> Settings:
    return Settings()
