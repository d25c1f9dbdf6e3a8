"""Ingestion settings, read from the environment like ``choreo.config``.

They live apart from the shared runtime settings because only the submit path uses them;
every limit here exists so that overload is refused at the door instead of queued without
bound somewhere inside the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class IngestionSettings(BaseSettings):
    """Limits and knobs of the submit path (HTTP, Python API and CLI alike)."""

    model_config = SettingsConfigDict(env_prefix="", extra="ignore", populate_by_name=True)

    url: str = Field("http://127.0.0.1:8000", alias="INGESTION_URL")
    # Admission control: deliveries accepted and not yet terminal, across all instances.
    max_in_flight: int = Field(10_000, ge=1, alias="INGESTION_MAX_IN_FLIGHT")
    # The most of that cap one owner may hold (a fraction of it, rounded down, at least one
    # place): one owner flooding the door leaves the others room.
    owner_share: float = Field(0.5, gt=0, le=1, alias="INGESTION_OWNER_SHARE")
    # Admission control: consumer lag on delivery.requested of the slowest step consumer
    # (0 disables the check).
    max_backlog: int = Field(20_000, ge=0, alias="INGESTION_MAX_BACKLOG")
    # Publishes handed to the local producer and not yet confirmed by the broker, per process.
    max_pending: int = Field(5_000, ge=1, alias="INGESTION_MAX_PENDING")
    max_body_bytes: int = Field(64 * 1024, ge=1024, alias="INGESTION_MAX_BODY_BYTES")
    # Consumer groups whose lag counts as backlog; empty: the workflow's consumers of the topic.
    lag_groups: str = Field("", alias="INGESTION_LAG_GROUPS")
    lag_interval_s: float = Field(0.5, gt=0, alias="INGESTION_LAG_INTERVAL_S")
    # A lag figure older than this is not trusted: the service reports not ready.
    lag_stale_s: float = Field(5.0, gt=0, alias="INGESTION_LAG_STALE_S")
    inflight_key: str = Field("ingestion:inflight", alias="INGESTION_INFLIGHT_KEY")
    # Entries older than this leave the in-flight count (the supervisor owns them by then).
    inflight_max_age_s: float = Field(900.0, gt=0, alias="INGESTION_INFLIGHT_MAX_AGE_S")
    # Entries examined per trim tick (bounded work, oldest first plus a rotating page).
    trim_page: int = Field(500, ge=1, alias="INGESTION_TRIM_PAGE")
    idempotency_ttl_s: int = Field(24 * 3600, ge=60, alias="INGESTION_IDEMPOTENCY_TTL_S")
    # librdkafka's delivery.timeout.ms is 30 s: a report always arrives before this.
    publish_timeout_s: float = Field(35.0, gt=0, alias="INGESTION_PUBLISH_TIMEOUT_S")
    retry_after_s: int = Field(1, ge=1, alias="INGESTION_RETRY_AFTER_S")
    # Owner tokens (authentication is off unless one of these is set): a JSON object
    # {"<token>": "<owner_id>"} or lines/commas of "<token>=<owner_id>". The file is the
    # place for real secrets (mode 0600, outside the repository); the variable is for tests.
    tokens: str = Field("", alias="INGESTION_TOKENS", repr=False)
    tokens_file: Path | None = Field(None, alias="INGESTION_TOKENS_FILE")
    # How long the delivery -> owner record (who may read its status) is kept: no longer
    # than the state it guards; past it, the request on Kafka names the owner.
    owner_ttl_s: int = Field(24 * 3600, ge=60, alias="INGESTION_OWNER_TTL_S")

    # GET /deliveries/{id}/events: how long one stream may last, how many one client (owner,
    # or address without tokens) and the process may hold, how often the state is read
    sse_max_s: float = Field(300.0, gt=0, alias="INGESTION_SSE_MAX_S")
    sse_per_client: int = Field(4, ge=1, alias="INGESTION_SSE_PER_CLIENT")
    sse_max_streams: int = Field(200, ge=1, alias="INGESTION_SSE_MAX_STREAMS")
    sse_poll_s: float = Field(0.25, ge=0.05, alias="INGESTION_SSE_POLL_S")
    # status of an expired delivery, read from Kafka: lookups at once per process, and per
    # caller (its owner, or its address without tokens)
    history_concurrency: int = Field(4, ge=1, alias="INGESTION_HISTORY_CONCURRENCY")
    history_per_caller: int = Field(1, ge=1, alias="INGESTION_HISTORY_PER_CALLER")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens.strip()) or self.tokens_file is not None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 8000
