"""The pipeline benchmark of a given commit beside the working tree's, in one run.

    .venv/bin/python -m bench.versus --commit HEAD~1 --rounds 2 -- --deliveries 2000 --repeats 1 --rates 500

A change's effect is a ratio measured side by side: figures from different days on a shared
machine differ by more than most changes do. The commit is checked out into a temporary git
worktree (sharing this checkout's virtualenv), and each round runs ``bench.pipeline`` there
and here, in alternating order (ABBA), so a drift of the machine's load falls on both. The
arguments after ``--`` go to every ``bench.pipeline`` run. The figures file holds each run's
summary and, per figure, both medians and ``current / baseline``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import load_average, run_header, write_figures
from choreo.config import REPO_ROOT

RESULTS = REPO_ROOT / "bench" / "results"
# the summary figures compared (bench.pipeline's ``summary``, where a side has them): higher is
# better for the rates and ratios, lower for the rest
COMPARED = ("deliveries_per_s", "events_per_s", "ratio", "ratio_tuned", "ceiling_transactional_events_per_s",
            "ceiling_tuned_events_per_s", "p50_ms_at_100", "p99_ms_at_100", "p99_ms_at_half_capacity", "p99_ms_at_1000",
            "redis_bytes_per_inflight", "redis_runtime_bytes_retained_per_completed")


def log(message: str) -> None:
    print(f"[versus] {message}", file=sys.stderr, flush=True)


def resolve(commit: str) -> str:
    return subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def worktree(commit: str) -> Iterator[Path]:
    """The commit's tree in a temporary git worktree, using this checkout's virtualenv;
    removed on the way out."""
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        where = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(where), commit], cwd=REPO_ROOT,
                       capture_output=True, text=True, check=True)
        try:
            (where / ".venv").symlink_to(REPO_ROOT / ".venv")
            yield where
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=REPO_ROOT,
                           capture_output=True, check=False)


def bench_once(tree: Path, out: Path, bench_args: Sequence[str]) -> dict[str, Any]:
    """One ``bench.pipeline`` run in ``tree``; its summary."""
    done = subprocess.run([sys.executable, "-m", "bench.pipeline", *bench_args, "--out", str(out)],
                          cwd=tree, env=None, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench.pipeline in {tree} exited {done.returncode}")
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    return summary


def compare(baseline: list[dict[str, Any]], current: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: both medians and current / baseline (None where a side lacks it)."""
    figures: dict[str, Any] = {}
    for name in COMPARED:
        b = [s[name] for s in baseline if isinstance(s.get(name), (int, float))]
        c = [s[name] for s in current if isinstance(s.get(name), (int, float))]
        mb = statistics.median(b) if b else None
        mc = statistics.median(c) if c else None
        figures[name] = {"baseline": mb, "current": mc, "baseline_runs": b, "current_runs": c,
                         "current_over_baseline": round(mc / mb, 3) if mb and mc is not None else None}
    return figures


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    commit = resolve(args.commit)
    result: dict[str, Any] = {**run_header("bench.versus"), "baseline_commit": commit,
                              "bench_args": args.bench_args, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="bench-versus-") as tmp, worktree(commit) as base_tree:
        runs: dict[str, list[dict[str, Any]]] = {"baseline": [], "current": []}
        for round_ in range(args.rounds):
            order = ["baseline", "current"] if round_ % 2 == 0 else ["current", "baseline"]
            for side in order:
                tree = base_tree if side == "baseline" else REPO_ROOT
                log(f"round {round_ + 1}/{args.rounds}: {side}")
                summary = bench_once(tree, Path(tmp) / f"{side}-{round_}.json", args.bench_args)
                runs[side].append(summary)
                result["rounds"].append({"round": round_, "side": side, "summary": summary})
    result["machine"]["load_average_after"] = load_average()
    result["compared"] = compare(runs["baseline"], runs["current"])
    summary = {name: figure["current_over_baseline"] for name, figure in result["compared"].items()}
    return result, {"baseline_commit": commit[:12], "current_over_baseline": summary}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the baseline: any git revision")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side (alternating order)")
    parser.add_argument("--out", default=str(RESULTS / "versus.json"))
    parser.add_argument("bench_args", nargs="*", help="after --: bench.pipeline's arguments")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    result, summary = run(args)
    write_figures(Path(args.out), result, summary)


if __name__ == "__main__":
    main()
