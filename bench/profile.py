"""Reading py-spy's ``--format raw`` output (collapsed stacks: ``a;b;c count`` per line):
the functions that cost the most, by own time (the frame on top) and by total time (the
frame anywhere on the stack), as percentages of the samples taken while busy."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def frame_name(frame: str, keep_line: bool = False) -> str:
    """``fn (path/to/module.py:12)`` → ``fn (module.py)`` (or with ``:12``): short and stable."""
    match = _FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    path = match["file"]
    short = "/".join(path.split("/")[-2:]) if "site-packages" not in path else path.split("site-packages/")[-1]
    suffix = f":{match['line']}" if keep_line and match["line"] else ""
    return f"{match['fn']} ({short}{suffix})"


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks.append(([frame_name(f) for f in stack.split(";")], int(count)))
    return stacks


# Frames on top of a stack that mean "blocked", not "computing": a C call waiting on the
# network (librdkafka's consume/commit, a Redis reply) or an idle helper thread. py-spy
# cannot always tell these from work, so they are split out by name.
WAITING = (
    ("kafka: consume (blocked in consumer.consume)", ("Runner._next_batch ",)),
    ("kafka: transaction commit / offsets (blocked)", ("Runner._commit ", "Runner._process ")),
    ("kafka: producer poll / flush (blocked)", ("Publisher.poll ", "Publisher.flush ")),
    ("redis: waiting for replies", ("SocketBuffer._read_from_socket ", "SocketBuffer.can_read",
                                    "_HiredisParser.read_from_socket ")),
    (IDLE := "idle threads (metrics server, waits)", ("_PollLikeSelector.select ", "Condition.wait ",
                                              "Event.wait ", "BaseServer.serve_forever ")),
    ("interpreter start-up (imports)", ("_find_and_load", "_compile_bytecode", "_call_with_frames_removed",
                                        "_path_stat", "FileLoader.get_data")),
)


def category(leaf: str) -> str | None:
    for name, prefixes in WAITING:
        if any(leaf.startswith(p) for p in prefixes):
            return name
    return None


def summarise(text: str, top: int = 15) -> dict[str, Any]:
    """Own time (top frame) and total time (anywhere on the stack) per function, as % of
    all samples; ``categories`` splits the samples into blocked/idle buckets and computing,
    and ``own_computing`` ranks only the frames that compute."""
    stacks = parse_collapsed(text)
    total = sum(count for _, count in stacks)
    own: Counter[str] = Counter()
    computing: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    categories: Counter[str] = Counter()
    roots: Counter[str] = Counter()
    for frames, count in stacks:
        if frames:
            roots[frames[0]] += count
            own[frames[-1]] += count
            found = category(frames[-1])
            if found is None and any(f.startswith("_find_and_load") for f in frames):
                found = "interpreter start-up (imports)"
            categories[found or "computing (Python and C work)"] += count
            if found is None:
                computing[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count

    def table(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": name, "samples": n, "pct": round(100 * n / total, 1)}
                for name, n in counter.most_common(top)] if total else []

    idle = categories.get(IDLE, 0)
    busy = total - idle
    return {"samples": total,
            "categories": {k: round(100 * n / total, 1) for k, n in categories.most_common()} if total else {},
            # the same without idle helper threads: where the working thread's time goes
            "working_thread": {k: round(100 * n / busy, 1) for k, n in categories.most_common()
                               if k != IDLE} if busy else {},
            # the broker's stacks start with their thread pool: where its time goes, by pool
            "roots": table(roots),
            "own_computing": table(computing), "own": table(own), "total": table(inclusive)}
