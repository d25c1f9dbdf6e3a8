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


def summarise(text: str, top: int = 15) -> dict[str, Any]:
    stacks = parse_collapsed(text)
    total = sum(count for _, count in stacks)
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        if frames:
            own[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count

    def table(counter: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": name, "samples": n, "pct": round(100 * n / total, 1)}
                for name, n in counter.most_common(top)] if total else []

    return {"samples": total, "own": table(own), "total": table(inclusive)}
