"""Apache Kafka 4.x in KRaft mode, from the jars Maven resolved (infra/pom.xml).

One combined broker+controller by default; three on request for failover tests. Each
node formats its storage once, then runs ``kafka.Kafka`` with a config written here.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient

from infra.process import ManagedProcess, StackError, port_in_use

HOST = "127.0.0.1"
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError(
            "Java was not found on PATH; Kafka needs Java 17 or newer "
            "(install it with: apt-get install -y openjdk-17-jre-headless)"
        )
    return java


@dataclass(frozen=True)
class KafkaCluster:
    """A KRaft cluster of ``nodes`` combined nodes on loopback; ports count up from ``base_port``."""

    data_dir: Path
    libs: Path
    nodes: int = 1
    base_port: int = 9092
    heap: str = "-Xms256m -Xmx768m"

    def broker_port(self, node: int) -> int:
        return self.base_port + 2 * node

    def controller_port(self, node: int) -> int:
        return self.base_port + 2 * node + 1

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{HOST}:{self.broker_port(n)}" for n in range(self.nodes))

    def node_dir(self, node: int) -> Path:
        return self.data_dir / f"kafka-{node}"

    def _properties(self, node: int) -> str:
        replicas = min(self.nodes, 3)
        min_isr = 2 if self.nodes >= 3 else 1
        voters = ",".join(f"{n + 1}@{HOST}:{self.controller_port(n)}" for n in range(self.nodes))
        quorum = (
            f"controller.quorum.bootstrap.servers={HOST}:{self.controller_port(0)}"
            if self.nodes == 1
            else f"controller.quorum.voters={voters}"
        )
        return "\n".join(
            [
                "process.roles=broker,controller",
                f"node.id={node + 1}",
                f"listeners=PLAINTEXT://{HOST}:{self.broker_port(node)},"
                f"CONTROLLER://{HOST}:{self.controller_port(node)}",
                f"advertised.listeners=PLAINTEXT://{HOST}:{self.broker_port(node)}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                quorum,
                f"log.dirs={self.node_dir(node) / 'data'}",
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
                "message.max.bytes=1048588",
                "",
            ]
        )

    def _process(self, node: int) -> ManagedProcess:
        workdir = self.node_dir(node)
        config = workdir / "server.properties"
        return ManagedProcess(
            name=f"kafka-{node}",
            argv=[
                java_binary(),
                *self.heap.split(),
                "-XX:+UseG1GC",
                f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
                "-cp",
                f"{self.libs}/*",
                "kafka.Kafka",
                str(config),
            ],
            workdir=workdir,
            ports=[(HOST, self.broker_port(node)), (HOST, self.controller_port(node))],
            ready=lambda: True,
            marker=str(config),
        )

    def _format(self, node: int, cluster_id: str) -> None:
        workdir = self.node_dir(node)
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "server.properties"
        config.write_text(self._properties(node))
        if (workdir / "data" / "meta.properties").exists():
            return
        standalone = ["--standalone"] if self.nodes == 1 else []
        result = subprocess.run(
            [java_binary(), "-cp", f"{self.libs}/*", "kafka.tools.StorageTool", "format",
             "-t", cluster_id, "-c", str(config), *standalone],
            capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise StackError(
                f"kafka-{node}: formatting storage failed: {result.stdout.strip()} "
                f"{result.stderr.strip()}"
            )

    def _cluster_id(self) -> str:
        id_file = self.data_dir / "kafka-cluster-id"
        if id_file.exists():
            return id_file.read_text().strip()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        id_file.write_text(cluster_id)
        return cluster_id

    def start(self, timeout_s: float) -> list[str]:
        """Format once, start every node that is not running, wait for metadata; return what started."""
        if not (self.libs.is_dir() and any(self.libs.glob("kafka_2.13-*.jar"))):
            raise StackError(
                f"Kafka jars not found in {self.libs}; run: mvn -q -f infra/pom.xml "
                "dependency:copy-dependencies (the setup script does this)"
            )
        cluster_id = self._cluster_id()
        started = []
        for node in range(self.nodes):
            self._format(node, cluster_id)
        for node in range(self.nodes):
            proc = self._process(node)
            # nodes of a cluster wait for each other, so readiness is checked for all at once
            if proc.start(timeout_s=timeout_s):
                started.append(proc.name)
        self.wait_ready(timeout_s)
        return started

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_error = ""
        while time.monotonic() < deadline:
            for node in range(self.nodes):
                if not self._process(node).running():
                    raise StackError(
                        f"kafka-{node} exited during start-up; see {self._process(node).log_file}"
                    )
            if not all(port_in_use(HOST, self.broker_port(n)) for n in range(self.nodes)):
                time.sleep(0.2)
                continue
            try:
                admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
                meta = admin.list_topics(timeout=2)
                if len(meta.brokers) >= self.nodes:
                    return
            except Exception as exc:  # the broker refuses connections while starting
                last_error = str(exc)
            time.sleep(0.3)
        raise StackError(
            f"Kafka did not answer a metadata request within {timeout_s:.0f}s ({last_error}); "
            f"see {self._process(0).log_file}"
        )

    def stop(self) -> list[str]:
        return [p.name for p in self.processes() if p.stop(timeout_s=30)]

    def processes(self) -> list[ManagedProcess]:
        return [self._process(n) for n in range(self.nodes)]

    def node(self, node: int) -> ManagedProcess:
        return self._process(node)
