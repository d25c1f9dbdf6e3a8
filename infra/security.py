"""Principals, SCRAM credentials and Kafka ACLs, derived from the workflow's topology.

Nothing here is a second, hand-kept list of topics: every ACL is computed from the services'
own declarations (``service.topics``, ``service.outputs``) through ``choreo.topology.derive``,
the same source that creates the topics. A service that starts consuming a new topic gets
its READ the next time ``apply`` runs; a topic no service declares is reachable by no one but
the admin.

Per service principal ``User:<service>`` (the consumer group is the service name, the
``transactional.id`` is ``<service>-<instance>``):

* READ on every topic it consumes (its inputs and its retry topics) and on its group (and
  on ``replay.<service>.*`` groups, for ``choreo ops replay``, which runs as the service);
* WRITE on every topic it produces, on the dead-letter topic of each input, and on
  ``recovery`` (every step reports there);
* WRITE on transactional ids prefixed ``<service>-`` (WRITE implies DESCRIBE).

The outcome webhooks (``choreo.webhooks``, run beside the workflow as ``webhooks``) READ
what tells an outcome (``webhooks.deciding``) in their own group and transactions and WRITE
only those topics' dead letters: they produce no event and run no step.

The supervisor also READs each step's trigger and retry topics (it fetches the source of a
step it requeues) with its ``<name>-source-reader`` group, and DESCRIBEs every service's
group (``choreo.release`` waits for their commits). Ingestion may WRITE
``delivery.requested`` and DESCRIBE the groups whose lag is its admission backlog. The
registry owns ``_schemas``. Ops tools (``ops``) read every workflow topic, write them
(redrive), own the redrive marker topic and ``choreo-ops-*`` groups and transactional ids.
Idempotent producers need no IDEMPOTENT_WRITE since Kafka 3.0 (KIP-679: WRITE on a topic
implies it).

Redis and the registry follow the same principals: one Redis ACL user each, limited to the
key prefixes it owns (``redis_key_prefixes``), and one registry login each, a reader but for
the admin (``registry_roles``).

Secrets never come from the repository: a password is read from
``CHOREO_KAFKA_PASSWORD_<USER>`` (``-`` becomes ``_``, upper case) when set, else from
``<secrets dir>/kafka/<user>.password``, generated there on first use with mode 0600
(directory 0700). The secrets dir defaults to ``$CHOREO_DATA_DIR/secrets``.
"""

from __future__ import annotations

import os
import secrets as _random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding, AdminClient  # type: ignore[attr-defined]

    from choreo.service import Service
    from choreo.topology import Topology
    from choreo.workflow import Workflow
    from infra.tls import TlsFiles

ADMIN = "admin"
OPS = "ops"
REGISTRY = "schema-registry"
REGISTRY_TOPIC = "_schemas"
INGESTION = "ingestion"
MECHANISM = "SCRAM-SHA-256"
SCRAM_ITERATIONS = 8192
RECOVERY_TOPIC = "recovery"
# choreo.ops.dlq's marker topic and transactional id; ops readers use choreo-ops-reader-*
OPS_PREFIX = "choreo-ops-"
REDRIVEN_TOPIC = "choreo.dlq.redriven"

