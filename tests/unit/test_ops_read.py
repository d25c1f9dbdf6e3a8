"""How much one consume of an operator's read may hand over: bounded by the largest record
the read has met, whatever records come between (``choreo.ops.records.read``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from choreo.ops import records
from choreo.ops.records import READ_BATCH_BYTES, Span, read
from tests.factories import KafkaMessage


class Consumer:
    """Hands over the records as they arrive (``arrivals``: the records each wait brings), at
    most as many as each consume asks for, and counts the bytes of each consume."""

    def __init__(self, arrivals: list[list[int]]) -> None:
        offsets = iter(range(sum(map(len, arrivals))))
        self.arrivals = deque(deque(KafkaMessage(next(offsets), size) for size in sizes) for sizes in arrivals)
        self.asked: list[int] = []
        self.handed: list[int] = []

    def consume(self, count: int, timeout: float) -> list[KafkaMessage]:
        self.asked.append(count)
        if not self.arrivals:
            return []
        arrived = self.arrivals[0]
        taken = [arrived.popleft() for _ in range(min(count, len(arrived)))]
        if not arrived:
            self.arrivals.popleft()
        self.handed.append(sum(len(m.value()) for m in taken))
        return taken

    def assign(self, partitions: Any) -> None: ...
    def resume(self, partitions: Any) -> None: ...
    def pause(self, partitions: Any) -> None: ...
    def unassign(self) -> None: ...
    def position(self, partitions: Any) -> list[Any]:
        return []


def _read(arrivals: list[list[int]]) -> tuple[Consumer, list[int]]:
    consumer = Consumer(arrivals)
    total = sum(map(len, arrivals))
    sizes = [len(r.value or b"") for r in read(consumer, [Span("t", 0, 0, total)])]  # type: ignore[arg-type]
    return consumer, sizes


def test_small_records_between_large_ones_do_not_lift_the_bound_again() -> None:
    """A batch of small records after a large one let the next consume take 5,000 records:
    whatever arrived within its wait, eight large ones here."""
    large = READ_BATCH_BYTES // 4 + 1  # four make a byte more than a consume may take
    arrivals = [[100] * 16, [large], [100] * 50, [100] * 50, [large] * 8]
    consumer, sizes = _read(arrivals)
    assert sizes == [size for sizes in arrivals for size in sizes]
    assert consumer.asked[0] == records.FIRST_BATCH
    assert max(consumer.handed) <= READ_BATCH_BYTES, (consumer.asked, consumer.handed)
    assert consumer.asked[2:] == [3] * 37, consumer.asked  # three a consume once the large one is met


def test_small_records_are_read_in_large_consumes() -> None:
    consumer, sizes = _read([[100] * 20_000])
    assert len(sizes) == 20_000
    assert consumer.asked[1] == 5000  # the batch's most, once the sizes are known
