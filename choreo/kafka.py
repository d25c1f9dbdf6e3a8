"""Kafka client configuration and topic administration, in one place for every process."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]

from choreo.config import settings
from choreo.envelope import Headers


def base_config(bootstrap: str | None = None) -> dict[str, Any]:
    """Connection settings every client shares: the bootstrap servers and, when configured,
    SASL credentials (each service runs as its own principal under the broker's ACLs) and
    the CA that a TLS listener's certificate must chain to."""
    cfg = settings()
    config: dict[str, Any] = {"bootstrap.servers": bootstrap or cfg.kafka_bootstrap_servers}
    protocol = cfg.kafka_security_protocol.upper()
    if protocol != "PLAINTEXT":
        config["security.protocol"] = protocol
    if protocol.startswith("SASL_"):
        password = cfg.kafka_sasl_password
        if cfg.kafka_sasl_password_file is not None:
            password = cfg.kafka_sasl_password_file.read_text().strip()
        config.update({
            "sasl.mechanism": cfg.kafka_sasl_mechanism,
            "sasl.username": cfg.kafka_sasl_username,
            "sasl.password": password,
        })
    if protocol.endswith("SSL") and cfg.kafka_ssl_ca_location is not None:
        config["ssl.ca.location"] = str(cfg.kafka_ssl_ca_location)
    return config


def pipeline_producer_config() -> dict[str, Any]:
    """Batching settings every producer of the pipeline shares (services, ingestion, and the
    benchmark's no-logic ceiling, which must be like for like)."""
    return {**base_config(), "linger.ms": 2, "compression.type": settings().kafka_compression}


def transactional_producer_config(transactional_id: str) -> dict[str, Any]:
    """A consume-transform-produce producer (the services' and the benchmark's ceiling).

    ``retry.backoff.ms`` is low because every transaction begun right after a commit is
    refused with CONCURRENT_TRANSACTIONS until the previous one's markers are written, and
    librdkafka waits ``retry.backoff.ms`` (100 ms by default) before asking again: back to
    back, a transaction took 105 ms instead of 8.5 (Java's client waits 20 ms there,
    KAFKA-5477). The backoff still doubles on each further failure, up to 1 s.
    """
    return {
        **pipeline_producer_config(),
        "transactional.id": transactional_id,
        "transaction.timeout.ms": 30000,
        "retry.backoff.ms": settings().kafka_txn_retry_backoff_ms,
    }


class TransactionalProducer(Producer):
    """A transactional producer that knows whether its open transaction has written a record.

    A batch that wrote none has nothing to make atomic with its offsets, and a transaction
    costs the broker five requests and as many log writes where a plain offset commit costs
    one (``Runner._process``)."""

    wrote = False

    def begin_transaction(self) -> None:
        super().begin_transaction()
        self.wrote = False

    def produce(self, *args: Any, **kwargs: Any) -> None:
        super().produce(*args, **kwargs)
        self.wrote = True


def transactional_consumer_config(group: str, client_id: str) -> dict[str, Any]:
    """The consumer side of a consume-transform-produce service: offsets are committed
    through the producer's transaction (plainly for a batch that wrote no record), and only
    committed records are read."""
    return {
        **base_config(),
        "group.id": group,
        "client.id": client_id,
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 60000,
        # how long the broker may hold a fetch when NO data is there: with fetch.min.bytes=1 a
        # fetch returns as soon as any committed record exists, so this bounds idle polling
        # (each service polls 6-48 partitions), not latency
        "fetch.wait.max.ms": settings().kafka_fetch_wait_max_ms,
        "fetch.min.bytes": settings().kafka_fetch_min_bytes,
    }


# The client's ``headers()`` returns its list with the decoding error left set. The
# interpreter's specialised call of a hot ``message.headers()`` does not check for that, and
# the error surfaces at some later, unrelated call; a call of a ``methodcaller`` object is
# never specialised, and its generic call path raises ``SystemError`` (measured: Python 3.11,
# confluent-kafka 2.16.1). Every read of a record's headers must come through here: a direct
# call that left the error set would be blamed on the next record read here
_read_headers = operator.methodcaller("headers")


class UnreadableHeaders(ValueError):
    """A record whose header names the client cannot read."""


def headers_of(message: Message) -> Headers | None:
    """The record's headers, as the client reads them. A header name that is not UTF-8 (no
    client of ours writes one, but anyone who speaks the protocol can) makes
    confluent-kafka's ``headers()`` raise ``SystemError``: ``UnreadableHeaders`` instead, so
    that the record is refused like any other unusable one rather than stopping its reader.
    The message keeps no headers from then on: the client caches the list it failed to
    build, a name missing from it, and a second ``headers()`` would hand that over."""
    try:
        headers: Headers | None = _read_headers(message)
        return headers
    except SystemError as exc:
        if isinstance(exc.__context__, UnicodeDecodeError):
            message.set_headers([])
            raise UnreadableHeaders("a header name is not UTF-8") from exc
        raise


def headers_if_readable(message: Message) -> Headers | None:
    """``headers_of``, with None for headers the client cannot read: for the tools and the
    copies that show or keep a record as far as it can be read."""
    try:
        return headers_of(message)
    except UnreadableHeaders:
        return None


def admin(bootstrap: str | None = None) -> AdminClient:
    return AdminClient(base_config(bootstrap))


# answers of a group coordinator that is moving or loading; the next request finds it
_COORDINATOR_MOVING = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                       KafkaError.COORDINATOR_NOT_AVAILABLE)