Resource = Literal["topic", "group", "transactional_id", "cluster"]
Pattern = Literal["literal", "prefixed"]
Operation = Literal["READ", "WRITE", "DESCRIBE", "CREATE", "DESCRIBE_CONFIGS", "IDEMPOTENT_WRITE"]


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule: ``principal`` may ``operation`` on ``resource`` ``name``."""

    user: str
    resource: Resource
    name: str
    operation: Operation
    pattern: Pattern = "literal"

    @property
    def principal(self) -> str:
        return f"User:{self.user}"

    def binding(self) -> AclBinding:
        from confluent_kafka.admin import (  # type: ignore[attr-defined]
            AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType,
        )

        kinds = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP,
                 "transactional_id": ResourceType.TRANSACTIONAL_ID, "cluster": ResourceType.BROKER}
        patterns = {"literal": ResourcePatternType.LITERAL, "prefixed": ResourcePatternType.PREFIXED}
        return AclBinding(kinds[self.resource], self.name, patterns[self.pattern], self.principal,
                          "*", AclOperation[self.operation], AclPermissionType.ALLOW)

    def row(self) -> str:
        star = "*" if self.pattern == "prefixed" else ""
        return f"| {self.principal} | {self.operation} | {self.resource} | `{self.name}{star}` |"


def _dlq(topic: str) -> str:
    return f"{topic}.dlq"


def _retry(service: str, topic: str) -> str:
    return f"retry.{service}.{topic}"


@dataclass
class Policy:
    """Every principal of the workflow and its ACLs."""

    acls: list[Acl] = field(default_factory=list)

    @property
    def users(self) -> list[str]:
        return sorted({a.user for a in self.acls})

    def of(self, user: str) -> list[Acl]:
        return sorted(a for a in self.acls if a.user == user)

    def bindings(self) -> list[AclBinding]:
        return [a.binding() for a in sorted(set(self.acls))]

    def table(self) -> str:
        """Markdown table of every rule (SECURITY.md embeds it: ``python -m infra.security table``)."""
        lines = ["| principal | operation | resource | name |", "| --- | --- | --- | --- |"]
        lines += [a.row() for a in sorted(set(self.acls))]
        return "\n".join(lines)


def derive_policy(workflow: Workflow, topo: Topology | None = None, *,
                  registry_topic: str = REGISTRY_TOPIC) -> Policy:
    """ACLs for every service of ``workflow``, ingestion, the registry and the ops tools."""
    from choreo.topology import derive

    topo = topo or derive(workflow)
    acls: list[Acl] = []
    names = [s.name for s in workflow.services]
    for a in names:  # a prefix that covers another service's ids would leak its transactions
        for b in names:
            if a != b and b.startswith(f"{a}-"):
                raise ValueError(f"service {b!r} starts with {a}-: transactional id prefixes overlap")
    for service in workflow.services:
        user = service.name
        acls.append(Acl(user, "group", user, "READ"))
        acls.append(Acl(user, "group", f"replay.{user}.", "READ", "prefixed"))
        acls.append(Acl(user, "transactional_id", f"{user}-", "WRITE", "prefixed"))
        acls.append(Acl(user, "topic", RECOVERY_TOPIC, "WRITE"))
        for topic, handler in service.handlers.items():
            acls.append(Acl(user, "topic", topic, "READ"))
            acls.append(Acl(user, "topic", _dlq(handler.topic), "WRITE"))
        for topic, producers in topo.producers.items():
            if user in producers:
                acls.append(Acl(user, "topic", topic, "WRITE"))
    supervisor = next((s for s in workflow.services if s.name == "supervisor"), None)
    if supervisor is not None:
        acls.append(Acl(supervisor.name, "group", f"{supervisor.name}-source-reader", "READ"))
        for name in names:  # choreo.release: how far each group has committed
            acls.append(Acl(supervisor.name, "group", name, "DESCRIBE"))
        for step in workflow.steps:
            for topic in step.triggers:
                acls.append(Acl(supervisor.name, "topic", topic, "READ"))
                acls.append(Acl(supervisor.name, "topic", _retry(step.service, topic), "READ"))
        for _, confirmed_by in workflow.compensations().values():  # what proves an undo done
            acls.append(Acl(supervisor.name, "topic", confirmed_by.topic, "READ"))
    # the outcome copies (choreo.outcomes): whoever publishes an event that decides a delivery
    # writes its copy to the reply topic the request named, only under the reply prefix
    from choreo.outcomes import reply_prefix

    for topic in sorted({model.topic for model in workflow.outcome_labels}):
        for user in sorted(topo.producers.get(topic, ())):
            acls.append(Acl(user, "topic", reply_prefix(), "WRITE", "prefixed"))
    hooks = webhooks_service().name
    acls.append(Acl(hooks, "group", hooks, "READ"))
    acls.append(Acl(hooks, "transactional_id", f"{hooks}-", "WRITE", "prefixed"))
    for topic in webhook_topics(workflow):
        acls.append(Acl(hooks, "topic", topic, "READ"))
        acls.append(Acl(hooks, "topic", _dlq(topic), "WRITE"))
    for topic, producer in workflow.extra_producers.items():
        acls.append(Acl(producer, "topic", topic, "WRITE"))  # only that: it runs no step to report
        for group in sorted(topo.consumers.get(topic, ())):  # admission: lag of these groups
            acls.append(Acl(producer, "group", group, "DESCRIBE"))
    # the registry's own store
    acls += [Acl(REGISTRY, "topic", registry_topic, op) for op in ("READ", "WRITE", "CREATE")]
    acls.append(Acl(REGISTRY, "topic", registry_topic, "DESCRIBE_CONFIGS"))
    acls.append(Acl(REGISTRY, "group", "schema-registry-", "READ", "prefixed"))
    acls.append(Acl(REGISTRY, "transactional_id", "schema-registry-", "WRITE", "prefixed"))
    # ops tools: read everything of the workflow, redrive into it, their own marker/groups/ids
    for topic in sorted({*topo.partitions, *(_dlq(t) for t in webhook_topics(workflow))}):
        acls.append(Acl(OPS, "topic", topic, "READ"))
        acls.append(Acl(OPS, "topic", topic, "WRITE"))
    for name in [*names, hooks]:
        acls.append(Acl(OPS, "group", name, "READ"))  # status, trace, reset of a stopped group
    acls += [Acl(OPS, "topic", REDRIVEN_TOPIC, op) for op in ("READ", "WRITE", "CREATE")]
    acls.append(Acl(OPS, "group", OPS_PREFIX, "READ", "prefixed"))
    acls.append(Acl(OPS, "transactional_id", OPS_PREFIX, "WRITE", "prefixed"))
    return Policy(sorted(set(acls)))


def webhooks_service() -> Service:
    """The outcome webhooks' service (``choreo.webhooks``): a principal beside the workflow's."""
    from choreo.webhooks import service

    return service


def webhook_topics(workflow: Workflow) -> list[str]:
    """The topics the outcome webhooks read of ``workflow`` (``choreo.webhooks.deciding``)."""
    from choreo.webhooks import deciding

    return sorted({model.topic for model in deciding(workflow)})


# -- secrets -----------------------------------------------------------------------------------

def _env_name(user: str) -> str:
    return "CHOREO_KAFKA_PASSWORD_" + "".join(c if c.isalnum() else "_" for c in user).upper()


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only (0600, created so: no window)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    path.chmod(0o600)


def new_secret() -> str:
    """A random password safe in every place it travels (JAAS, URLs, StorageTool arguments)."""
    return _random.token_hex(24)


@dataclass(frozen=True)
class Secrets:
    """Where passwords live: the environment first, else generated files under ``root``."""

    root: Path

    @classmethod
    def default(cls) -> Secrets:
        from choreo.config import settings

        return cls(settings().data_dir / "secrets")

    def file(self, kind: str, user: str) -> Path:
        return self.root / kind / f"{user}.password"

    def password(self, user: str, kind: str = "kafka") -> str:
        env = os.environ.get(_env_name(user)) if kind == "kafka" else None
        if env:
            return env
        path = self.file(kind, user)
        if path.exists():
            return path.read_text().strip()
        secret = new_secret()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.root.chmod(0o700)
        write_private(path, secret)
        return secret

    @property
    def tls(self) -> TlsFiles:
        """The secured stack's CA and server certificate (``infra.tls``), under ``<root>/tls``."""
        from infra.tls import TlsFiles

        return TlsFiles(self.root / "tls")

    def password_file(self, user: str, kind: str = "kafka") -> Path:
        """A file holding ``user``'s password (written from the environment when it came from there)."""
        path = self.file(kind, user)
        secret = self.password(user, kind)
        if not path.exists() or path.read_text().strip() != secret:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, secret)
        return path


