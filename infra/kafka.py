"""Apache Kafka 4.x in KRaft mode, from the jars Maven resolved (infra/pom.xml).

One combined broker+controller node by default. The multi-node mode (``nodes=3``) runs
three broker-only nodes beside one dedicated KRaft controller: with three combined nodes,
losing two of them also loses the controller quorum, so the cluster freezes (ISR cannot
shrink, leaders cannot move) and a producer only ever sees time-outs. A controller that
outlives the brokers lets failover tests observe what they are about: leader election
after one broker dies, and ``NOT_ENOUGH_REPLICAS`` (min ISR 2) once two are gone. It is
also Kafka's recommended production layout (dedicated controllers).

Each node formats its storage once, then runs ``kafka.Kafka`` with a config written here.

Secured mode (``security=KafkaSecurity(...)``, off by default): clients connect over a
``SASL_PLAINTEXT`` listener with SCRAM-SHA-256 and are authorized by the KRaft
``StandardAuthorizer`` (``allow.everyone.if.no.acl.found=false``, ``super.users=User:admin``).
Inter-broker traffic uses the same listener as ``admin``; the controller listener speaks
SASL/PLAIN with a static ``admin`` entry (SCRAM credentials live in the metadata log, which a
controller cannot read before it is up, so Kafka does not support SCRAM there; a PLAINTEXT
controller listener would have to make ``User:ANONYMOUS`` a super user, i.e. anyone who can
reach its port). The admin's SCRAM credential is added when storage is formatted; every
other principal and its ACLs come from ``infra.security``. The properties file then holds the
admin password: it is written with mode 0600 into the node's own (private) data dir.

With ``KafkaSecurity(tls=KafkaTls(...))`` every listener speaks TLS instead: clients and
brokers on ``SASL_SSL``, the controller on ``SASL_SSL`` too. The broker's key and certificate
come from a PEM keystore file and the CA from a PEM truststore (``ssl.keystore.type=PEM``,
``ssl.truststore.type=PEM``), as ``infra.tls`` makes them; the broker checks the controller's
name like any client (``ssl.endpoint.identification.algorithm=https``, Kafka's default).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka.admin import AdminClient

from infra.process import ManagedProcess, StackError, port_listening, stop_all

HOST = "127.0.0.1"
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
CONTROLLER_ID = 0  # the dedicated controller of a multi-node cluster; brokers are 1..n
FORMAT_ARGS = "format.args"  # StorageTool's arguments, in the node's private dir while it runs


def _java_arg(arg: str) -> str:
    """One argument as a java launcher argument file line (quoted, backslash-escaped)."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError(
            "Java was not found on PATH; Kafka needs Java 17 or newer "
            "(install it with: apt-get install -y openjdk-17-jre-headless)"
        )
    return java


SASL_LISTENER = "SASL_PLAINTEXT"
SASL_SSL_LISTENER = "SASL_SSL"
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True)
class KafkaTls:
    """The PEM files a TLS listener needs: the CA clients and brokers trust, and the
    broker's keystore (its private key followed by its certificate chain, mode 0600)."""

    ca_file: Path
    keystore_file: Path


