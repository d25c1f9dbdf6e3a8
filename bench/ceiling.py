"""The ceiling: the pipeline's happy path as plain consume→produce stages with no logic.

Each stage of ``bench.common.HAPPY_PATH`` runs as its own process (as each service does),
with the runtime's consumer and producer settings (its batch loop: the first record, then
what arrives within ``CHOREO_BATCH_GATHER_MS``, up to 500; the fetch settings of ``choreo.kafka.transactional_consumer_config``, linger 2 ms, lz4), on its own fresh topics with the pipeline's
partition count, and produces records of the same sizes (the pipeline's own values and
headers, captured from a warm-up run). In ``transactional`` mode each batch is one Kafka
transaction with its input offsets, as in ``choreo.runner``; in plain mode offsets are
committed asynchronously per batch. What the stages lack is exactly the pipeline's logic:
decoding, validation, Redis, state table, encoding.

A ``tuned`` stage is the yardstick of what the broker can do: transactional too, but tuned
for throughput rather than like for like: it takes batches as large as the consumer hands
over (up to ``TUNED_BATCH`` within ``TUNED_POLL_S``), so a transaction's fixed cost is
spread over many records, and its producer lingers ``TUNED_LINGER_MS`` to fill larger
requests.

    python -m bench.ceiling stage SPEC.json   # run one stage until SIGTERM

The runtime's own switches (``CHOREO_BATCH_GATHER_MS``, ``CHOREO_KAFKA_FETCH_WAIT_MS``,
``CHOREO_KAFKA_FETCH_MIN_BYTES``, ``CHOREO_KAFKA_COMPRESSION``) apply to the stages too.
"""

from __future__ import annotations

import base64
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from choreo.config import settings
from choreo.kafka import (
    pipeline_producer_config, transactional_consumer_config, transactional_producer_config,
)
from choreo.memory import settle_garbage_collector

BATCH = 500
POLL_S = 0.05
TUNED_BATCH = 20_000
TUNED_POLL_S = 0.1
TUNED_LINGER_MS = 20

Headers = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True)
class Record:
    value: bytes
    headers: Headers

    def to_json(self) -> dict[str, Any]:
        return {"value": base64.b64encode(self.value).decode(),
                "headers": [[k, base64.b64encode(_raw(v)).decode()] for k, v in self.headers]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        return cls(base64.b64decode(data["value"]),
                   [(str(k), base64.b64decode(v)) for k, v in data["headers"]])

    @property
    def size(self) -> int:
        return len(self.value) + sum(len(k) + len(_raw(v)) for k, v in self.headers)


def _raw(value: str | bytes | None) -> bytes:
    if value is None:
        return b""
    return value.encode() if isinstance(value, str) else value


def save_samples(path: Path, samples: dict[str, Record]) -> None:
    path.write_text(json.dumps({t: r.to_json() for t, r in samples.items()}))


def load_samples(path: Path) -> dict[str, Record]:
    return {t: Record.from_json(r) for t, r in json.loads(path.read_text()).items()}


def producer_config(transactional_id: str | None) -> dict[str, Any]:
    """The runtime's producer settings; idempotent (acks=all) in both modes."""
    if transactional_id:
        return transactional_producer_config(transactional_id)
    return {**pipeline_producer_config(), "enable.idempotence": True, "acks": "all"}


def next_offsets(batch: list[Message]) -> list[TopicPartition]:
    last: dict[tuple[str, int], int] = {}
    for m in batch:
        key = (m.topic() or "", m.partition() or 0)
        last[key] = max(last.get(key, -1), m.offset() or 0)
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def next_batch(consumer: Consumer, tuned: bool) -> list[Message]:
    """The tuned stage's batch, or the runtime's (``choreo.runner.Runner._next_batch``)."""
    if tuned:
        return consumer.consume(TUNED_BATCH, TUNED_POLL_S)
    first = consumer.consume(1, POLL_S)
    if not first:
        return []
    return [*first, *consumer.consume(BATCH - 1, settings().batch_gather_ms / 1000)]


class FanIn:
    """Emit once per key when the last of ``need`` inputs for it has arrived."""

    def __init__(self, need: int) -> None:
        self.need = need
        self.seen: dict[bytes, int] = {}

    def arrive(self, key: bytes) -> bool:
        n = self.seen.get(key, 0) + 1
        if n >= self.need:
            self.seen.pop(key, None)
            return True
        self.seen[key] = n
        return False


def run_stage(spec: dict[str, Any]) -> None:
    """Consume → produce until SIGTERM. ``spec``: name, group, routes {in: out|None},
    fan_in, transactional, tuned, samples (path of the captured records, by original
    topic), originals {ceiling topic: original topic}."""
    routes: dict[str, str | None] = spec["routes"]
    samples = load_samples(Path(spec["samples"]))
    originals: dict[str, str] = spec["originals"]
    payload = {out: samples[originals[out]] for out in routes.values() if out is not None}
    tuned = bool(spec.get("tuned"))
    transactional = tuned or bool(spec["transactional"])
    fan_in = FanIn(sum(1 for out in routes.values() if out is not None)) if spec["fan_in"] else None
    consumer = Consumer(transactional_consumer_config(spec["group"], spec["name"]))
    producer = Producer({**producer_config(spec["group"] if transactional else None),
                         **({"linger.ms": TUNED_LINGER_MS} if tuned else {})})
    if transactional:
        producer.init_transactions(30)
    running = [True]

    def stop(*_: Any) -> None:
        running[0] = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    settle_garbage_collector()  # as the runtime does: like for like
    consumer.subscribe(list(routes))
    try:
        while running[0]:
            batch = [m for m in next_batch(consumer, tuned) if m.error() is None]
            if not batch:
                continue
            if transactional:
                producer.begin_transaction()
            for m in batch:
                out = routes.get(m.topic() or "")
                if out is None:
                    continue
                key = m.key() or b""
                if fan_in is not None and not fan_in.arrive(key):
                    continue
                record = payload[out]
                producer.produce(out, key=key, value=record.value, headers=record.headers)
                producer.poll(0)
            if transactional:
                producer.send_offsets_to_transaction(next_offsets(batch),
                                                     consumer.consumer_group_metadata(), 30)
                producer.commit_transaction(30)
            else:
                producer.poll(0)
                consumer.commit(offsets=next_offsets(batch), asynchronous=True)
    finally:
        producer.flush(10)
        consumer.close()


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] != "stage":
        raise SystemExit("usage: python -m bench.ceiling stage SPEC.json")
    run_stage(json.loads(Path(argv[1]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