class CommittedOffsets:
    """What consumer groups have committed, read with one idle consumer handle per group.

    Not ``AdminClient.list_consumer_group_offsets``: when a group's coordinator moves (a
    broker restarts, then the controller's preferred-leader election hands its
    ``__consumer_offsets`` partition back), the admin client's NOT_COORDINATOR answer makes
    librdkafka 2.16 dereference a consumer group it does not have, and the whole process
    dies of a segmentation fault (librdkafka #5040). A chaos run lost both supervisors to it
    at once. A consumer handle answers NOT_COORDINATOR as an error and looks the new
    coordinator up meanwhile, so asking again (within the timeout) reaches it. The handles
    never subscribe, so they never join, rebalance or commit for the groups they read.
    """

    def __init__(self, timeout_s: float = 5.0, bootstrap: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.bootstrap = bootstrap
        self._probes: dict[str, Consumer] = {}

    def of(self, group: str, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The offset ``group`` will read next on each (topic, partition); negative where it
        never committed. Raises ``KafkaException`` when no coordinator answers in time."""
        probe = self._probes.get(group)
        if probe is None:
            probe = self._probes[group] = Consumer({
                **base_config(self.bootstrap), "group.id": group, "enable.auto.commit": False,
            })
        wanted = [TopicPartition(t, p) for t, p in partitions]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                found = probe.committed(wanted, timeout=max(0.1, deadline - time.monotonic()))
                break
            except KafkaException as exc:  # the coordinator moved: it is looked up again
                if exc.args[0].code() not in _COORDINATOR_MOVING or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for tp in found:
            if tp.error is not None:
                raise KafkaException(tp.error)
        return {(tp.topic, tp.partition): int(tp.offset) for tp in found}

    def on_topic(self, group: str, topic: str, partitions: Iterable[int]) -> dict[int, int]:
        return {p: offset for (_, p), offset in self.of(group, [(topic, p) for p in partitions]).items()}

    def close(self) -> None:
        for probe in self._probes.values():
            probe.close()
        self._probes.clear()


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
    _wait_for_leaders(client, [t.topic for t in new], timeout_s)


def _wait_for_leaders(client: AdminClient, topics: list[str], timeout_s: float) -> None:
    """Creation returns before the new partitions are served, and metadata can name a leader
    a moment before that leader serves the partition: a client that asked for watermarks in
    between got NOT_LEADER_FOR_PARTITION (seen in a test run). So wait until every
    partition has a leader and that leader answers a ListOffsets."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        meta = client.list_topics(timeout=timeout_s).topics
        if all(t in meta and meta[t].error is None and meta[t].partitions
               and all(p.leader >= 0 for p in meta[t].partitions.values()) for t in topics):
            partitions = [TopicPartition(t, p) for t in topics for p in meta[t].partitions]
            if _leaders_answer(client, partitions, max(0.1, deadline - time.monotonic())):
                return
        time.sleep(0.1)


def _leaders_answer(client: AdminClient, partitions: list[TopicPartition], timeout_s: float) -> bool:
    latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
    futures = client.list_offsets({tp: latest for tp in partitions}, request_timeout=timeout_s)
    try:
        for future in futures.values():
            future.result(timeout=timeout_s)
    except (KafkaException, TimeoutError):  # not served yet
        return False
    return True


# answers about a partition whose leadership is changing hands; the next request finds it
_LEADER_MOVING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)


def wait_transactions_settled(timeout_s: float, log: Callable[[str], None] | None = None) -> float:
    """Wait until no partition holds an open transaction (last stable offset == high
    watermark everywhere); returns the seconds it took.

    A reader that stops at the last stable offset (rebuild-state, a checker) would otherwise
    miss a transaction that commits just after it read: a process killed mid-transaction
    leaves one open until ``transaction.timeout.ms``.
    """
    started = time.monotonic()
    committed = Consumer({**base_config(), "group.id": "lso-probe",
                          "isolation.level": "read_committed", "log_level": 0})
    uncommitted = Consumer({**base_config(), "group.id": "hw-probe",
                            "isolation.level": "read_uncommitted", "log_level": 0})
    try:
        meta = committed.list_topics(timeout=10)
        tps = [TopicPartition(t, p) for t, tm in meta.topics.items() if not t.startswith("__")
               for p in tm.partitions]
        def still_open(tp: TopicPartition) -> bool:
            try:
                return bool(committed.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                            < uncommitted.get_watermark_offsets(tp, timeout=10, cached=False)[1])
            except KafkaException as exc:  # its leader is moving (a broker came back): ask again
                if exc.args[0].code() in _LEADER_MOVING:
                    return True
                raise

        while tps and time.monotonic() - started < timeout_s:
            tps = [tp for tp in tps if still_open(tp)]
            if tps:
                time.sleep(1.0)
        if tps and log is not None:
            log(f"{len(tps)} partitions still have open transactions after {timeout_s:.0f}s")
    finally:
        committed.close()
        uncommitted.close()
    return time.monotonic() - started