@dataclass(frozen=True)
class KafkaSecurity:
    """SASL/SCRAM authentication and ACL authorization for a cluster (see the module doc).

    ``admin_password`` is the super user's secret; pass it from the environment or a file
    (``infra.security.Secrets``), never from the repository.
    """

    admin_password: str
    admin_user: str = "admin"
    mechanism: str = "SCRAM-SHA-256"
    scram_iterations: int = 8192
    tls: KafkaTls | None = None  # None: SASL_PLAINTEXT; else every listener is SASL_SSL

    @property
    def listener(self) -> str:
        """The client (and inter-broker) listener's name, which is also its protocol."""
        return SASL_LISTENER if self.tls is None else SASL_SSL_LISTENER

    def __post_init__(self) -> None:
        for value in (self.admin_user, self.admin_password):
            if not value or any(c in value for c in '"\\\n\r\t,=[]'):
                raise ValueError("the admin user and password must be non-empty and free of "
                                 "quotes, backslashes, whitespace controls, commas, '=' and brackets")

    def client_config(self) -> dict[str, Any]:
        """librdkafka settings for the admin principal."""
        config = {
            "security.protocol": self.listener,
            "sasl.mechanism": self.mechanism,
            "sasl.username": self.admin_user,
            "sasl.password": self.admin_password,
        }
        if self.tls is not None:
            config["ssl.ca.location"] = str(self.tls.ca_file)
        return config

    def scram_argument(self) -> str:
        """``StorageTool format --add-scram`` value that creates the admin's credential."""
        return (f"{self.mechanism}=[name={self.admin_user},password={self.admin_password},"
                f"iterations={self.scram_iterations}]")

    def properties(self) -> list[str]:
        """Authentication and authorization settings every node shares."""
        scram_jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required '
                      f'username="{self.admin_user}" password="{self.admin_password}";')
        plain_jaas = (f'org.apache.kafka.common.security.plain.PlainLoginModule required '
                      f'username="{self.admin_user}" password="{self.admin_password}" '
                      f'user_{self.admin_user}="{self.admin_password}";')
        tls = [] if self.tls is None else [
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={self.tls.keystore_file}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={self.tls.ca_file}",
            "ssl.client.auth=none",  # clients prove who they are with SCRAM, not certificates
        ]
        return [
            *tls,
            f"sasl.enabled.mechanisms={self.mechanism}",
            f"sasl.mechanism.inter.broker.protocol={self.mechanism}",
            f"listener.name.{self.listener.lower()}.{self.mechanism.lower()}.sasl.jaas.config={scram_jaas}",
            "sasl.mechanism.controller.protocol=PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            f"listener.name.controller.plain.sasl.jaas.config={plain_jaas}",
            f"authorizer.class.name={STANDARD_AUTHORIZER}",
            f"super.users=User:{self.admin_user}",
            "allow.everyone.if.no.acl.found=false",
        ]


