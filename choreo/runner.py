"""The consume → handle → produce loop, exactly once.

A batch is read with ``read_committed``; handlers run; every output, dead letter and
recovery report is produced and the input offsets are committed in **one** Kafka
transaction (a batch that writes no record commits its offsets plainly: nothing to make
atomic with them). A crash anywhere replays the batch; idempotent Redis effects and
deterministic output ids make the replay invisible to ``read_committed`` readers.

Retries: a handler's ``Retryable`` error is retried in process a few times with
exponential back-off and jitter, never past the step's deadline or its budget; then the
step is reported to the recovery topic and the batch moves on. The supervisor requeues it
through the step's retry topic with back-off, so one slow step never stalls the other
partitions' work (a paused partition would stall every delivery behind it instead).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from types import FrameType, GeneratorType
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.schema_registry.error import SchemaRegistryError
from redis.exceptions import RedisError

from choreo import metrics
from choreo.kafka import (TransactionalProducer, UnreadableHeaders, headers_if_readable, headers_of,
                          transactional_consumer_config, transactional_producer_config)
from choreo.config import settings
from choreo import dedupe
from choreo.envelope import MAX_ID_CHARS, Envelope, HeaderList, Unusable, pairs, derived_id, now_ms
from choreo.errors import AttemptDropped, DeadLetterReason, Rejected, Retryable
from choreo.events import Event, disagrees_with
from choreo.logs import get_logger
from choreo.memory import collect_batch_cycles, settle_garbage_collector
from choreo.redis_client import TRANSIENT, connect, is_cluster, refused_by_redis
from choreo.serde import (FRAME_BYTES, MAX_VALUE_BYTES, DecodeFailure, Decoder, Encoder, RegistryUnavailable,
                          Unwritable, avro_body, registry_client)
from choreo.answers import dropped_by
from choreo.effects import EffectCall, Op, run_all
from choreo import layout, tracing
from choreo.outcomes import REPLIES, ReplyTopics, outcome_of, told
from choreo.runtime_events import DeliveryOutcome
from choreo.service import Context, EffectfulHandler, Emitted, Handler, HandlerResult, Periodic, Service
from choreo.keys import in_slot_of
from choreo.state import Begin, Source, StateTable, StepStatus
from choreo.workflow import Workflow

# in-process tries of a replayed completed step before its batch is read again
REPLAY_TRIES = 5
BATCH_MAX_BYTES = 8 * MAX_VALUE_BYTES  # of a batch's keys and values: seconds to decode at worst
TRANSIENT_OR_REGISTRY: tuple[type[Exception], ...] = (*TRANSIENT, RegistryUnavailable)

RECOVERY_TOPIC = "recovery"
LAG_PERIOD_S = 10.0

# The headers a dead letter's origin is told by: the runtime alone writes them, and strips
# any an incoming record carried, so a dead letter holds exactly one set (choreo.ops.dlq
# trusts nothing else).
DLQ_HEADER_PREFIX = "dlq."
H_DLQ_REASON = "dlq.reason"
H_DLQ_ERROR = "dlq.error"
H_DLQ_SOURCE_TOPIC = "dlq.source.topic"
H_DLQ_SOURCE_PARTITION = "dlq.source.partition"
H_DLQ_SOURCE_OFFSET = "dlq.source.offset"
H_DLQ_SERVICE = "dlq.service"
H_DLQ_TIME_MS = "dlq.time_ms"
DLQ_HEADERS = (H_DLQ_REASON, H_DLQ_ERROR, H_DLQ_SOURCE_TOPIC, H_DLQ_SOURCE_PARTITION,
               H_DLQ_SOURCE_OFFSET, H_DLQ_SERVICE, H_DLQ_TIME_MS)
# The most of a record (key, value, headers) a dead letter copies: the producer refuses a
# message past its message.max.bytes (1,000,000 by default) at once, and a refused dead letter
# aborted its batch, which was read again, for ever. A compressed batch brings the consumer
# far larger records than that.
DEAD_LETTER_COPY_MAX_BYTES = 900_000
HEADER_OVERHEAD_BYTES = 10  # a header's length fields on the wire, besides its name and value


class BatchTransient(Exception):
    """Infrastructure is briefly unavailable (Redis, registry), or the replay of a completed
    step failed: abort and replay the batch."""


BATCH_ABORTS: tuple[type[Exception], ...] = (*TRANSIENT_OR_REGISTRY, BatchTransient, KafkaException)
REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, *TRANSIENT)  # a cluster's errors are not all RedisErrors
STARTUP_REDIS_WAIT_S = 60.0  # how long a starting instance waits for Redis before it gives up


@dataclass
class Work:
    """One decoded input on its way through the phases of a batch."""

    message: Message
    topic: str
    handler: Handler
    envelope: Envelope
    event: Event
    log: Any
    verdict: Begin | None = None
    ctx: Context | None = None
    span: Any = None  # its handler's span, when tracing is on (choreo.tracing)
    # its handler's first operation, run in its begin (``Handler.first_op_in_begin``), and the answer
    first: tuple[EffectCall, str | None] | None = None
    encoded: dict[int, bytes] = field(default_factory=dict)  # id(an output) -> its value, once encoded


@dataclass
class Refused:
    """An input that can never succeed (past the hop limit, undecodable, its body another
    delivery's or owner's than its envelope says): dead-lettered once the dedupe has seen it,
    so a copy of it is skipped as any copy is."""

    message: Message
    envelope: Envelope
    reason: DeadLetterReason
    detail: str


@dataclass
class Attempt:
    """One try of one handler: a plain call, or a generator resumed with effect answers."""

    work: Work
    ctx: Context = field(init=False)
    tries: int = 0  # failed tries so far
    request: EffectCall | None = None  # the effect it waits for
    decode: Callable[[str | None], Any] | None = None  # a typed operation's answer, from the effect's
    result: HandlerResult = None
    error: Retryable | Rejected | None = None
    delay_s: float = 0.0
    seconds: float = 0.0  # the handler's own time, not its wait for Redis
    dropped: str = ""  # why it was dropped, its effect not run: "released" or "stale" (choreo.effects)
    _gen: EffectfulHandler | None = None

    def start(self) -> None:
        self.request, self.result, self.error, self._gen, self.seconds = None, None, None, None, 0.0
        self.dropped, self.decode = "", None
        self._step(lambda: self.work.handler.fn(self.work.event, self.ctx), first=True)

    def _answer_at_once(self, gen: EffectfulHandler, out: Any) -> Any:
        """Operations answered without a round trip of their own; what the handler yields next
        comes back. A step's write whose answer says nothing is left to the finish, which
        applies it in its own script item only if it completes the step
        (``StateTable.complete_many``); one on a key outside the delivery's slot (a record of
        another delivery) could not share that item on a cluster, and runs as an effect. The
        operation that ran in the begin (``Work.first``: the same effect, keys and args, asked
        first) gets the answer the begin brought."""
        while True:
            if (isinstance(out, Op) and out.write is not None and self.work.handler.step is not None
                    and in_slot_of(out.write.key, self.ctx.delivery_id)):
                self.ctx.defer(out)
                out = gen.send(out.decode(None))
            elif self._rode_in_begin(out):
                assert self.work.first is not None
                answer = self.work.first[1]
                if why := dropped_by(answer):
                    gen.close()
                    raise AttemptDropped(self.ctx.delivery_id, why)
                if isinstance(out, Op):
                    self.ctx.effect(out.effect, out.keys, out.args)  # asked, as if sent
                    out = gen.send(out.decode(answer))
                else:
                    out = gen.send(answer)
            else:
                return out

    def _rode_in_begin(self, out: Any) -> bool:
        """Whether ``out`` is the operation that ran in the begin, asked first in this try."""
        if self.work.first is None:
            return False
        rode, asked = self.work.first[0], sum(self.ctx.asked.values())
        if isinstance(out, Op):
            return asked == 0 and (out.effect, out.keys, out.args) == (rode.effect, rode.keys, rode.args)
        # ctx.effect counted it; the attempt it is fenced by may have become the step's current
        # one in the begin (a fan-in half that joined)
        return isinstance(out, EffectCall) and asked == 1 and out.rider() == rode.rider()

    def resume(self, answer: str | None) -> None:
        assert self._gen is not None
        gen = self._gen
        if why := dropped_by(answer):
            gen.close()
            self.request, self.dropped = None, why
            return
        decode, self.decode = self.decode, None
        self._step(lambda: gen.send(decode(answer) if decode else answer))

    def _step(self, call: Callable[[], Any], first: bool = False) -> None:
        started = time.perf_counter()
        try:
            out = call()
            if first and isinstance(out, GeneratorType):
                self._gen = out
                out = out.send(None)
            if self._gen is not None:
                out = self._answer_at_once(self._gen, out)
            if self._gen is None:
                self.result = out
            elif isinstance(out, EffectCall):
                self.request = out
            elif isinstance(out, Op):
                self.request, self.decode = self.ctx.effect(out.effect, out.keys, out.args), out.decode
            else:  # a bug in the rule, not in the event: dead-letter it with the reason
                self.request, self.error = None, Rejected(
                    f"{self.work.handler.fn.__name__} yielded {type(out).__name__}; a handler yields "
                    "typed operations or ctx.effect(...) only (emit events with ctx.emit or return them)")
        except StopIteration as stop:
            if self._gen is None:  # a plain handler's own StopIteration is a bug, not a result
                self.request, self.error = None, self.bug(RuntimeError("it raised StopIteration"))
            else:
                self.request, self.result = None, stop.value
        except (Retryable, Rejected) as exc:
            self.request, self.error = None, exc
        except AttemptDropped as dropped:  # from ctx.once, or the answer that rode in the begin
            self.request, self.dropped = None, dropped.why
        except BATCH_ABORTS:
            raise  # the batch is aborted and read again
        except OSError as exc:  # a remote call of the rule's own that failed (a socket, a timeout): again
            self.request, self.error = None, Retryable(f"{type(exc).__name__}: {str(exc)[:300]}")
        except Exception as exc:  # noqa: BLE001 - neither a retry nor a refusal: a bug in the rule, or
            # an input it does not refuse. Raised out of the batch, it stopped the service at every
            # restart on the same record: its partition stood still
            if refused_by_redis(exc):  # about Redis, not the input: the batch is read again
                raise
            self.request, self.error = None, self.bug(exc)
        finally:
            self.seconds += time.perf_counter() - started

    def bug(self, exc: Exception, did: str = "raised") -> Rejected:
        """The refusal of an input whose handler raised ``exc``, or emitted what could not be
        written (``did``), which it carries as its cause (``choreo.testing.run`` raises it for
        the test to see)."""
        refusal = Rejected(f"{self.work.handler.fn.__name__} {did} {type(exc).__name__}: {str(exc)[:300]}",
                           DeadLetterReason.HANDLER_ERROR)
        refusal.__cause__ = exc
        return refusal


def oversized(emitted: Emitted, size: int) -> Rejected | None:
    """The refusal of an input whose output ``emitted`` encodes to ``size`` bytes, more than a
    consumer takes (``serde.MAX_VALUE_BYTES``)."""
    if size <= MAX_VALUE_BYTES:
        return None
    return Rejected(f"its {type(emitted.event).__name__} for {emitted.topic} would be {size} bytes, "
                    f"over the {MAX_VALUE_BYTES} a consumer takes", DeadLetterReason.OVERSIZED)


def read_input(decoder: Callable[[bytes | None], Event], value: bytes | None, envelope: Envelope,
               max_hops: int) -> Event:
    """The event a service reads from a record with a usable envelope, or ``DecodeFailure``
    saying why it dead-letters the record unread: past its hop limit, bytes its decoder
    refuses, a body that names another delivery or owner than its envelope
    (``events.disagrees_with``). ``rebuild-state`` asks the same, so that it restores nothing
    of a record no service read. ``RegistryUnavailable`` when the registry cannot say."""
    if envelope.hops > max_hops:
        raise DecodeFailure(DeadLetterReason.HOP_LIMIT, f"{envelope.hops} hops > limit {max_hops}")
    event = decoder(value)
    disagreement = disagrees_with(event, envelope)
    if disagreement:
        raise DecodeFailure(DeadLetterReason.INVALID_PAYLOAD, disagreement)
    return event


@dataclass
class RunnerOptions:
    instance: str = "0"
    poll_timeout_s: float = 0.05
    metrics_port: int = 0


def dlq_topic(topic: str) -> str:
    return f"{topic}.dlq"


class Runner:
    """Runs one instance of a service until SIGTERM/SIGINT or ``stop()``."""

    def __init__(self, service: Service, options: RunnerOptions | None = None,
                 workflow: Workflow | None = None) -> None:
        self.service = service
        self.options = options or RunnerOptions()
        self.cfg = settings()
        self.workflow = workflow
        self.log = get_logger(service=service.name, instance=self.options.instance)
        self.redis = connect(self.cfg.redis_url, socket_timeout=5)
        self.state = StateTable(self.redis)
        # the release waits for the workflow's services only, so only they refuse its deliveries
        self.in_workflow = workflow is not None and service.name in {s.name for s in workflow.services}
        self.registry = registry_client()
        self.decoders = {t: Decoder(h.model, t, self.registry) for t, h in service.handlers.items()}
        self.joinable = frozenset(s.name for s in service.steps() if len(s.triggers) > 1)
        self.encoders: dict[tuple[type[Event], str], Encoder[Any]] = {}
        self._dead_lettered: set[str] = set()  # deliveries of the batch's dead letters
        self.replies = ReplyTopics(self._topic_exists)
        self.running = False
        self._revocations = 0  # partitions taken from this member so far (``_next_batch``)
        self.consumer = Consumer(transactional_consumer_config(
            service.name, f"{service.name}-{self.options.instance}"))
        self.producer = self._new_producer()

    def _new_producer(self) -> TransactionalProducer:
        # stable per instance: a restarted instance fences its zombie predecessor
        producer = TransactionalProducer(
            transactional_producer_config(f"{self.service.name}-{self.options.instance}"))
        producer.init_transactions(30)
        return producer

    # -- lifecycle ---------------------------------------------------------------------

    def stop(self, *_: Any) -> None:
        self.running = False

    def _prepare_state(self) -> None:
        """Claim the state's layout and run the startup hooks (each idempotent). Redis briefly
        unreachable (a cluster's failover, a restart) is waited out for up to
        ``STARTUP_REDIS_WAIT_S``, as a batch waits it out: an instance restarted while a
        master fails over would otherwise die at its start."""
        deadline = time.monotonic() + STARTUP_REDIS_WAIT_S
        while True:
            try:
                layout.claim(self.redis)
                for hook in self.service.startup:
                    hook(self.redis)
                return
            except REDIS_ERRORS as exc:
                if not refused_by_redis(exc) or time.monotonic() >= deadline:
                    raise
                self.log.warning("startup.transient", error=f"redis: {exc}")
                time.sleep(0.5 + random.random())

    def run(self) -> None:
        metrics.serve(self.options.metrics_port)
        tracing.configure(self.service.name)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._prepare_state()
        settle_garbage_collector()
        self.consumer.subscribe(self.service.topics, on_revoke=self._count_revocation,
                                on_lost=self._count_revocation)
        self.running = True
        self.log.info("service.started", topics=self.service.topics, host=socket.gethostname(),
                      pid=os.getpid())
        next_tick = [time.monotonic() + p.period_s for p in self.service.periodic]
        next_lag = time.monotonic() + LAG_PERIOD_S
        try:
            while self.running:
                batch = self._next_batch()
                if batch:
                    self._process(batch)
                    collect_batch_cycles()
                if time.monotonic() >= next_lag:
                    self._measure_lag()
                    self._check_layout()
                    next_lag = time.monotonic() + LAG_PERIOD_S
                for i, periodic in enumerate(self.service.periodic):
                    if time.monotonic() >= next_tick[i]:
                        self._tick(periodic)
                        next_tick[i] = time.monotonic() + periodic.period_s
        finally:
            self.consumer.close()  # leaves the group: partitions move at once
            tracing.shutdown()
            self.log.info("service.stopped")

    def _measure_lag(self) -> None:
        """Consumer lag per assigned partition, for the metrics endpoint (watermarks are a
        broker round trip each, hence only every few seconds)."""
        try:
            for tp in self.consumer.position(self.consumer.assignment()):
                # cached: the high watermark every fetch response carries; a broker round trip per
                # partition here stalls the consume loop (48 partitions in the delivery service)
                _, high = self.consumer.get_watermark_offsets(tp, timeout=1, cached=True)
                if tp.offset >= 0:
                    metrics.LAG.labels(self.service.name, tp.topic, str(tp.partition)).set(
                        max(0, high - tp.offset))
        except KafkaException as exc:
            self.log.debug("lag.unavailable", error=str(exc))

    def _check_layout(self) -> None:
        """The store's layout again: after a FLUSHALL another version's process may have
        claimed it, and this one must stop writing rather than mix layouts."""
        try:
            layout.claim(self.redis)
        except TRANSIENT as exc:
            self.log.debug("layout.unchecked", error=str(exc))
        except layout.LayoutMismatch as exc:
            self.log.error("layout.mismatch", error=str(exc))
            raise SystemExit(f"{self.service.name}: {exc}") from exc

    def _count_revocation(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._revocations += 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.log.info("service.stopping", signal=signum)
        self.running = False

    def _next_batch(self) -> list[Message]:
        """The first record to come within the poll timeout, then what else arrives within
        ``CHOREO_BATCH_GATHER_MS``, up to a full batch. A backlog makes full batches at once;
        below capacity a record waits at most the gather time, where one batch consume would
        wait for a full batch or its whole timeout (bench/README.md, "The batch loop")."""
        messages = self.consumer.consume(1, self.options.poll_timeout_s)
        if messages and self.service.batch_size > 1:
            revocations = self._revocations
            clock = PhaseClock(self.service.name)  # an idle poll is no wait
            messages += self.consumer.consume(self.service.batch_size - 1, self.cfg.batch_gather_ms / 1000)
            clock.lap("consume")
            if self._revocations != revocations:
                # librdkafka drops a revoked partition's records within one consume call only:
                # the first record may belong to a partition another member now owns
                owned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
                messages = [m for m in messages if (m.topic(), m.partition()) in owned]
        good = []
        for m in messages:
            err = m.error()
            if err is None:
                good.append(m)
            elif err.code() != KafkaError._PARTITION_EOF:
                self.log.warning("consume.error", error=str(err))
        return self._within_budget(good)

    def _within_budget(self, messages: list[Message]) -> list[Message]:
        """The batch's first records up to ``BATCH_MAX_BYTES`` of keys and values (the first
        whatever its size); the rest is read again by the next batch. Decoding costs up to a
        microsecond a byte (an array of empty strings), so a batch of records each just under
        what a consumer takes would decode for minutes: past the poll interval, the member
        would leave its group and the batch be read again, by each member in turn, for ever."""
        size = 0
        for i, m in enumerate(messages):
            size += len(m.value() or b"") + len(m.key() or b"")
            if i and size > BATCH_MAX_BYTES:
                try:
                    self._rewind(messages[i:])
                except KafkaException as exc:  # not read again: the batch takes them all
                    self.log.warning("batch.uncut", error=str(exc))
                    return messages
                return messages[:i]
        return messages

    # -- one batch, one transaction -------------------------------------------------------

    def _process(self, batch: list[Message]) -> None:
        """One transaction for the batch (or a plain offset commit, ``_commit_plain``), with
        Redis work batched per phase: dedupe and begin (one round trip for the whole batch),
        handlers (their own effects), then finish for all and only then the outputs of the
        attempts that still own their step."""
        self._dead_lettered.clear()
        clock = PhaseClock(self.service.name)
        taken: list[Work | Refused] = []
        try:
            self.producer.begin_transaction()
            taken = [t for m in batch if (t := self._prepare(m, _envelope_of(m))) is not None]
            clock.lap("decode")
            work = self._begin_all(taken)
            clock.lap("begin")
            done = self._run_all(work)
            clock.lap("handlers")
            self._finish_all(done)
            self.state.note_dead_letters(self._dead_lettered)  # before the commit: one round trip
            clock.lap("finish")
            if self.producer.wrote:
                self.producer.send_offsets_to_transaction(
                    _next_offsets(batch), self.consumer.consumer_group_metadata(), 30
                )
                clock.lap("offsets")
                self._commit()
                metrics.child(metrics.OFFSET_COMMITS, self.service.name, "transaction").inc()
            else:
                clock.lap("offsets")  # none sent apart: the plain commit carries them
                if not self._commit_plain(batch):
                    return  # read again: not a batch done
            clock.lap("commit")
            metrics.BATCH_SIZE.labels(self.service.name).observe(len(batch))
        except REDIS_ERRORS as exc:
            if not refused_by_redis(exc):
                raise  # a script of the runtime's own failed on its arguments: a bug
            # unreachable, or refusing whatever the input (out of memory, an ACL): read it again
            self.log.warning("batch.transient", error=f"redis: {exc}")
            self._abort(batch)
            time.sleep(0.5 + random.random())
        except (BatchTransient, RegistryUnavailable) as exc:  # the latter from an output's encoding
            self.log.warning("batch.transient", error=str(exc))
            self._abort(batch)
            time.sleep(0.5 + random.random())
        except KafkaException as exc:
            self._stop_if_fatal(exc)
            err = exc.args[0]
            self.log.warning("transaction.abort", error=str(err),
                             retriable=err.retriable(), abortable=err.txn_requires_abort())
            self._abort(batch)
        finally:
            for t in taken:
                if isinstance(t, Work) and t.span is not None:
                    t.span.end()
        # after an abort the rewound batch is consumed again (maybe by another instance)

    def _commit(self, attempts: int = 5) -> None:
        """Commit; a retriable failure (e.g. a timeout: outcome unknown) is retried as
        librdkafka documents, since aborting a commit in progress only conflicts."""
        for attempt in range(1, attempts + 1):
            try:
                self.producer.commit_transaction(30)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if not err.retriable() or err.txn_requires_abort() or attempt == attempts:
                    raise
                self.log.warning("transaction.commit_retry", error=str(err), attempt=attempt)

    def _commit_plain(self, batch: list[Message]) -> bool:
        """A batch that wrote no record (a subscriber's, the supervisor's reading of an
        outcome) has nothing to commit atomically with its offsets: its Redis work is done,
        and a replay of it is harmless. Its empty transaction ends without a broker request
        (librdkafka sends no EndTxn for it), and its offsets go in one plain commit, which the
        group's generation fences (the transactional one also by the producer's epoch: a
        zombie commits only offsets of work it finished, harmless). The coordinator keeps the
        newer of the two kinds by their place in its log, so the previous batch's
        transactional offsets, materialised after this commit, do not overwrite it.

        librdkafka itself retries a commit that timed out or found no coordinator; what fails
        here is refused (the group rebalanced) or outlasted those retries, and the batch is
        read again. No transaction is open by then, so nothing is aborted. Returns whether
        the offsets were committed."""
        self.producer.commit_transaction(30)
        try:
            self.consumer.commit(offsets=_next_offsets(batch), asynchronous=False)
        except KafkaException as exc:
            self._stop_if_fatal(exc)
            err = exc.args[0]
            self.log.warning("offsets.commit_refused", error=str(err), code=err.name())
            metrics.child(metrics.OFFSET_COMMIT_REFUSALS, self.service.name).inc()
            self._rewind(batch)
            return False
        metrics.child(metrics.OFFSET_COMMITS, self.service.name, "plain").inc()
        return True

    def _tick(self, periodic: Periodic) -> None:
        """One run of a periodic task, its output in one transaction (no input offsets)."""
        tick = Envelope.first(derived_id(self.service.name, str(time.time_ns())), "",
                              "Tick", self.service.name)
        ctx = Context(self.service.name, tick, "", -1, -1, self.redis, self.log, periodic=True)
        try:
            self.producer.begin_transaction()
            periodic.fn(ctx)
            self._open_steps(ctx.emitted)
            for emitted in ctx.emitted:
                self._produce(emitted, tick)
            self._commit()
        except TRANSIENT_OR_REGISTRY as exc:
            self.log.warning("tick.transient", error=str(exc))
            self._abort([])
        except KafkaException as exc:
            self._stop_if_fatal(exc)
            self.log.warning("tick.abort", error=str(exc))
            self._abort([])
        else:
            for fn in ctx.committed or ():
                try:
                    fn()
                except Exception as exc:  # what it marks is safe to find unmarked (``after_commit``)
                    self.log.error("tick.after_commit_failed", error=str(exc)[:300])

    def _abort(self, batch: list[Message]) -> None:
        metrics.TXN_ABORTS.labels(self.service.name).inc()
        try:
            self.producer.abort_transaction(30)
        except KafkaException as exc:
            self._stop_if_fatal(exc)
        self._rewind(batch)

    def _stop_if_fatal(self, exc: KafkaException) -> None:
        """A fatal error (a producer fenced by a newer epoch, a consumer fenced by its group)
        ends the process: only a new instance can go on. The consumer's errors carry no fatal
        flag, only the code."""
        err = exc.args[0]
        if err.fatal() or err.code() == KafkaError._FATAL:
            self.log.error("kafka.fatal", error=str(err))
            raise SystemExit(f"{self.service.name}: fatal Kafka error: {err}") from exc

    def _rewind(self, batch: list[Message]) -> None:
        """Seek back to the batch's first offsets on the partitions still assigned here."""
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        for tp in _first_offsets(batch):
            if (tp.topic, tp.partition) in assigned:
                self.consumer.seek(tp)

    # -- one message -------------------------------------------------------------------

    def _prepare(self, message: Message, envelope: Envelope | Unusable) -> Work | Refused | None:
        """Decode and guard one message. One without a usable envelope is dead-lettered here
        (nothing names its event); one that can never succeed (``Refused``) is refused,
        dead-lettered after the dedupe."""
        topic = message.topic() or ""
        metrics.child(metrics.EVENTS_IN, self.service.name, topic).inc()
        if isinstance(envelope, Unusable):
            self._dead_letter(message, envelope.reason, envelope.detail)
            return None
        try:
            event = read_input(self.decoders[topic], message.value(), envelope, self.service.max_hops)
        except DecodeFailure as exc:
            return Refused(message, envelope, exc.reason, str(exc))
        except RegistryUnavailable as exc:
            raise BatchTransient(f"registry: {exc}") from exc
        log = self.log.bind(event_id=envelope.event_id, delivery_id=envelope.correlation_id,
                            trace_id=envelope.trace_id, topic=topic, attempt=envelope.attempt)
        span = tracing.start_child(f"handle {topic}", envelope.traceparent, tracing.SpanKind.CONSUMER, {
            "choreo.service": self.service.name, "messaging.destination.name": topic,
            "choreo.delivery_id": envelope.correlation_id, "messaging.message.id": envelope.event_id,
            "choreo.attempt": envelope.attempt}) if tracing.enabled() else None
        return Work(message, topic, self.service.handlers[topic], envelope, event, log, span=span)

    def _begin_all(self, taken: list[Work | Refused]) -> list[Work]:
        """Dedupe every input and begin the steps of those that run, in one round trip; the
        inputs to run come back (copies and events of released deliveries are skipped, the
        refused ones dead-lettered)."""
        run: list[Work] = []
        riders = [self._first_op(t) for t in taken]
        verdicts, answers = self._begin_verdicts(taken, riders)
        for t, (verdict, attempt), rider, answer in zip(taken, verdicts, riders, answers):
            topic = t.message.topic() or ""
            if verdict in (Begin.DUPLICATE, Begin.COPY, Begin.RELEASED):
                metrics.IGNORED.labels(self.service.name, topic, verdict.value).inc()
                if verdict is Begin.COPY and isinstance(t, Work):  # rare, and a sign of a producer's fault
                    t.log.info("step.copy_skipped", step=t.handler.step, why="another event began the step")
            elif isinstance(t, Refused):
                self._dead_letter(t.message, t.reason, t.detail)
            else:
                t.verdict = verdict
                # an answer the effect does not remember ("not now": none) is asked again
                if rider is not None and answer is not None and verdict in (Begin.GO, Begin.REPLAY):
                    t.first = (rider, answer)
                if attempt != t.envelope.attempt:  # it joined the step's current attempt: answer as that
                    t.envelope = replace(t.envelope, attempt=attempt)
                    t.log = t.log.bind(attempt=attempt, joined=True)
                run.append(t)
        return run

    def _begin_verdicts(self, taken: list[Work | Refused], riders: list[EffectCall | None]
                        ) -> tuple[list[tuple[Begin, int]], list[str | None]]:
        now = now_ms()
        return self.state.begin_riding(
            [self._begin_item(t, now) for t in taken], self.service.retry_budget, self.joinable,
            [dedupe.sighting(self.service.name, t.envelope.correlation_id, t.envelope.event_id,
                             self._dedupe_position(t.message)) for t in taken],
            self.cfg.dedupe_ttl_s, refuse_released=self.in_workflow,
            riders=[None if call is None else call.rider() for call in riders])

    def _first_op(self, t: Work | Refused) -> EffectCall | None:
        """The effect call of the handler's first operation, as its context will ask it, for a
        handler declared to do nothing before it (``first_op_in_begin``): found by starting
        the handler on a context of its own and closing it at its first ``yield``. It rides in
        the begin where its keys allow (on a cluster, only keys of the delivery's slot); a
        write left to the finish does not."""
        if isinstance(t, Refused) or not t.handler.first_op_in_begin:
            return None
        ctx = self._context(t)
        try:  # the handler is a generator function (Service.subscribe)
            started = cast(EffectfulHandler, t.handler.fn(t.event, ctx))
            out = started.send(None)
        except BATCH_ABORTS:
            raise
        except Exception:  # noqa: BLE001 - its own run meets it again (a retry, a refusal, a bug)
            return None
        started.close()
        if isinstance(out, Op) and out.write is None:
            out = ctx.effect(out.effect, out.keys, out.args)
        if not isinstance(out, EffectCall) or not (not is_cluster(self.redis) or out.local):
            return None
        return out

    @staticmethod
    def _begin_item(t: Work | Refused, now: int) -> tuple[str, str, int, int, int, str]:
        """An input's begin: of its step, or of none (deduplicated only)."""
        if isinstance(t, Refused) or t.handler.step is None:
            return t.envelope.correlation_id, "", t.envelope.attempt, now, 0, ""
        source = Source(t.handler.topic, t.topic, t.message.partition() or 0, t.message.offset() or 0)
        return (t.envelope.correlation_id, t.handler.step, t.envelope.attempt, now,
                int(t.handler.deadline_s * 1000), source.text())

    def _dedupe_position(self, message: Message) -> str:
        """Where a message lies, as the dedupe remembers it."""
        return f"{message.topic()}|{message.partition()}|{message.offset()}"

    def _run_all(self, work: list[Work]) -> list[Work]:
        """Run the batch's handlers; the ones whose outputs await ``finish`` are returned, in
        input order.

        Handlers that ``yield ctx.effect(...)`` run side by side: each round sends every
        pending effect to Redis in one round trip and resumes each handler with its answer.
        The events of one delivery still run one after the other, in input order (waves: the
        first event of every delivery, then the second...), as a reservation and a release of
        the same delivery must not interleave (an operation that rode in the begin ran before
        them all: ``first_op_in_begin`` is for operations no earlier event of the batch's
        deliveries writes under). A ``Retryable`` is retried in process (a fresh
        try of the whole handler) after one back-off for all of the wave's retries, within the
        step's deadline and budget; then the step is reported (or, outside a step, the event
        dead-lettered)."""
        order = {id(w): i for i, w in enumerate(work)}
        done: list[Work] = []
        for wave in _waves([w for w in work if self._admitted(w)]):
            runs = [Attempt(w) for w in wave]
            while runs:
                self._drive(runs)
                retry: list[Attempt] = []
                for run in runs:
                    if not run.dropped and run.error is None:
                        run.error = self._encode_outputs(run)
                    if run.dropped:
                        self._note_dropped(run.work, run.dropped)
                    elif run.error is None:
                        run.work.ctx = run.ctx
                        done.append(run.work)
                    elif self._retry(run):
                        retry.append(run)
                if retry:
                    delay = max(run.delay_s for run in retry)
                    for run in retry:
                        run.work.log.info("handler.retry", error=str(run.error)[:300], tries=run.tries,
                                          delay_s=round(delay, 3))
                    time.sleep(delay)
                runs = retry
        return sorted(done, key=lambda w: order[id(w)])

    def _encode_outputs(self, run: Attempt) -> Rejected | None:
        """Encode the try's outputs before its step completes: one the consumers would refuse
        as too large (or the producer outright), or one Avro cannot write, is the input's
        failure, refused while the step can still fail: found only at publishing, the step
        would be completed already, and each reading of the batch would fail again, for ever.
        A registry that cannot be asked now leaves the encoding to the publishing, which holds
        the batch until it answers; the checks are made on the Avro body all the same."""
        w, ctx = run.work, run.ctx
        for out in _as_events(run.result):
            ctx.emit(out)
        w.encoded = {}
        for emitted in ctx.emitted:
            try:
                value, size = self._encoding(emitted)
            except Unwritable as exc:
                return run.bug(exc, "emitted what Avro cannot write,")
            refusal = oversized(emitted, size)
            if refusal is not None:
                return refusal
            if value is not None:
                w.encoded[id(emitted)] = value
        return None

    def _encoding(self, emitted: Emitted) -> tuple[bytes | None, int]:
        """An output's bytes and their size; no bytes when the registry cannot be asked now,
        the size then the Avro body's with its framing (all the bytes but the schema id's)."""
        try:
            value = self.encoder(type(emitted.event), emitted.topic)(emitted.event)
        except RegistryUnavailable:
            return None, FRAME_BYTES + len(avro_body(type(emitted.event), emitted.event.to_avro()))
        return value, len(value)

    def _context(self, w: Work, try_no: int = 1) -> Context:
        """A handler's context for one try of ``w``: its effects fenced by the step it runs
        (``Handler.fenced_by``), a workflow service's refusing a released delivery."""
        return Context(self.service.name, w.envelope, w.topic, w.message.partition() or 0,
                       w.message.offset() or 0, self.redis, w.log, try_no=try_no,
                       step=w.handler.fenced_by, refuse_released=self.in_workflow)

    def _note_dropped(self, w: Work, why: str) -> None:
        """An attempt dropped because an effect was refused (``choreo.effects``): its outputs go."""
        metrics.IGNORED.labels(self.service.name, w.topic, why).inc()
        w.log.info("step.dropped_meanwhile", step=w.handler.step, why=why)

    def _admitted(self, w: Work) -> bool:
        """Whether the step's state lets this attempt run (stale, closed, expired or exhausted
        attempts are ignored or reported instead)."""
        if w.handler.step is None or w.verdict not in (Begin.STALE, Begin.CLOSED, Begin.EXPIRED,
                                                        Begin.EXHAUSTED):
            return True
        assert w.verdict is not None
        if w.verdict in (Begin.STALE, Begin.CLOSED):
            metrics.IGNORED.labels(self.service.name, w.topic, w.verdict.value).inc()
            w.log.info("step.ignored", step=w.handler.step, why=w.verdict.value)
        else:
            kind = "DEADLINE_MISSED" if w.verdict is Begin.EXPIRED else "RETRIES_EXHAUSTED"
            self._report(w.message, w.envelope, w.handler.step, kind, str(w.verdict), w.log)
        return False

    def _drive(self, runs: list[Attempt]) -> None:
        """One try of every handler, their effects batched per round of ``yield``."""
        for run in runs:
            w = run.work
            run.ctx = self._context(w, try_no=run.tries + 1)
            run.start()
        waiting = [run for run in runs if run.request is not None]
        while waiting:
            answers = run_all(self.redis, [run.request for run in waiting if run.request is not None])
            metrics.EFFECTS_PER_ROUND_TRIP.labels(self.service.name).observe(len(answers))
            for run, answer in zip(waiting, answers):
                run.resume(answer)
            waiting = [run for run in waiting if run.request is not None]
        for run in runs:
            metrics.child(metrics.HANDLER_SECONDS, self.service.name, run.work.topic).observe(run.seconds)

    def _retry(self, run: Attempt) -> bool:
        """After a failed try: True to try again in this batch, else the failure is settled."""
        w, error = run.work, run.error
        step, envelope, message = w.handler.step, w.envelope, w.message
        # a completed step's replay that raises is tried again, then the batch: dead-lettered,
        # its input would be committed without the outputs the step's completion owes
        replayed_bug = w.verdict is Begin.REPLAY and getattr(error, "reason", None) is DeadLetterReason.HANDLER_ERROR
        if isinstance(error, Rejected) and not replayed_bug:
            if w.verdict is Begin.REPLAY:  # completed before, its outputs now never published
                w.log.error("step.completed_outputs_refused", step=step, error=str(error)[:300])
            if step is not None:
                self.state.finish(envelope.correlation_id, step, envelope.attempt, now_ms(),
                                  StepStatus.FAILED, str(error))
            self._dead_letter(message, error.reason, str(error))
            return False
        run.tries += 1
        metrics.RETRIES.labels(self.service.name, w.topic).inc()
        run.delay_s = min(2.0, 0.05 * 2 ** run.tries) * (0.5 + random.random() / 2)
        if w.verdict is Begin.REPLAY:
            # the step completed in a batch that never committed: this replay is the only way
            # its outputs get published, so the input must not be consumed without them (a
            # report would not help: the supervisor leaves a completed step alone). Its tries
            # spend no budget: the step succeeded once, within its budget, and each reading of
            # the batch tries it afresh (a budget spent by earlier readings would stop the
            # partition for good on a handler that fails its first try)
            if run.tries <= REPLAY_TRIES:
                return True
            raise BatchTransient(f"replay of the completed step {step} failed: {str(error)[:200]}")
        in_time = step is None or self._before_deadline(envelope, run.delay_s)
        budget_left = step is None or self.state.try_again(
            envelope.correlation_id, step, envelope.attempt) <= self.service.retry_budget
        if run.tries <= self.service.in_process_retries and in_time and budget_left:
            return True
        if step is None:
            self._dead_letter(message, DeadLetterReason.REJECTED, f"retries exhausted: {error}")
            return False
        self.state.finish(envelope.correlation_id, step, envelope.attempt, now_ms(),
                          StepStatus.FAILED, str(error))
        self._report(message, envelope, step, "FAILED", str(error), w.log)
        return False

    def _finish_all(self, done: list[Work]) -> None:
        """Decide first, publish after: an attempt the supervisor gave away meanwhile, or a
        step closed under it, is a late answer: recorded, and its outputs dropped, so a late
        DeliveryShipped can never join the supervisor's DeliveryFailed."""
        closing = [w for w in done if w.handler.step is not None and w.ctx is not None
                   and not w.ctx.keep_step_open]
        now = now_ms()
        # the steps each attempt's outputs start: opened by its own finish when they are of
        # its delivery (one script item, only if the outputs are published), else apart
        opens = {id(w): self._pending_steps(w.ctx.emitted if w.ctx else [], now) for w in done}
        closes = {id(w) for w in closing}
        # a step kept open has no finish to carry its writes: they run as effects of their own,
        # and one refused (its step given away or closed, its delivery released) drops the
        # attempt's outputs, as a late answer's are
        left = [(w, w.ctx.effect(op.effect, op.keys, op.args)) for w in done
                if id(w) not in closes and w.ctx is not None for op in w.ctx.writes]
        answers = run_all(self.redis, [call for _, call in left]) if left else []
        refused = {id(w): why for (w, _), answer in zip(left, answers) if (why := dropped_by(answer))}
        own = [[(step, by, attempt) for d, step, by, attempt in opens[id(w)] if d == w.envelope.correlation_id]
               for w in closing]
        elsewhere = {id(w): [o for o in opens[id(w)] if o[0] != w.envelope.correlation_id] for w in closing}
        verdicts = dict(zip(map(id, closing), self.state.complete_many(
            [(w.envelope.correlation_id, w.handler.step or "", w.envelope.attempt) for w in closing],
            now, own, [o for w in done if id(w) not in closes and id(w) not in refused for o in opens[id(w)]],
            [[op.write for op in w.ctx.writes if op.write is not None] if w.ctx else [] for w in closing])))
        publish: list[tuple[Emitted, Envelope, Any, bytes | None]] = []
        late_opens: list[tuple[str, str, int, int]] = []
        for w in done:
            finished = verdicts.get(id(w), "ok")
            if finished in ("stale", "ignored"):
                metrics.IGNORED.labels(self.service.name, w.topic, "late").inc()
                w.log.info("step.late_answer_dropped", step=w.handler.step, why=finished)
                continue
            if id(w) in refused:
                self._note_dropped(w, refused[id(w)])
                continue
            late_opens += elsewhere.get(id(w), [])
            publish += [(emitted, w.envelope, w.span, w.encoded.get(id(emitted)))
                        for emitted in (w.ctx.emitted if w.ctx else ())]
        if late_opens:
            self.state.open_many(late_opens, now)
        for emitted, cause, span, value in publish:
            self._produce(emitted, cause, span, value)

    def _before_deadline(self, envelope: Envelope, delay_s: float) -> bool:
        return envelope.deadline_ms == 0 or now_ms() + delay_s * 1000 < envelope.deadline_ms

    # -- output ------------------------------------------------------------------------

    def encoder(self, model: type[Event], topic: str) -> Encoder[Any]:
        key = (model, topic)
        if key not in self.encoders:
            self.encoders[key] = Encoder(model, topic, self.registry)
        return self.encoders[key]

    def _pending_steps(self, outputs: list[Emitted], now: int) -> list[tuple[str, str, int, int]]:
        """The steps the outputs trigger, to open before they are produced."""
        if self.workflow is None:
            return []
        return self.workflow.pending_steps([(emitted.event.key, emitted.topic) for emitted in outputs], now)

    def _open_steps(self, outputs: list[Emitted]) -> None:
        """Register the steps the outputs trigger, before they are produced (one round trip)."""
        now = now_ms()
        pending = self._pending_steps(outputs, now)
        if pending:
            self.state.open_many(pending, now)

    def _produce(self, emitted: Emitted, cause: Envelope, handling: Any = None, value: bytes | None = None) -> None:
        """Produce in the open transaction (the steps it triggers were opened before: by its
        attempt's finish, or ``_open_steps``); traced, its span (under ``handling``, the
        handler's) is the output's parent. ``value``: the event already encoded."""
        # an output starts its own steps at attempt 1: inheriting the input's attempt (say 2,
        # after a requeue) would make the other half of a fan-in look stale downstream
        envelope = (emitted.cause or cause).child(
            emitted.event_id, type(emitted.event).__name__, self.service.name,
            attempt=emitted.attempt if emitted.attempt is not None else 1)
        if value is None:
            value = self.encoder(type(emitted.event), emitted.topic)(emitted.event)
        span = tracing.start_child(f"produce {emitted.topic}", handling or (emitted.cause or cause).traceparent,
                                   tracing.SpanKind.PRODUCER, {
                                       "choreo.service": self.service.name,
                                       "messaging.destination.name": emitted.topic,
                                       "messaging.message.id": emitted.event_id,
                                       "choreo.delivery_id": envelope.correlation_id,
                                   }) if tracing.enabled() else None
        if span is not None:
            envelope = replace(envelope, traceparent=tracing.traceparent(span))
        with tracing.spanning(span):
            self.producer.produce(emitted.topic, key=emitted.event.key.encode(), value=value,
                                  headers=envelope.to_headers())
        self.producer.poll(0)
        metrics.child(metrics.EVENTS_OUT, self.service.name, emitted.topic).inc()
        label = told(emitted.event, self.workflow)  # an event that decides what its submitter is told
        if label is not None and envelope.reply_to:
            self._reply(outcome_of(emitted.event, label, envelope), envelope)

    def _reply(self, outcome: DeliveryOutcome, decided: Envelope) -> None:
        """Copy the outcome to the reply topic the delivery's envelope names, in the open
        transaction; a topic the policy refuses is logged and skipped (``choreo.outcomes``)."""
        topic = decided.reply_to
        why = self.replies.refusal(topic)
        if why is not None:
            REPLIES.labels(self.service.name, "refused").inc()
            self.log.warning("reply.refused", delivery_id=outcome.delivery_id, topic=topic[:80], why=why)
            return
        try:
            value = self.encoder(DeliveryOutcome, topic)(outcome)
        except SchemaRegistryError as exc:
            if exc.http_status_code >= 500 or exc.http_status_code < 0:
                raise BatchTransient(f"registry: {exc}") from exc
            # e.g. auto-registration off and no DeliveryOutcome under the topic's subject
            REPLIES.labels(self.service.name, "refused").inc()
            self.log.warning("reply.refused", delivery_id=outcome.delivery_id, topic=topic[:80],
                             why=f"the registry refused its subject: {exc.http_status_code}")
            return
        except (OSError, ConnectionError) as exc:
            raise BatchTransient(f"registry: {exc}") from exc
        envelope = decided.child(derived_id(decided.event_id, "reply"), DeliveryOutcome.__name__,
                                 self.service.name)
        self.producer.produce(topic, key=outcome.key.encode(), value=value, headers=envelope.to_headers())
        REPLIES.labels(self.service.name, "written").inc()

    def _topic_exists(self, topic: str) -> bool:
        """Whether ``topic`` exists and this service may see it (a bounded broker round trip)."""
        try:
            found = self.producer.list_topics(topic, timeout=2).topics.get(topic)
        except KafkaException as exc:
            self.log.warning("reply.topic_unknown", topic=topic[:80], error=str(exc)[:200])
            return False
        return found is not None and found.error is None

    def _dead_letter(self, message: Message, reason: DeadLetterReason, error: str) -> None:
        topic = message.topic() or ""
        # an incoming dlq.* header is a forgery (or a stale copy): only ours tell the origin
        headers: HeaderList = [(k, v) for k, v in pairs(headers_if_readable(message))
                               if not k.startswith(DLQ_HEADER_PREFIX)]
        key, value = message.key(), message.value()
        size = _size(key) + _size(value) + sum(HEADER_OVERHEAD_BYTES + _size(k) + _size(v) for k, v in headers)
        if size <= DEAD_LETTER_COPY_MAX_BYTES:
            try:
                self._send_letter(message, reason, error, key, value, headers)
                return
            except KafkaException as exc:  # the producer's own count of the message, past its limit
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
        # a letter without the record (but a key of an id's length): no redrive sends it again
        # (no envelope), and the record stays where the letter says while its topic retains it
        self._send_letter(message, reason, f"the record's {size} bytes are not copied (over "
                          f"{DEAD_LETTER_COPY_MAX_BYTES}): it is at {topic}|{message.partition()}|"
                          f"{message.offset()}; {error}", key if key is None or len(key) <= MAX_ID_CHARS else None,
                          None, [])

    def _send_letter(self, message: Message, reason: DeadLetterReason, error: str, key: bytes | None,
                     value: bytes | None, headers: HeaderList) -> None:
        topic = message.topic() or ""
        headers = [*headers,
                   (H_DLQ_REASON, reason.value.encode()),
                   (H_DLQ_ERROR, error[:1000].encode()),
                   (H_DLQ_SOURCE_TOPIC, topic.encode()),
                   (H_DLQ_SOURCE_PARTITION, str(message.partition()).encode()),
                   (H_DLQ_SOURCE_OFFSET, str(message.offset()).encode()),
                   (H_DLQ_SERVICE, self.service.name.encode()),
                   (H_DLQ_TIME_MS, str(now_ms()).encode())]
        # retry topics share their origin's dead-letter topic: one place to look per event type
        origin = self.service.handlers[topic].topic if topic in self.service.handlers else topic
        self.producer.produce(dlq_topic(origin), key=key, value=value, headers=headers)
        # the delivery whose state waits for a redrive: the one the letter's own envelope names,
        # as the redrive sends it again and rebuild-state reads it (not the incoming record's,
        # which a malformed dlq.* header alone, dropped above, made unusable)
        envelope = Envelope.from_headers(headers)
        if envelope is not None:
            self._dead_lettered.add(envelope.correlation_id)
        metrics.DEAD_LETTERS.labels(self.service.name, topic, reason.value).inc()
        self.log.warning("event.dead_lettered", topic=topic, partition=message.partition(),
                         offset=message.offset(), reason=reason.value, error=error[:300])

    def _report(self, message: Message, envelope: Envelope, step: str, kind: str,
                error: str, log: Any) -> None:
        from choreo.runtime_events import StepReport

        report = StepReport(
            delivery_id=envelope.correlation_id, step=step, kind=kind,
            attempt=envelope.attempt, service=self.service.name,
            source_topic=message.topic() or "", source_event_id=envelope.event_id,
            error=error[:500], reported_at=datetime.now(UTC),
        )
        event_id = derived_id(envelope.event_id, self.service.name, RECOVERY_TOPIC, kind,
                              str(envelope.attempt))
        self._produce(Emitted(report, RECOVERY_TOPIC, event_id, attempt=envelope.attempt), envelope)
        metrics.REPORTS.labels(self.service.name, kind).inc()
        log.warning("step.reported", step=step, kind=kind, error=error[:300])


