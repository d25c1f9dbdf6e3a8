"""Dead letters: list them by topic and reason, show one, and redrive a selection once.

**Where a redriven event goes.** Back to the topic it was dead-lettered from
(``dlq.source.topic``: the origin topic, or the service's retry topic when it failed
there), with its original key, value and envelope (same event id, same attempt), the
``dlq.*`` headers removed and ``redrive.from`` added so a trace shows where it came from.

**Why it is handled once, and only by the service that failed it.** The consumer-side
dedupe (``choreo.dedupe``) remembers ``<service>:<event id>:<attempt>`` with the *first*
position that carried it. The dead-lettering service recorded the dead-lettered position,
so a copy at a new position would be skipped as a duplicate. The redrive therefore makes
that one service forget that entry just before the copy is committed: for it the new
position is the first one. Every other consumer group of the source topic handled the
original successfully at its own position and still skips the copy. Keeping the event id
(rather than minting a new one) keeps every remembered answer (``ctx.once``) and every
derived output id the same, so even a redrive of an event that *did* get partly handled
cannot produce a second, different outcome. For a supervised step the state table has the
last word: if the step was closed meanwhile (failed, compensated), the redriven event is
a late answer and is ignored, which is what the supervisor already decided.

**Only where it truly came from.** The runtime strips every ``dlq.*`` header an incoming
record carried and writes its own, so a dead letter holds exactly one of each. A record
in ``<topic>.dlq`` whose ``dlq.*`` headers are missing, repeated, or name a source that is
neither ``<topic>`` nor the dead-lettering service's retry topic of it was not written so
by the runtime: it is shown with that problem and never redriven (a redrive publishes as
the ops principal, which may write where the record's author may not).

**Each at most once.** The redriven DLQ positions are recorded in a compacted topic
(``choreo.dlq.redriven``, key ``<dlq topic>|<partition>|<offset>``), produced in the *same
Kafka transaction* as the redriven events: a marker exists exactly when its redrive was
committed. A Redis set would not be atomic with the produce, and would be lost with Redis
(which is when a rebuild might tempt someone to redrive again). All redrives share one
``transactional.id``: a second concurrent redrive fences the first, and the markers are
read only after ``init_transactions`` (which completes or aborts the fenced one), so two
operators cannot both redrive the same record. A redrive sends the letters as it reads them,
a transaction per ``REDRIVE_CHUNK_BYTES`` of records (a selection can be more than memory
holds): one stopped halfway has redriven what it committed, which the next one skips.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Generator, Iterable
from contextlib import closing
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from confluent_kafka import Producer

from choreo.config import settings
from choreo.dedupe import seen_field, seen_key
from choreo.envelope import MAX_ID_CHARS, HeaderList, now_ms
from choreo.kafka import base_config, ensure_topics
from choreo.ops.records import BodyDecoder, Progress, Rec, existing_topics, read, reader, resolve
from choreo.redis_client import connect
from choreo.runner import (
    DLQ_HEADER_PREFIX, DLQ_HEADERS, H_DLQ_ERROR, H_DLQ_REASON, H_DLQ_SERVICE,
    H_DLQ_SOURCE_OFFSET, H_DLQ_SOURCE_PARTITION, H_DLQ_SOURCE_TOPIC, H_DLQ_TIME_MS,
)
from choreo.service import retry_topic
from choreo.state import MAX_ERROR_CHARS

REDRIVEN_TOPIC = "choreo.dlq.redriven"
REDRIVE_TXN_ID = "choreo-ops-redrive"
DLQ_SUFFIX = ".dlq"
MAX_TOPIC_CHARS = 249  # Kafka's longest topic name
REDRIVE_CHUNK_BYTES = 64 * 1024 * 1024  # the most of the records a redrive holds, and one transaction carries
REDRIVE_CHUNK_LETTERS = 20_000  # and the most letters: two messages each, within the producer's queue


@dataclass
class DeadLetter:
    dlq_topic: str
    partition: int
    offset: int
    time_ms: int
    reason: str
    error: str
    service: str
    source_topic: str
    source_partition: int
    source_offset: int
    delivery_id: str
    event_id: str
    attempt: int
    written_ms: int = 0  # the record's own timestamp (``time_ms`` is what its header says)
    redriven: bool = False
    problem: str = ""  # why its dlq.* headers cannot be trusted ("": written by the runtime)

    @property
    def position(self) -> str:
        return f"{self.dlq_topic}|{self.partition}|{self.offset}"

    @classmethod
    def of(cls, record: Rec, redriven: set[str]) -> DeadLetter:
        """The dead letter as the runtime wrote it: the last of each ``dlq.*`` header (the
        runtime appends its own after the record's), with ``problem`` set when they are not
        exactly the runtime's one consistent set."""
        env = record.envelope
        found: dict[str, list[str]] = {}
        for name, raw in record.headers:
            if name.startswith(DLQ_HEADER_PREFIX):
                found.setdefault(name, []).append(raw.decode(errors="replace"))
        dlq = {name: values[-1] for name, values in found.items()}
        # what a header says is kept cut: a letter's headers are anybody's who can write the
        # topic, and a listing, a redrive's result and the live view hold many letters
        letter = cls(
            dlq_topic=record.topic, partition=record.partition, offset=record.offset,
            time_ms=_integer(dlq.get(H_DLQ_TIME_MS), record.timestamp_ms),
            reason=dlq.get(H_DLQ_REASON, "")[:MAX_ID_CHARS], error=dlq.get(H_DLQ_ERROR, "")[:MAX_ERROR_CHARS],
            service=dlq.get(H_DLQ_SERVICE, "")[:MAX_ID_CHARS],
            source_topic=dlq.get(H_DLQ_SOURCE_TOPIC, record.topic.removesuffix(DLQ_SUFFIX))[:MAX_TOPIC_CHARS],
            source_partition=_integer(dlq.get(H_DLQ_SOURCE_PARTITION), -1),
            source_offset=_integer(dlq.get(H_DLQ_SOURCE_OFFSET), -1),
            delivery_id=env.correlation_id if env else record.key_text[:MAX_ID_CHARS],
            event_id=env.event_id if env else "", attempt=env.attempt if env else 0,
            written_ms=record.timestamp_ms,
        )
        letter.problem = _untrusted(letter, found)
        letter.redriven = letter.position in redriven
        return letter


def _integer(text: str | None, default: int) -> int:
    """A header's count or position, or ``default``: anything but up to 18 ASCII digits (an
    offset, a partition, epoch milliseconds; 5,000 digits stopped every reader of the
    letter, the rebuild among them)."""
    return int(text) if text is not None and text.isascii() and text.isdigit() and len(text) <= 18 else default


def _untrusted(letter: DeadLetter, found: dict[str, list[str]]) -> str:
    """Why the ``dlq.*`` headers of ``letter`` are not the runtime's one set for its DLQ
    topic ("" when they are)."""
    missing = [name for name in DLQ_HEADERS if name not in found]
    if missing:
        return f"dlq headers missing: {', '.join(missing)}"
    repeated = sorted(name for name, values in found.items() if len(values) > 1)
    if repeated:
        return f"dlq headers repeated: {', '.join(repeated)}"
    origin = letter.dlq_topic.removesuffix(DLQ_SUFFIX)
    if letter.source_topic not in (origin, retry_topic(letter.service, origin)):
        return f"dlq.source.topic is neither {origin} nor {letter.service}'s retry topic of it"
    if letter.source_partition < 0 or letter.source_offset < 0:
        return "dlq.source.partition / dlq.source.offset are not offsets"
    return ""


@dataclass
class Selection:
    """Which dead letters: every given criterion must hold."""

    topics: list[str] = field(default_factory=list)  # DLQ topics or their source topics
    reasons: list[str] = field(default_factory=list)
    delivery_ids: list[str] = field(default_factory=list)
    partition: int | None = None
    offsets: tuple[int, int] | None = None  # [first, last] in the DLQ topic, inclusive
    since_ms: int | None = None
    until_ms: int | None = None
    limit: int = 0

    def dlq_topics(self, present: Iterable[str]) -> list[str]:
        wanted = {t if t.endswith(DLQ_SUFFIX) else t + DLQ_SUFFIX for t in self.topics}
        return sorted(t for t in present if t.endswith(DLQ_SUFFIX) and (not wanted or t in wanted))

    def matches(self, letter: DeadLetter) -> bool:
        return ((not self.reasons or letter.reason in self.reasons)
                and (not self.delivery_ids or letter.delivery_id in self.delivery_ids))


def dead_letters(selection: Selection, progress: Progress | None = None) -> list[DeadLetter]:
    """The selected dead letters, oldest first per partition, without their records (a
    letter's value can be most of a megabyte: a listing keeps none)."""
    with closing(_selected(selection, progress)) as selected:
        return [letter for letter, _ in selected]


def _selected(selection: Selection, progress: Progress | None = None) -> Generator[tuple[DeadLetter, Rec], None, None]:
    """The selected dead letters, oldest first per partition, each with its record, as they
    are read."""
    redriven = redriven_positions()
    consumer = reader()
    try:
        present = existing_topics(consumer)
        spans = []
        for topic in selection.dlq_topics(present):
            partitions = [selection.partition] if selection.partition is not None else None
            if partitions is not None and not 0 <= partitions[0] < present[topic]:
                continue  # no such partition: no letter, where the broker would be asked for 10 s
            offsets = None
            if selection.offsets is not None:
                first, last = selection.offsets
                offsets = {p: (first, last + 1) for p in (partitions or range(present[topic]))}
            spans += resolve(consumer, topic, partitions, since_ms=selection.since_ms,
                             until_ms=selection.until_ms, offsets=offsets)
        found = 0
        for record in read(consumer, spans, progress):
            letter = DeadLetter.of(record, redriven)
            if selection.matches(letter):
                yield letter, record
                found += 1
                if selection.limit and found >= selection.limit:
                    return
    finally:
        consumer.close()


def summary(letters: Iterable[DeadLetter]) -> list[dict[str, Any]]:
    """Counts by DLQ topic and reason (with how many were redriven): the incident overview."""
    counts: dict[tuple[str, str], list[int]] = {}
    for letter in letters:
        entry = counts.setdefault((letter.dlq_topic, letter.reason), [0, 0])
        entry[0] += 1
        entry[1] += int(letter.redriven)
    return [{"topic": t, "reason": r, "count": c, "redriven": d} for (t, r), (c, d) in sorted(counts.items())]


def show(topic: str, partition: int, offset: int) -> dict[str, Any]:
    """One dead letter in full: headers, the decoded body when possible, the raw size."""
    selection = Selection(topics=[topic], partition=partition, offsets=(offset, offset))
    with closing(_selected(selection)) as selected:
        found = next(selected, None)
    if found is None:
        raise LookupError(f"no record at {topic}[{partition}]@{offset}")
    letter, record = found
    body = BodyDecoder()(letter.source_topic, record.value)
    return {
        "dead_letter": asdict(letter),
        "headers": {k: v.decode(errors="replace") for k, v in record.headers},
        "key": record.key_text,
        "value_bytes": len(record.value or b""),
        "body": body,
    }


def redriven_positions(timeout_s: float = 10.0) -> set[str]:
    """The DLQ positions already redriven (every marker ever committed)."""
    consumer = reader()
    try:
        if REDRIVEN_TOPIC not in existing_topics(consumer, timeout_s):
            return set()
        return {r.key_text for r in read(consumer, resolve(consumer, REDRIVEN_TOPIC)) if r.value is not None}
    finally:
        consumer.close()


@dataclass
class RedriveResult:
    redriven: list[DeadLetter]
    skipped: list[tuple[DeadLetter, str]]
    dry_run: bool


class RedriveStopped(Exception):
    """A redrive stopped by ``cause`` after ``done``'s transactions committed (what they
    redrove is redriven, and the next redrive skips it)."""

    def __init__(self, done: RedriveResult, cause: BaseException) -> None:
        super().__init__(f"the redrive stopped after {len(done.redriven)} redriven: "
                         f"{type(cause).__name__}: {str(cause)[:200]}")
        self.done = done


def _forget_seen(pipe: Any, letter: DeadLetter) -> None:
    """Make the dead-lettering service forget the DLQ'd position of this event, so the
    redriven copy is its first sighting."""
    pipe.hdel(seen_key(letter.delivery_id), seen_field(letter.service, letter.event_id, letter.attempt))


def redrive(selection: Selection, *, dry_run: bool = False, progress: Progress | None = None,
            on_each: Callable[[DeadLetter], None] | None = None) -> RedriveResult:
    """Send the selected dead letters back to their source topic, each at most once: in
    transactions of up to ``REDRIVE_CHUNK_BYTES`` of records (``REDRIVE_CHUNK_LETTERS``
    letters) each, as they are read."""
    ensure_topics({REDRIVEN_TOPIC: 1}, config={"cleanup.policy": "compact"})
    result = RedriveResult([], [], dry_run)
    sender = None if dry_run else _sender()  # before the markers are read
    chunk: list[tuple[DeadLetter, Rec]] = []
    held = 0
    events: set[str] = set()  # one letter per event: a second one's forget would undo the first's copy
    try:
        with closing(_selected(selection, progress)) as selected:
            for letter, record in selected:
                why = _not_redriven(letter, events)
                if why:
                    result.skipped.append((letter, why))
                elif sender is None:
                    result.redriven.append(letter)
                else:
                    chunk.append((letter, record))
                    held += _bytes_of(record)
                    if held >= REDRIVE_CHUNK_BYTES or len(chunk) >= REDRIVE_CHUNK_LETTERS:
                        _redrive_chunk(*sender, chunk, result, on_each)
                        chunk, held = [], 0
        if chunk and sender is not None:
            _redrive_chunk(*sender, chunk, result, on_each)
    except Exception as exc:
        if result.redriven and not dry_run:
            raise RedriveStopped(result, exc) from exc
        raise
    return result


def _sender() -> tuple[Producer, redis.Redis]:
    """The redrive's transactional producer, its transactions initialised (which fences a
    concurrent redrive, completing or aborting its transaction), and a Redis client."""
    producer = Producer({
        **base_config(),
        "transactional.id": REDRIVE_TXN_ID,
        "transaction.timeout.ms": 60000,
        "linger.ms": 5,
    })
    producer.init_transactions(30)
    return producer, connect(settings().redis_url, socket_timeout=5)


def _bytes_of(record: Rec) -> int:
    return len(record.key or b"") + len(record.value or b"") + sum(len(k) + len(v) for k, v in record.headers)


def _not_redriven(letter: DeadLetter, events: set[str]) -> str:
    """Why ``letter`` is not redriven, or ``""``; ``events``: the events (with their service
    and attempt) this redrive sends, to which ``letter``'s is added when it goes."""
    if letter.redriven:
        return "already redriven"
    if letter.problem:
        return f"untrusted: {letter.problem}"
    if not letter.event_id:
        return "no envelope: it would only be dead-lettered again"
    event = seen_field(letter.service, letter.event_id, letter.attempt)
    if event in events:
        return "another letter of the same event is redriven"
    events.add(event)
    return ""


def _redrive_chunk(producer: Producer, client: redis.Redis, chunk: list[tuple[DeadLetter, Rec]],
                   result: RedriveResult, on_each: Callable[[DeadLetter], None] | None) -> None:
    """One transaction: ``chunk``'s records back to their source topics, with their markers;
    counted in ``result`` once committed."""
    producer.begin_transaction()
    try:
        forget = client.pipeline(transaction=False)
        by = socket.gethostname()
        for letter, record in chunk:
            _forget_seen(forget, letter)
            headers: HeaderList = [(k, v) for k, v in record.headers if not k.startswith((DLQ_HEADER_PREFIX, "redrive."))]
            headers.append(("redrive.from", letter.position.encode()))
            producer.produce(letter.source_topic, key=record.key, value=record.value, headers=headers)
            marker = {"to": letter.source_topic, "at_ms": now_ms(), "by": by, "reason": letter.reason,
                      "event_id": letter.event_id, "delivery_id": letter.delivery_id}
            producer.produce(REDRIVEN_TOPIC, key=letter.position.encode(), value=json.dumps(marker).encode())
            producer.poll(0)
        forget.execute()  # before the commit: the copy must never be seen by a service that remembers the DLQ'd position
        producer.commit_transaction(60)
    except BaseException:
        producer.abort_transaction(30)
        raise
    for letter, _ in chunk:
        result.redriven.append(letter)
        if on_each is not None:
            on_each(letter)
