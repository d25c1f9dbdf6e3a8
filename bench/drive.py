"""Load drivers of the pipeline benchmark, each run as its own process (so the submit path
does not share a GIL with the observer that times the outcomes).

    python -m bench.drive pipeline --n N [--rate R] --out FILE   # the Python producer API
    python -m bench.drive ceiling --n N --topic T --samples F --out FILE

``--rate 0`` submits at full speed, in batches (``DeliveryClient.start_many``; closed loop:
the producer's own admission bounds what is in flight); a rate submits on a fixed schedule
(open loop: request ``i`` is due at ``start + i / rate``, whether or not the pipeline kept
up, so queueing shows in latency; what is due by the time a batch returns goes as the next).
Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process on the host).
The result file holds every accepted request as ``[id, due, accepted]``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any


def request_body(n: int, rng: random.Random) -> dict[str, Any]:
    """A valid request; light parcels (≤ 2 kg) so any drone of the fleet fits and the
    benchmark never waits on drone capacity (that is a business limit, not throughput)."""
    return {
        "owner_id": f"bench-{n % 17}",
        "pickup": {"lat": 52.5 + rng.random() / 10, "lon": 13.4, "address": f"{n} Pickup St"},
        "dropoff": {"lat": 52.4, "lon": 13.3 + rng.random() / 10, "address": f"{n} Drop Rd"},
        "package_size": rng.choice(["SMALL", "MEDIUM", "LARGE"]),
        "weight_kg": round(rng.uniform(0.2, 2.0), 2),
    }


def _wait_until(due: float) -> None:
    delay = due - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def drive_pipeline(n: int, rate: float, seed: int) -> dict[str, Any]:
    from choreo.memory import settle_garbage_collector
    from producers.client import SUBMIT_BATCH, DeliveryClient
    from producers.errors import AdmissionRefused

    rng = random.Random(seed)
    bodies = [request_body(i, rng) for i in range(n)]
    accepted: list[list[Any]] = []
    lock = threading.Lock()
    refused: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    futures: list[Future[None]] = []
    with DeliveryClient() as client:
        time.sleep(1.0)  # the admission monitor's first lag reading
        settle_garbage_collector()  # as a service does once started
        cpu0 = time.process_time()
        start = time.monotonic()
        i = 0
        while i < n:
            if rate > 0:
                _wait_until(start + i / rate)
                # what is due by now goes as one batch: a driver behind its schedule catches
                # up as a group commit would, and the latency from the schedule shows it
                due = min(n, int((time.monotonic() - start) * rate) + 1)
                batch = range(i, max(i + 1, min(due, i + SUBMIT_BATCH)))
            else:
                batch = range(i, min(n, i + SUBMIT_BATCH))
            handed_at = time.monotonic()
            for k, result in zip(batch, client.start_many([bodies[k] for k in batch])):
                if isinstance(result, AdmissionRefused):
                    # honour the refusal, briefly: a benchmark measures, it does not give up;
                    # refusals are the tail of a batch, so the next batch starts at this one
                    refused[result.reason] += 1
                    time.sleep(min(float(result.retry_after_s), 0.05))
                    break
                i = k + 1
                if isinstance(result, Exception):
                    errors[type(result).__name__] += 1
                    continue
                due_at = start + k / rate if rate > 0 else handed_at

                def done(future: Future[None], delivery_id: str = result.delivery_id,
                         due: float = due_at) -> None:
                    now = time.monotonic()
                    if future.exception() is not None:
                        errors[type(future.exception()).__name__] += 1
                        return
                    with lock:
                        accepted.append([delivery_id, due, now])

                result.confirmed.add_done_callback(done)
                futures.append(result.confirmed)
        submitted = time.monotonic()
        for future in futures:
            try:
                future.result(60)
            except Exception:  # counted by the callback
                pass
        cpu = time.process_time() - cpu0
    return {"start": start, "submitted": submitted, "end": time.monotonic(), "cpu_s": cpu,
            "accepted": accepted, "refused": dict(refused), "errors": dict(errors)}


def drive_ceiling(n: int, topic: str, samples_path: Path, rate: float = 0.0) -> dict[str, Any]:
    from confluent_kafka import KafkaError, Message, Producer

    from bench.ceiling import load_samples
    from choreo.kafka import pipeline_producer_config

    sample = load_samples(samples_path)["delivery.requested"]
    # the Publisher's settings (choreo.publisher)
    producer = Producer({**pipeline_producer_config(), "enable.idempotence": True, "acks": "all",
                         "delivery.timeout.ms": 30000})
    accepted: list[list[Any]] = []
    errors: Counter[str] = Counter()
    keys = [str(uuid.uuid4()) for _ in range(n)]
    cpu0 = time.process_time()
    start = time.monotonic()

    for i, key in enumerate(keys):
        due = start + i / rate if rate > 0 else time.monotonic()
        if rate > 0:
            _wait_until(due)
            producer.poll(0)

        def done(err: KafkaError | None, _: Message | None, key: str = key, due: float = due) -> None:
            if err is not None:
                errors[str(err.code())] += 1
            else:
                accepted.append([key, due, time.monotonic()])

        while True:
            try:
                producer.produce(topic, key=key.encode(), value=sample.value,
                                 headers=sample.headers, on_delivery=done)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    submitted = time.monotonic()
    producer.flush(60)
    return {"start": start, "submitted": submitted, "end": time.monotonic(),
            "cpu_s": time.process_time() - cpu0,
            "accepted": accepted, "refused": {}, "errors": dict(errors)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.drive")
    parser.add_argument("what", choices=["pipeline", "ceiling"])
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--topic", default="")
    parser.add_argument("--samples", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.what == "pipeline":
        result = drive_pipeline(args.n, args.rate, args.seed)
    else:
        result = drive_ceiling(args.n, args.topic, Path(args.samples), args.rate)
    # CPU of the submit loop only (set above), peak RSS of the whole process
    result["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