class PhaseClock:
    """Times the phases of one batch into ``choreo_batch_phase_seconds`` and the loop's CPU
    time into ``choreo_batch_phase_cpu_seconds``: each ``lap`` is the time since the
    previous one."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()

    def lap(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        metrics.child(metrics.BATCH_PHASE_SECONDS, self.service, phase).observe(now - self.last)
        metrics.child(metrics.BATCH_PHASE_CPU_SECONDS, self.service, phase).inc(cpu - self.last_cpu)
        self.last, self.last_cpu = now, cpu


def _size(part: bytes | str | None) -> int:
    """What a key, value or header part takes on the wire (a text as UTF-8)."""
    if isinstance(part, str):
        return len(part.encode(errors="surrogatepass"))
    return len(part or b"")


def _as_events(result: Event | Iterable[Event] | None) -> list[Event]:
    if result is None:
        return []
    if isinstance(result, Event):
        return [result]
    return list(result)


def _waves(work: list[Work]) -> list[list[Work]]:
    """The k-th input of every delivery in wave k (input order kept within a delivery)."""
    waves: list[list[Work]] = []
    seen: dict[str, int] = {}
    for w in work:
        k = seen.get(w.envelope.correlation_id, 0)
        seen[w.envelope.correlation_id] = k + 1
        if k == len(waves):
            waves.append([])
        waves[k].append(w)
    return waves


def _envelope_of(message: Message) -> Envelope | Unusable:
    try:
        return Envelope.parse(headers_of(message))
    except UnreadableHeaders as exc:
        return Unusable(DeadLetterReason.MISSING_HEADERS, str(exc))


def _next_offsets(batch: list[Message]) -> list[TopicPartition]:
    last: dict[tuple[str, int], int] = {}
    for m in batch:
        key = (m.topic() or "", m.partition() or 0)
        last[key] = max(last.get(key, -1), m.offset() or 0)
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


def _first_offsets(batch: list[Message]) -> list[TopicPartition]:
    first: dict[tuple[str, int], int] = {}
    for m in batch:
        key = (m.topic() or "", m.partition() or 0)
        first[key] = min(first.get(key, m.offset() or 0), m.offset() or 0)
    return [TopicPartition(t, p, o) for (t, p), o in first.items()]