def client_env(user: str, bootstrap: str, secrets: Secrets) -> dict[str, str]:
    """Environment for a process that runs as ``user`` (what ``choreo.kafka.base_config`` reads)."""
    return {
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KAFKA_SSL_CA_LOCATION": str(secrets.tls.ca_cert),
        "KAFKA_SASL_MECHANISM": MECHANISM,
        "KAFKA_SASL_USERNAME": user,
        "KAFKA_SASL_PASSWORD_FILE": str(secrets.password_file(user)),
    }


def client_config(user: str, bootstrap: str, secrets: Secrets) -> dict[str, Any]:
    """librdkafka settings for ``user`` (tests and tools that build clients directly)."""
    return {
        "bootstrap.servers": bootstrap,
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(secrets.tls.ca_cert),
        "sasl.mechanism": MECHANISM,
        "sasl.username": user,
        "sasl.password": secrets.password(user),
    }


# -- applying ----------------------------------------------------------------------------------

def create_users(admin: AdminClient, users: Iterable[str], secrets: Secrets,
                 timeout_s: float = 30.0) -> None:
    """Create or update each user's SCRAM credential (idempotent)."""
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        ScramCredentialInfo, ScramMechanism, UserScramCredentialAlteration, UserScramCredentialUpsertion,
    )

    mechanism = ScramMechanism.SCRAM_SHA_256
    upserts: list[UserScramCredentialAlteration] = [
        UserScramCredentialUpsertion(user, ScramCredentialInfo(mechanism, SCRAM_ITERATIONS),
                                     secrets.password(user).encode())
        for user in sorted(set(users))
    ]
    if not upserts:
        return
    for future in admin.alter_user_scram_credentials(upserts, request_timeout=timeout_s).values():
        future.result(timeout=timeout_s)


