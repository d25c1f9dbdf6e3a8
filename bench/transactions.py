"""What one exactly-once hop costs in broker round trips, by the time since the last commit.

    .venv/bin/python -m bench.transactions --gaps 0,20,50 --transactions 60 --repeats 3 \\
        --out bench/results/transactions.json

Below saturation a delivery's latency is mostly its transactional hops, and a batch's
``offsets`` and ``commit`` phases (``choreo_batch_phase_seconds``) are where a hop waits on
the broker. Their cost depends on how soon a transaction follows the previous commit: until
the broker has written the previous transaction's markers it refuses ``AddPartitionsToTxn``
and ``AddOffsetsToTxn`` with ``CONCURRENT_TRANSACTIONS``, and librdkafka retries after
``retry.backoff.ms``. So a consume loop that takes its next batch sooner (a shorter linger)
moves its wait into the transaction rather than removing it (bench/README.md).

Starts a private stack (as ``bench.pipeline``). Per gap and repeat, in turns:

- **transactional**: the runtime's producer (``choreo.kafka.transactional_producer_config``):
  ``begin``, ``--records`` records of ``--bytes`` over ``--partitions`` partitions,
  ``send_offsets_to_transaction``, ``commit``, then sleep the gap;
- **plain** (the baseline): the same records through the pipeline's idempotent producer,
  ``flush``, and a synchronous offset commit by a consumer: an at-least-once hop.

A third, untimed pass per gap runs the transactional loop with ``debug=eos`` and counts the
``CONCURRENT_TRANSACTIONS`` refusals librdkafka logs (logging every protocol step would skew
the timings). Every record is checked to have been written. Reported per gap: median and
p90 milliseconds of each phase, refusals per transaction, and ``ratio`` = plain hop ÷
transactional hop (medians). Figures go to the JSON file (its path is printed); the last
line printed is the summary.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from bench.common import load_average, percentile, run_and_write, run_header, spread
from bench.pipeline import Private, add_private_stack_options, log
from choreo.config import settings
from choreo.kafka import base_config, ensure_topics, pipeline_producer_config, transactional_producer_config

REFUSAL = "CONCURRENT_TRANSACTIONS"


class RefusalCounter(logging.Handler):
    """Counts librdkafka's ``CONCURRENT_TRANSACTIONS`` log lines (with ``debug=eos``)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0

    def emit(self, record: logging.LogRecord) -> None:
        if REFUSAL in record.getMessage():
            self.refusals += 1


def elapsed_ms(started: float) -> float:
    return 1000 * (time.perf_counter() - started)


