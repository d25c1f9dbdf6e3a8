"""Assembling and running one registry instance (state, store, election, HTTP) under uvicorn."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import uvicorn

from choreo.config import Settings
from choreo.http_serving import HttpLimits, tls_options, uvicorn_config
from choreo.logs import get_logger

from registry.api import Api, create_app, refusal
from registry.auth import BasicAuth, Peers, parse_roles, parse_users
from registry.leader import LeaderElection
from registry.registry import Registry
from registry.state import State
from registry.store import KafkaStore

log = get_logger(component="registry.service")


@dataclass(frozen=True)
class RegistryConfig:
    """Per-instance knobs; everything shared comes from ``choreo.config.Settings``."""

    host: str
    port: int
    bootstrap: str
    redis_url: str
    topic: str = "_schemas"
    lease_ms: int = 6000
    leader_eligible: bool = True
    max_body: int = 1 << 20
    advertised_url: str = ""
    auth: BasicAuth | None = None  # None: no authentication (the default)
    peers: Peers | None = None  # the instances' shared secret: signed leases and forwarded writes
    http: HttpLimits = HttpLimits()
    compat_timeout_s: float = 2.0  # a compatibility check's deadline (409 past it)

    @classmethod
    def from_settings(cls, cfg: Settings, host: str | None = None, port: int | None = None) -> RegistryConfig:
        """Host and port come from SCHEMA_REGISTRY_URL unless given; the rest from SCHEMA_REGISTRY_* env."""
        url = urlparse(cfg.schema_registry_url)
        bind_host = host or url.hostname or "127.0.0.1"
        bind_port = port or url.port or 8081
        env = os.environ
        return cls(
            host=bind_host,
            port=bind_port,
            bootstrap=cfg.kafka_bootstrap_servers,
            redis_url=cfg.redis_url,
            topic=env.get("SCHEMA_REGISTRY_TOPIC", "_schemas"),
            lease_ms=int(env.get("SCHEMA_REGISTRY_LEASE_MS", "6000")),
            leader_eligible=env.get("SCHEMA_REGISTRY_LEADER_ELIGIBLE", "true").strip().lower() != "false",
            max_body=int(env.get("SCHEMA_REGISTRY_MAX_BODY", str(1 << 20))),
            # a follower forwards writes here: https when this server speaks only that
            advertised_url=env.get("SCHEMA_REGISTRY_ADVERTISED_URL",
                                   f"{'https' if tls_options() else 'http'}://{bind_host}:{bind_port}"),
            auth=auth_from_env(env),
            peers=peers_from_env(env),
            compat_timeout_s=float(env.get("SCHEMA_REGISTRY_COMPAT_TIMEOUT_S", "2")),
        )


def auth_from_env(env: dict[str, str] | os._Environ[str]) -> BasicAuth | None:
    """Basic auth from ``SCHEMA_REGISTRY_AUTH_USERS`` (``user:pass,...``) and/or
    ``SCHEMA_REGISTRY_AUTH_USERS_FILE`` (one ``user:pass`` a line); reads are protected too
    when ``SCHEMA_REGISTRY_AUTH_READS=true``. Roles (``registry.auth.parse_roles``) from
    ``SCHEMA_REGISTRY_AUTH_ROLES`` and/or ``SCHEMA_REGISTRY_AUTH_ROLES_FILE``; without any,
    every login is an admin. No user set: no authentication."""
    users: dict[str, str] = {}
    path = env.get("SCHEMA_REGISTRY_AUTH_USERS_FILE", "").strip()
    if path:
        users.update(parse_users(Path(path).read_text()))
    users.update(parse_users(env.get("SCHEMA_REGISTRY_AUTH_USERS", "")))
    if not users:
        return None
    roles_text = env.get("SCHEMA_REGISTRY_AUTH_ROLES", "")
    roles_path = env.get("SCHEMA_REGISTRY_AUTH_ROLES_FILE", "").strip()
    if roles_path:
        roles_text = Path(roles_path).read_text() + "\n" + roles_text
    roles = parse_roles(roles_text) if roles_text.strip() else None
    reads = env.get("SCHEMA_REGISTRY_AUTH_READS", "false").strip().lower() == "true"
    return BasicAuth(users, protect_reads=reads, roles=roles)


def peers_from_env(env: dict[str, str] | os._Environ[str]) -> Peers | None:
    """The peer secret from the file ``SCHEMA_REGISTRY_PEER_SECRET_FILE`` (never a variable)."""
    path = env.get("SCHEMA_REGISTRY_PEER_SECRET_FILE", "").strip()
    return Peers.from_file(Path(path)) if path else None


def build(config: RegistryConfig) -> tuple[Api, Registry]:
    state = State()
    store = KafkaStore(config.bootstrap, config.topic, state)
    instance = f"{config.advertised_url}#{uuid.uuid4().hex[:8]}"
    election = LeaderElection(config.redis_url, config.topic, instance, config.advertised_url,
                              ttl_ms=config.lease_ms, eligible=config.leader_eligible, peers=config.peers)
    registry = Registry(state, store, election, check_timeout_s=config.compat_timeout_s)
    return Api(registry, max_body=config.max_body, auth=config.auth, peers=config.peers), registry


def serve(config: RegistryConfig) -> None:
    """Run in the foreground until SIGTERM/SIGINT; the port opens only after catch-up."""
    api, registry = build(config)

    def startup() -> None:
        registry.store.ensure_topic()
        registry.store.start()
        registry.store.catch_up(timeout_s=120)
        registry.election.start()
        log.info("registry_ready", topic=config.topic, url=config.advertised_url,
                 position=registry.store.position, schemas=len(registry.state.schemas),
                 leader=registry.election.is_leader())

    def shutdown() -> None:
        registry.election.stop()
        registry.store.stop()
        log.info("registry_stopped", url=config.advertised_url)

    app = create_app(api, startup, shutdown)
    # log_config=None: uvicorn keeps the process's logging setup instead of installing its own
    uvicorn.Server(uvicorn_config(app, config.host, config.port, config.http, refusal,
                                  log_level="warning", access_log=False, server_header=False,
                                  timeout_graceful_shutdown=5, log_config=None)).run()