def apply(admin: AdminClient, policy: Policy, secrets: Secrets, timeout_s: float = 30.0) -> None:
    """Create every principal's credential and ACL (both idempotent); run as the admin."""
    create_users(admin, policy.users, secrets, timeout_s)
    bindings = policy.bindings()
    for future in admin.create_acls(bindings, request_timeout=timeout_s).values():
        future.result(timeout=timeout_s)


def secured_topics(workflow: Workflow, bootstrap_config: dict[str, Any],
                   partitions: int | None = None) -> Topology:
    """Create the workflow's topics as the admin (services have no CREATE)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    from choreo.topology import DEFAULT_PARTITIONS, derive

    topo = derive(workflow, partitions or DEFAULT_PARTITIONS)
    # the outcome webhooks' dead letters, beside the workflow's (as many partitions as their source)
    wanted = {**topo.partitions, **{_dlq(t): topo.partitions[t] for t in webhook_topics(workflow)}}
    admin = AdminClient(bootstrap_config)
    existing = set(admin.list_topics(timeout=30).topics)
    new = [NewTopic(t, num_partitions=n, replication_factor=-1, config=topo.configs.get(t, {}))
           for t, n in wanted.items() if t not in existing]
    if new:
        for future in admin.create_topics(new, request_timeout=30).values():
            try:
                future.result(timeout=30)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
    return topo


SECURED_KAFKA_PORT = 29092  # below the ephemeral port range; the controller takes +1
SECURED_REDIS_PORT = 26379
SECURED_REGISTRY_PORT = 28081  # never the shared stack's 8081 (nor the chaos run's 18081)
SECURED_HOST = "127.0.0.1"
DEADLINE_PREFIX = "deadlines"  # choreo.state's deadline index (one key, or one per shard)
REGISTRY_USERS_FILE = "registry-users"  # under the secrets dir: ``user:password`` lines, 0600
REGISTRY_ROLES_FILE = "registry-roles"  # under the secrets dir: ``user role`` lines
REGISTRY_PEERS = "peers"  # <secrets>/registry-peer/peers.password: the instances' shared secret


def default_data_dir() -> Path:
    """Where ``up``/``down`` keep the secured stack unless told otherwise (the CLI shares it)."""
    from choreo.config import settings

    return settings().data_dir / "secured"


def secured_cluster(data_dir: Path, secrets: Secrets, base_port: int = SECURED_KAFKA_PORT,
                    heap: str | None = None) -> Any:
    """The secured single-node broker of ``data_dir`` (its own data, never the shared stack's),
    on ``SASL_SSL`` with the stack's certificate (``up`` makes it first)."""
    from choreo.config import settings
    from infra.kafka import KafkaCluster, KafkaSecurity, KafkaTls

    tls = KafkaTls(ca_file=secrets.tls.ca_cert, keystore_file=secrets.tls.keystore)
    cluster = KafkaCluster(data_dir=data_dir, libs=settings().kafka_libs, base_port=base_port,
                           security=KafkaSecurity(admin_password=secrets.password(ADMIN), tls=tls))
    return replace(cluster, heap=heap) if heap else cluster


def redis_url(secrets: Secrets, user: str | None, port: int = SECURED_REDIS_PORT) -> str:
    """The ACL Redis's URL with ``user``'s own credentials (what its ``REDIS_URL`` holds);
    without a user, the bare address (every command is refused: no login). TLS
    (``rediss://``), trusting the stack's CA: redis-py reads ``ssl_ca_certs`` from the URL,
    so every client that takes ``REDIS_URL`` needs nothing else."""
    from urllib.parse import quote

    login = "" if user is None else f"{user}:{secrets.password(user, kind='redis')}@"
    ca = quote(str(secrets.tls.ca_cert), safe="/")
    return f"rediss://{login}{SECURED_HOST}:{port}/0?ssl_ca_certs={ca}"


def _prefix(key: str) -> str:
    return key.split(":", 1)[0]


def redis_key_prefixes(workflow: Workflow, policy: Policy) -> dict[str, list[str]]:
    """Each principal's Redis user and the key prefixes it may touch (``*``: every key).

    Taken from the functions that name the keys and from the services' declarations, never a
    hand-kept list per service; only the part before the first ``:`` counts, so a key gaining
    a shard's hash tag (``dl:{s12}...``) stays in its prefix:

    * every service: the step table and the deadline index (``choreo.state``), the layout
      version (``choreo.layout``), its dedupe entries (``choreo.dedupe``) and effect answers
      (``choreo.effects``), which are per delivery and shared by the steps, plus the records
      and pools it declares itself;
    * the outcome webhooks: the runtime's keys only (they declare no state);
    * the supervisor: also its lease (``choreo.lease``), the release queue
      (``choreo.release``), its list of undos awaiting an operator (``choreo.supervision``),
      the records that go with a finished delivery, which it deletes, and the workflow's pools (a shipped delivery's member goes back to a pool
      ``returned_on_success``, a failed one's unless a completed step's undo gives it back);
    * ingestion: the step table, the deadline index and the layout version (it opens a
      delivery's first step), its in-flight places, owner records and idempotency keys
      (``producers``);
    * the registry: its leader lease (``registry.leader``) and nothing else;
    * ops: every key (rebuild-state and redrive rewrite any of them); no admin commands either.
    """
    from choreo.dedupe import seen_key
    from choreo.effects import memo_key
    from choreo.layout import LAYOUT_KEY
    from choreo.lease import lease_key
    from choreo.release import awaiting_key
    from choreo.state import delivery_key
    from choreo.supervision import awaiting_operator_index
    from producers.settings import IngestionSettings
    from producers.submit import idempotency_redis_key, owner_redis_key
    from registry.leader import LEASE_PREFIX

    one = "x"
    step_table = {_prefix(delivery_key(one)), DEADLINE_PREFIX, _prefix(LAYOUT_KEY)}
    runtime = step_table | {_prefix(seen_key(one)), _prefix(memo_key(one))}
    prefixes: dict[str, set[str]] = {}
    for service in workflow.services:
        own = prefixes[service.name] = set(runtime)
        own |= {_prefix(record.key(one)) for record in service.records}
        own |= {_prefix(key) for pool in service.pools for key in pool.keys}
    prefixes[webhooks_service().name] = set(runtime)  # dedupe and its dead letters' notes
    supervisor = prefixes.get("supervisor")
    if supervisor is not None:
        supervisor |= {_prefix(lease_key(one)), _prefix(awaiting_key(one, 0)),
                       _prefix(awaiting_operator_index(one))}
        supervisor |= {_prefix(key) for key in workflow.released_keys(one)}
        # its record of a success gives back what the delivery holds of pools returned on
        # success, its reading of a failure what it holds of pools no undo gives back
        supervisor |= {_prefix(key) for s in workflow.services for pool in s.pools for key in pool.keys}
    ingestion_keys = {_prefix(IngestionSettings().inflight_key), _prefix(owner_redis_key(one)),
                      _prefix(idempotency_redis_key(one, one))}
    for producer in set(workflow.extra_producers.values()):
        prefixes.setdefault(producer, set()).update(step_table | ingestion_keys)
    prefixes[REGISTRY] = {_prefix(LEASE_PREFIX)}
    prefixes[OPS] = {"*"}
    unknown = set(prefixes) - set(policy.users)
    if unknown:
        raise ValueError(f"Redis users without a Kafka principal: {sorted(unknown)}")
    return {user: sorted(found) for user, found in sorted(prefixes.items())}


def redis_table(prefixes: dict[str, list[str]]) -> str:
    """Markdown table of each Redis user's key prefixes (``python -m infra.security redis-table``)."""
    lines = ["| Redis user | keys (`~p ~p:*` each) |", "| --- | --- |"]
    lines += [f"| {user} | {', '.join(f'`{p}`' for p in found)} |" for user, found in prefixes.items()]
    return "\n".join(lines)


def redis_passwords(secrets: Secrets, users: Iterable[str]) -> dict[str, str]:
    return {user: secrets.password(user, kind="redis") for user in sorted(users)}


def registry_url(user: str | None, secrets: Secrets, port: int = SECURED_REGISTRY_PORT) -> str:
    """The secured registry's URL (HTTPS); with ``user``'s basic-auth login in it when given
    (confluent-kafka's ``SchemaRegistryClient`` and httpx both take credentials from the URL)."""
    if user is None:
        return f"https://{SECURED_HOST}:{port}"
    return f"https://{user}:{secrets.password(user, kind='registry')}@{SECURED_HOST}:{port}"


def https_server_env(secrets: Secrets) -> dict[str, str]:
    """What makes a process's HTTP server speak HTTPS only, with the stack's certificate
    (``choreo.http_serving.tls_options``): the registry's and ingestion's."""
    return {"CHOREO_HTTP_TLS_CERT_FILE": str(secrets.tls.server_cert),
            "CHOREO_HTTP_TLS_KEY_FILE": str(secrets.tls.server_key)}


def trust_env(secrets: Secrets) -> dict[str, str]:
    """What makes a process's HTTPS clients trust the stack's CA: ``SSL_CERT_FILE``, which
    httpx and confluent-kafka's ``SchemaRegistryClient`` read themselves (it replaces the
    system's CAs for that process)."""
    return {"SSL_CERT_FILE": str(secrets.tls.ca_cert)}


def registry_users(policy: Policy) -> list[str]:
    """Principals with a registry login: every one of the workflow, plus the admin.

    Services, ingestion, the supervisor and ops only read (schema lookups by id and by
    schema: ``choreo.serde.Encoder`` does not auto-register); the admin registers the
    contracts at deploy time (``choreo schemas register``, the schema gate) and alone may
    delete subjects or change compatibility and mode (``registry_roles``). The registry
    process itself only serves, so it gets none. Each principal has its own password
    (``<secrets>/registry/<user>.password``), never its Kafka one.
    """
    return sorted({*policy.users, ADMIN} - {REGISTRY})


def registry_roles(users: Iterable[str]) -> dict[str, str]:
    """Each login's role (``registry.auth``): the admin is ``admin``, every other one ``read``."""
    return {user: "admin" if user == ADMIN else "read" for user in sorted(users)}


def write_registry_users(secrets: Secrets, users: Iterable[str]) -> Path:
    """The registry's ``SCHEMA_REGISTRY_AUTH_USERS_FILE`` (0600): one ``user:password`` a line."""
    path = secrets.root / REGISTRY_USERS_FILE
    lines = "".join(f"{user}:{secrets.password(user, kind='registry')}\n" for user in sorted(users))
    write_private(path, "# written by infra.security up\n" + lines)
    return path


def write_registry_roles(secrets: Secrets, users: Iterable[str]) -> Path:
    """The registry's ``SCHEMA_REGISTRY_AUTH_ROLES_FILE``: one ``user role`` a line."""
    path = secrets.root / REGISTRY_ROLES_FILE
    lines = "".join(f"{user} {role}\n" for user, role in registry_roles(users).items())
    write_private(path, "# written by infra.security up\n" + lines)
    return path


def registry_env(data_dir: Path, secrets: Secrets, bootstrap: str, users_file: Path, roles_file: Path,
                 port: int = SECURED_REGISTRY_PORT) -> dict[str, str]:
    """The registry's environment: Kafka as ``schema-registry``, the ACL Redis (leader
    election), basic auth with roles on every call but the probes, the instances' peer
    secret. Every variable the registry reads is set explicitly so that nothing leaks in from
    the caller's shell (e.g. an ``SCHEMA_REGISTRY_AUTH_USERS`` of another registry, or
    another principal's sourced env file)."""
    url = registry_url(None, secrets, port)
    return {
        **client_env(REGISTRY, bootstrap, secrets),
        **https_server_env(secrets),
        **trust_env(secrets),  # writes forwarded to the leader go over HTTPS too
        "KAFKA_SASL_PASSWORD": "",
        "REDIS_URL": redis_url(secrets, REGISTRY),
        "CHOREO_DATA_DIR": str(data_dir),
        "SCHEMA_REGISTRY_URL": url,
        "SCHEMA_REGISTRY_ADVERTISED_URL": url,
        "SCHEMA_REGISTRY_TOPIC": REGISTRY_TOPIC,
        "SCHEMA_REGISTRY_AUTH_USERS_FILE": str(users_file),
        "SCHEMA_REGISTRY_AUTH_USERS": "",
        "SCHEMA_REGISTRY_AUTH_ROLES_FILE": str(roles_file),
        "SCHEMA_REGISTRY_AUTH_ROLES": "",
        "SCHEMA_REGISTRY_AUTH_READS": "true",
        "SCHEMA_REGISTRY_PEER_SECRET_FILE": str(secrets.password_file(REGISTRY_PEERS, kind="registry-peer")),
    }


def secured_registry(data_dir: Path, env: dict[str, str] | None = None,
                     port: int = SECURED_REGISTRY_PORT) -> Any:
    """The registry process of the secured stack (``<data>/registry``, its own port).

    ``env`` is only needed to start it; stopping finds it by pid file and command line."""
    from choreo.config import settings
    from infra.registry_process import registry_process

    cfg = settings().model_copy(update={
        "data_dir": data_dir, "schema_registry_url": f"https://{SECURED_HOST}:{port}",
        **({"kafka_bootstrap_servers": env["KAFKA_BOOTSTRAP_SERVERS"],
            "redis_url": env["REDIS_URL"]} if env else {}),
    })
    return registry_process(cfg, port=port, topic=REGISTRY_TOPIC, name="registry", env=env)


def principal_env(user: str, bootstrap: str, secrets: Secrets, data_dir: Path,
                  registry_login: bool, redis_login: bool) -> dict[str, str]:
    """What ``<data>/env/<user>.env`` holds: this principal's Kafka identity and nobody
    else's, its own Redis user if it has one, the registry (with its login if it has one),
    the CA its HTTPS clients trust, and for ingestion the certificate it serves HTTPS with."""
    return {
        **client_env(user, bootstrap, secrets),
        **trust_env(secrets),
        **(https_server_env(secrets) if user == INGESTION else {}),
        "REDIS_URL": redis_url(secrets, user if redis_login else None),
        "SCHEMA_REGISTRY_URL": registry_url(user if registry_login else None, secrets),
        "SCHEMA_REGISTRY_AUTO_REGISTER": "false",  # contracts are registered by the admin at deploy
        "CHOREO_DATA_DIR": str(data_dir),
    }


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an env file written by ``up`` (to start a process as that principal)."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key.strip(): value for key, value in pairs if not key.lstrip().startswith("#")}


def up(data_dir: Path, timeout_s: float = 90.0, *, partitions: int | None = None,
       heap: str | None = None) -> dict[str, Path]:
    """Start a secured broker, an ACL Redis and an authenticating registry under ``data_dir``,
    create the workflow's topics, users and ACLs, and write one env file per principal (0600);
    returns them by user. Idempotent: what already runs is reused."""
    from consumers.workflow import WORKFLOW
    from confluent_kafka.admin import AdminClient as _Admin

    from infra.redis_server import redis_process

    from infra.tls import ensure_certificates

    secrets = Secrets(data_dir / "secrets")
    ensure_certificates(secrets.tls.root)
    cluster = secured_cluster(data_dir, secrets, heap=heap)
    cluster.start(timeout_s)
    policy = derive_policy(WORKFLOW)
    redis_users = redis_key_prefixes(WORKFLOW, policy)
    redis_process(redis_url(secrets, OPS), data_dir, users=redis_passwords(secrets, redis_users),
                  keys=redis_users, name="redis-acl", tls=secrets.tls).start(timeout_s)
    admin_config = cluster.client_config()
    secured_topics(WORKFLOW, admin_config, partitions)
    apply(_Admin(admin_config), policy, secrets)  # the registry's principal must exist first
    logins = set(registry_users(policy))
    files: dict[str, Path] = {}
    for user in [*policy.users, ADMIN]:
        env = principal_env(user, cluster.bootstrap_servers, secrets, data_dir, user in logins,
                            user in redis_users)
        path = data_dir / "env" / f"{user}.env"
        write_private(path, "".join(f"{k}={v}\n" for k, v in env.items()))
        files[user] = path
    users_file = write_registry_users(secrets, logins)
    roles_file = write_registry_roles(secrets, logins)
    env = registry_env(data_dir, secrets, cluster.bootstrap_servers, users_file, roles_file)
    secured_registry(data_dir, env).start(timeout_s)
    return files


def down(data_dir: Path) -> list[str]:
    """Stop what ``up`` started under ``data_dir``: the registry first (it uses both the
    broker and Redis), then the broker, then Redis."""
    from infra.redis_server import redis_process

    secrets = Secrets(data_dir / "secrets")
    stopped: list[str] = []
    if secured_registry(data_dir).stop():
        stopped.append("registry")
    stopped += list(secured_cluster(data_dir, secrets).stop())
    if redis_process(redis_url(secrets, OPS), data_dir, name="redis-acl").stop():
        stopped.append("redis-acl")
    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m infra.security table``: the ACL table for SECURITY.md (``redis-table``: the
    Redis users' key prefixes);
    ``python -m infra.security up|down [DATA_DIR]``: a secured broker (SASL/SCRAM + ACLs on
    127.0.0.1:29092), an ACL Redis (26379) and a registry with logins and roles (28081,
    running on that broker as ``schema-registry``) with env files per principal;
    ``python -m infra.security apply``: users and ACLs on the configured cluster
    (run with the admin's credentials in KAFKA_SASL_*)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    from consumers.workflow import WORKFLOW

    policy = derive_policy(WORKFLOW)
    if args[:1] == ["table"]:
        print(policy.table())
        return 0
    if args[:1] == ["redis-table"]:
        print(redis_table(redis_key_prefixes(WORKFLOW, policy)))
        return 0
    if args[:1] in (["up"], ["down"]):
        data_dir = Path(args[1]) if len(args) > 1 else default_data_dir()
        if args[0] == "up":
            for user, path in up(data_dir).items():
                print(f"{user}: {path}")
            print(f"registry: {registry_url(None, Secrets(data_dir / 'secrets'))} "
                  "(a login is needed: SCHEMA_REGISTRY_URL in the env files; only the admin writes)")
        else:
            print(f"stopped: {', '.join(down(data_dir)) or 'nothing'}")
        return 0
    if args[:1] == ["apply"]:
        from choreo.kafka import admin as kafka_admin

        apply(kafka_admin(), policy, Secrets.default())
        print(f"applied {len(policy.acls)} ACLs for {', '.join(policy.users)}")
        return 0
    print("usage: python -m infra.security table|redis-table|up [DIR]|down [DIR]|apply", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