def timed(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return elapsed_ms(started)


class Hop:
    """One producer and one group on their own topics: the transactional hop or the plain one."""

    def __init__(self, transactional: bool, partitions: int, records: int, size: int,
                 debug_logger: logging.Logger | None = None) -> None:
        tag = uuid.uuid4().hex[:10]
        self.out_topic, self.in_topic = f"bench.txn.out.{tag}", f"bench.txn.in.{tag}"
        ensure_topics([self.out_topic, self.in_topic], partitions=partitions)
        self.transactional = transactional
        self.partitions = partitions
        self.records = records
        self.value = b"x" * size
        self.queued = 0  # records handed to the producer; each must be reported written
        self.failed = 0
        self.written = 0
        if transactional:
            config = transactional_producer_config(f"bench-txn-{tag}")
            if debug_logger is not None:
                config["debug"] = "eos"
            self.producer = Producer(config, logger=debug_logger) if debug_logger else Producer(config)
            self.producer.init_transactions(30)
        else:
            self.producer = Producer(pipeline_producer_config())
        self.consumer = Consumer({**base_config(), "group.id": f"bench-txn-{tag}",
                                  "enable.auto.commit": False})

    def _delivered(self, err: KafkaError | None, _msg: Message) -> None:
        if err is None:
            self.written += 1
        else:
            self.failed += 1

    def once(self, i: int) -> dict[str, float]:
        """One hop's phases in ms: ``produce`` (queueing the records), ``offsets`` and
        ``commit`` (for the plain hop: its synchronous offset commit and its flush)."""
        offsets = [TopicPartition(self.in_topic, i % self.partitions, i + 1)]
        started = time.perf_counter()
        if self.transactional:
            self.producer.begin_transaction()
        for k in range(self.records):
            self.producer.produce(self.out_topic, value=self.value, partition=k % self.partitions,
                                  on_delivery=self._delivered)
        self.producer.poll(0)
        self.queued += self.records
        produce_ms = elapsed_ms(started)
        if self.transactional:
            offsets_ms = timed(lambda: self.producer.send_offsets_to_transaction(
                offsets, self.consumer.consumer_group_metadata(), 30))
            commit_ms = timed(lambda: self.producer.commit_transaction(30))
        else:
            commit_ms = timed(lambda: self.producer.flush(30))
            offsets_ms = timed(lambda: self.consumer.commit(offsets=offsets, asynchronous=False))
        return {"produce": produce_ms, "offsets": offsets_ms, "commit": commit_ms,
                "hop": elapsed_ms(started)}

    def close(self) -> None:
        self.producer.flush(30)
        self.consumer.close()


def phase_figures(rows: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and p90 milliseconds of each phase over a run's hops."""
    return {phase: {"p50_ms": round(percentile([r[phase] for r in rows], 50), 2),
                    "p90_ms": round(percentile([r[phase] for r in rows], 90), 2)}
            for phase in rows[0]}


def run_hops(hop: Hop, transactions: int, gap_s: float, warm: int = 3) -> list[dict[str, float]]:
    """``warm`` untimed hops (connections, coordinators), then ``transactions`` timed ones."""
    rows = []
    for i in range(warm + transactions):
        row = hop.once(i)
        if i >= warm:
            rows.append(row)
        time.sleep(gap_s)
    return rows


def measure(args: argparse.Namespace, gap_s: float, transactional: bool) -> dict[str, Any]:
    hop = Hop(transactional, args.partitions, args.records, args.bytes)
    try:
        rows = run_hops(hop, args.transactions, gap_s)
    finally:
        hop.close()
    return {"phases": phase_figures(rows), "records_written": hop.written,
            "records_failed": hop.failed, "records_expected": hop.queued}


def count_refusals(args: argparse.Namespace, gap_s: float) -> float:
    """``CONCURRENT_TRANSACTIONS`` refusals per transaction, in an untimed ``debug=eos`` pass."""
    counter = RefusalCounter()
    logger = logging.getLogger(f"bench.transactions.eos.{gap_s}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(counter)
    hop = Hop(True, args.partitions, args.records, args.bytes, debug_logger=logger)
    try:
        run_hops(hop, args.transactions, gap_s, warm=0)
        hop.producer.poll(0.5)  # the log queue is served by poll
    finally:
        hop.close()
    transactions: int = args.transactions
    return round(counter.refusals / transactions, 2)


def median_over_runs(runs: Sequence[dict[str, Any]], kind: str, phase: str) -> dict[str, float]:
    """The median (and range) over repeats of a phase's per-run median."""
    return spread(run[kind]["phases"][phase]["p50_ms"] for run in runs).as_dict(2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    private = Private.at(args.stack_dir)
    private.activate()
    result: dict[str, Any] = {
        **run_header("bench.transactions"),
        "config": {"gaps_ms": [round(1000 * g) for g in args.gaps], "transactions": args.transactions,
                   "repeats": args.repeats, "records": args.records, "bytes": args.bytes,
                   "partitions": args.partitions,
                   "retry_backoff_ms": settings().kafka_txn_retry_backoff_ms},
        "gaps": {},
    }
    try:
        private.start(args.partitions)
        for gap_s in args.gaps:
            runs = []
            for r in range(args.repeats):
                order = (True, False) if r % 2 == 0 else (False, True)  # which goes first alternates
                measured = {t: measure(args, gap_s, t) for t in order}
                runs.append({"transactional": measured[True], "plain": measured[False]})
            refusals = count_refusals(args, gap_s)
            gap_ms = str(round(1000 * gap_s))
            result["gaps"][gap_ms] = {
                "runs": runs,
                "refusals_per_transaction": refusals,
                **{f"{kind}_{phase}_p50_ms": median_over_runs(runs, kind, phase)
                   for kind in ("transactional", "plain") for phase in ("offsets", "commit", "hop")},
            }
            figures = result["gaps"][gap_ms]
            log(f"gap {gap_ms} ms: transaction {figures['transactional_hop_p50_ms']['median']} ms "
                f"(offsets {figures['transactional_offsets_p50_ms']['median']}, commit "
                f"{figures['transactional_commit_p50_ms']['median']}), plain "
                f"{figures['plain_hop_p50_ms']['median']} ms, {refusals} refusals per transaction")
    finally:
        private.stop(keep=args.keep_stack)
    result["machine"]["load_average_after"] = load_average()
    result["summary"] = summarise(result)
    return result


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    by_gap = {}
    for gap_ms, figures in result["gaps"].items():
        txn = figures["transactional_hop_p50_ms"]["median"]
        plain = figures["plain_hop_p50_ms"]["median"]
        by_gap[gap_ms] = {"transactional_hop_ms": txn, "plain_hop_ms": plain,
                          "offsets_ms": figures["transactional_offsets_p50_ms"]["median"],
                          "commit_ms": figures["transactional_commit_p50_ms"]["median"],
                          "refusals_per_transaction": figures["refusals_per_transaction"],
                          "ratio": round(plain / txn, 3) if txn else 0.0}
    lost = sum(run[kind]["records_expected"] - run[kind]["records_written"]
               for figures in result["gaps"].values() for run in figures["runs"]
               for kind in ("transactional", "plain"))
    return {"by_gap_ms": by_gap, "records_not_written": lost}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.transactions",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", type=lambda s: [float(g) / 1000 for g in s.split(",")],
                        default=[0.0, 0.02, 0.05], help="ms between a commit and the next begin (0,20,50)")
    parser.add_argument("--transactions", type=int, default=60, help="timed hops per run (60)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--records", type=int, default=20, help="records per transaction (20)")
    parser.add_argument("--bytes", type=int, default=380, help="bytes per record, as the pipeline's (380)")
    parser.add_argument("--partitions", type=int, default=6)
    add_private_stack_options(parser, "transactions.json")
    args = parser.parse_args(argv)
    if args.transactions < 1 or args.repeats < 1 or args.records < 1 or args.partitions < 1:
        parser.error("--transactions, --repeats, --records and --partitions must be at least 1")
    if any(g < 0 for g in args.gaps):
        parser.error("--gaps must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    run_and_write(run, parse_args(argv))


if __name__ == "__main__":
    main()