@dataclass(frozen=True)
class KafkaCluster:
    """A KRaft cluster on loopback; broker ``n`` listens on ``base_port + 2n``.

    One node: a combined broker+controller with its controller on ``base_port + 1``.
    Several nodes: broker-only nodes plus a dedicated controller on ``base_port + 1``.
    """

    data_dir: Path
    libs: Path
    nodes: int = 1
    base_port: int = 9092
    heap: str = "-Xms256m -Xmx768m"
    controller_heap: str = "-Xms64m -Xmx256m"
    security: KafkaSecurity | None = None  # None: PLAINTEXT, no authorizer (the default)
    # how often the controller hands partitions back to their preferred (restarted) leader;
    # each hand-back moves partition leaders and group and transaction coordinators
    leader_rebalance_s: int = 300

    @property
    def listener(self) -> str:
        """The client (and inter-broker) listener's name, which is also its protocol."""
        return "PLAINTEXT" if self.security is None else self.security.listener

    def client_config(self) -> dict[str, Any]:
        """What an admin client needs to reach this cluster (SASL credentials when secured)."""
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        if self.security is not None:
            config.update(self.security.client_config())
        return config

    def broker_port(self, node: int) -> int:
        return self.base_port + 2 * node

    def controller_port(self, node: int) -> int:
        return self.base_port + 2 * node + 1

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{HOST}:{self.broker_port(n)}" for n in range(self.nodes))

    @property
    def combined(self) -> bool:
        return self.nodes == 1

    def node_dir(self, node: int) -> Path:
        return self.data_dir / f"kafka-{node}"

    @property
    def controller_dir(self) -> Path:
        return self.data_dir / "kafka-controller"

    def _common_properties(self) -> list[str]:
        """Settings every node shares (in KRaft the controller applies topic defaults)."""
        replicas = min(self.nodes, 3)
        min_isr = 2 if self.nodes >= 3 else 1
        if self.security is None:
            protocols = "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
            secured: list[str] = []
        else:
            protocols = f"{self.listener}:{self.listener},CONTROLLER:{self.security.listener}"
            secured = self.security.properties()
        return [
            "controller.listener.names=CONTROLLER",
            f"listener.security.protocol.map={protocols}",
            *secured,
            "num.partitions=6",
            f"default.replication.factor={replicas}",
            f"min.insync.replicas={min_isr}",
            f"offsets.topic.replication.factor={replicas}",
            "offsets.topic.num.partitions=12",
            f"transaction.state.log.replication.factor={replicas}",
            f"transaction.state.log.min.isr={min_isr}",
            "transaction.state.log.num.partitions=12",
            "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=false",
            "delete.topic.enable=true",
            "log.retention.hours=168",
            "log.segment.bytes=104857600",
            "unclean.leader.election.enable=false",
            f"leader.imbalance.check.interval.seconds={self.leader_rebalance_s}",
            "message.max.bytes=1048588",
        ]

    def _properties(self, node: int) -> str:
        if self.combined:
            lines = [
                "process.roles=broker,controller",
                "node.id=1",
                f"listeners={self.listener}://{HOST}:{self.broker_port(0)},"
                f"CONTROLLER://{HOST}:{self.controller_port(0)}",
                f"advertised.listeners={self.listener}://{HOST}:{self.broker_port(0)}",
                f"inter.broker.listener.name={self.listener}",
                f"controller.quorum.bootstrap.servers={HOST}:{self.controller_port(0)}",
                f"log.dirs={self.node_dir(0) / 'data'}",
            ]
        else:
            lines = [
                "process.roles=broker",
                f"node.id={node + 1}",
                f"listeners={self.listener}://{HOST}:{self.broker_port(node)}",
                f"advertised.listeners={self.listener}://{HOST}:{self.broker_port(node)}",
                f"inter.broker.listener.name={self.listener}",
                f"controller.quorum.voters={CONTROLLER_ID}@{HOST}:{self.controller_port(0)}",
                f"log.dirs={self.node_dir(node) / 'data'}",
                # a killed broker is fenced (and leaves every ISR) after ~4 s instead of 9 s
                "broker.heartbeat.interval.ms=500",
            ]
        return "\n".join([*lines, *self._common_properties(), ""])

    def _controller_properties(self) -> str:
        lines = [
            "process.roles=controller",
            f"node.id={CONTROLLER_ID}",
            f"listeners=CONTROLLER://{HOST}:{self.controller_port(0)}",
            f"controller.quorum.voters={CONTROLLER_ID}@{HOST}:{self.controller_port(0)}",
            f"log.dirs={self.controller_dir / 'data'}",
            "broker.session.timeout.ms=4000",
        ]
        return "\n".join([*lines, *self._common_properties(), ""])

    def _managed(self, name: str, workdir: Path, heap: str, ports: list[int]) -> ManagedProcess:
        config = workdir / "server.properties"
        return ManagedProcess(
            name=name,
            # resolved again (with a clear error) by start(); status and stop need no Java
            argv=[
                shutil.which("java") or "java",
                *heap.split(),
                "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
                "-cp",
                f"{self.libs}/*",
                "kafka.Kafka",
                str(config),
            ],
            workdir=workdir,
            ports=[(HOST, port) for port in ports],
            ready=lambda: True,  # the cluster is probed as a whole: see wait_ready()
            marker=str(config),
        )

    def _process(self, node: int) -> ManagedProcess:
        ports = [self.broker_port(node)]
        if self.combined:
            ports.append(self.controller_port(node))
        return self._managed(f"kafka-{node}", self.node_dir(node), self.heap, ports)

    def controller(self) -> ManagedProcess | None:
        """The dedicated controller of a multi-node cluster (None for a combined single node)."""
        if self.combined:
            return None
        return self._managed(
            "kafka-controller", self.controller_dir, self.controller_heap,
            [self.controller_port(0)],
        )

    def _format(
        self, workdir: Path, properties: str, cluster_id: str, java: str
    ) -> subprocess.Popen[str] | None:
        """Write the node's config; start formatting its storage unless that was done before.

        Returns the running StorageTool (the caller waits, so several nodes format at once).
        """
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "server.properties"
        if self.security is not None:
            # the file holds the admin's password: private to this user from its first byte
            workdir.chmod(0o700)
            if not config.exists():
                os.close(os.open(config, os.O_WRONLY | os.O_CREAT, 0o600))
            config.chmod(0o600)
        if not config.exists() or config.read_text() != properties:
            config.write_text(properties)
        if (workdir / "data" / "meta.properties").exists():
            return None
        # --standalone bootstraps the single node's dynamic quorum; static voters need nothing
        standalone = ["--standalone"] if self.combined else []
        # the admin's SCRAM credential goes into the bootstrap metadata (brokers need it to
        # authenticate to each other before anyone could create it through the API)
        scram = ["--add-scram", self.security.scram_argument()] if self.security is not None else []
        args = ["-cp", f"{self.libs}/*", "kafka.tools.StorageTool", "format",
                # "=": a cluster id may start with "-" (url-safe base64), which must not read as a flag
                f"--cluster-id={cluster_id}", "-c", str(config), *standalone, *scram]
        # the arguments (the admin's password among them) go in a private argument file that
        # the java launcher reads (``java @file``), so no password shows on a command line
        argfile = workdir / FORMAT_ARGS
        os.close(os.open(argfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        argfile.write_text("".join(_java_arg(arg) + "\n" for arg in args))
        return subprocess.Popen(
            [java, f"@{argfile}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        )

    def _format_all(self, java: str) -> None:
        cluster_id = self._cluster_id()
        jobs = [(self.node_dir(n), self._properties(n)) for n in range(self.nodes)]
        if not self.combined:
            jobs.append((self.controller_dir, self._controller_properties()))
        running = [(workdir, self._format(workdir, props, cluster_id, java)) for workdir, props in jobs]
        failures = []
        for workdir, proc in running:
            if proc is None:
                continue
            output, _ = proc.communicate()
            (workdir / FORMAT_ARGS).unlink(missing_ok=True)
            if proc.returncode != 0:
                failures.append(f"{workdir.name}: {output.strip()}")
        if failures:
            raise StackError(f"formatting Kafka storage failed: {'; '.join(failures)}")

    def _cluster_id(self) -> str:
        id_file = self.data_dir / "kafka-cluster-id"
        if id_file.exists():
            return id_file.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        id_file.write_text(cluster_id)
        return cluster_id

    def start(self, timeout_s: float) -> list[str]:
        """Format once, start every node that is not running, wait for metadata; return what started.

        On failure, the nodes this call started are stopped again before the error is raised.
        """
        java = java_binary()
        if not (self.libs.is_dir() and any(self.libs.glob("kafka_2.13-*.jar"))):
            raise StackError(
                f"Kafka jars not found in {self.libs}; run: bash infra/setup.sh "
                "(it resolves them from Maven Central with infra/pom.xml)"
            )
        procs = self.processes()
        # check every port before starting anything, so a conflict leaves nothing half-started
        for proc in procs:
            if not proc.running():
                proc.check_ports()
        self._format_all(java)
        started: list[ManagedProcess] = []
        try:
            for proc in procs:
                if proc.start(timeout_s=timeout_s):
                    started.append(proc)
            self.wait_ready(timeout_s)
        except StackError:
            stop_all(started, timeout_s=10)
            raise
        return [proc.name for proc in started]

    def wait_ready(self, timeout_s: float) -> None:
        """Return once every broker is listed in a metadata answer; raise after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        last_error = "no broker listening yet"
        admin: AdminClient | None = None
        while True:
            for proc in self.processes():
                if not proc.running():
                    raise StackError(f"{proc.name} exited during start-up; see {proc.log_file}")
            if all(port_listening(HOST, self.broker_port(n)) for n in range(self.nodes)):
                try:
                    # log_level 0: connection refusals while starting are expected, not news
                    admin = admin or AdminClient({**self.client_config(), "log_level": 0})
                    brokers = len(admin.list_topics(timeout=2).brokers)
                    if brokers >= self.nodes:
                        return
                    last_error = f"{brokers} of {self.nodes} brokers registered"
                except Exception as exc:  # the broker refuses requests while starting
                    last_error = str(exc)
            if time.monotonic() >= deadline:
                raise StackError(
                    f"Kafka did not answer a metadata request within {timeout_s:g}s "
                    f"({last_error}); see {self._process(0).log_file}"
                )
            time.sleep(0.3)

    def stop(self) -> list[str]:
        """Stop the brokers together, then the controller (brokers shut down through it)."""
        stopped = stop_all([self._process(n) for n in range(self.nodes)], timeout_s=30)
        controller = self.controller()
        if controller is not None and controller.stop(timeout_s=30):
            stopped.append(controller.name)
        return stopped

    def processes(self) -> list[ManagedProcess]:
        """Every process of the cluster, the controller (if any) first: start order."""
        controller = self.controller()
        brokers = [self._process(n) for n in range(self.nodes)]
        return [controller, *brokers] if controller is not None else brokers

    def node(self, node: int) -> ManagedProcess:
        """Broker ``node`` (0-based), e.g. to kill it in a failover test."""
        return self._process(node)
