"""The cyclic garbage collector, set for a long-running process that works in batches."""

from __future__ import annotations

import gc

# allocations between two collections of the youngest generation (CPython's default: 700)
GC_YOUNG_THRESHOLD = 20_000


def settle_garbage_collector() -> None:
    """Keep the cyclic garbage collector off what start-up built, and collect less often.

    Call it once start-up is done. A batch allocates tens of thousands of short-lived
    objects: with CPython's defaults a service ran the collector every 700 allocations and,
    now and then, walked every object of its imported libraries again. That was a quarter
    to a third of each service's CPU (bench/README.md, "The services' garbage collector"). What
    start-up built lives as long as the process: ``gc.freeze`` moves it out of the
    collector's sight. The objects of a batch are freed by reference counting; cycles among
    them are still collected, every ``GC_YOUNG_THRESHOLD`` allocations.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


def collect_batch_cycles() -> None:
    """Free the reference cycles a batch left, once it is done: a young collection.

    With the threshold this high a cycle could hold a batch's messages (up to 512 KB each)
    for thousands of batches: a handler's error keeps its traceback, whose frame keeps the
    attempt that keeps the error. Only what the batch allocated and kept is walked (start-up
    is frozen): about a millisecond per batch.
    """
    gc.collect(0)
