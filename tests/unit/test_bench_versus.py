"""``bench.versus``'s comparison: medians of each side and their ratio, a missing figure
left as None rather than guessed."""

from __future__ import annotations

from bench.versus import compare, parse_args


def test_each_figure_is_the_ratio_of_the_medians() -> None:
    baseline = [{"deliveries_per_s": 100.0, "p99_ms_at_1000": None}, {"deliveries_per_s": 300.0}]
    current = [{"deliveries_per_s": 150.0, "p99_ms_at_1000": 80.0}, {"deliveries_per_s": 250.0}]
    figures = compare(baseline, current)
    rate = figures["deliveries_per_s"]
    assert (rate["baseline"], rate["current"], rate["current_over_baseline"]) == (200.0, 200.0, 1.0)
    assert figures["p99_ms_at_1000"]["baseline"] is None
    assert figures["p99_ms_at_1000"]["current_over_baseline"] is None  # one side never measured it


def test_the_pipeline_arguments_follow_the_double_dash() -> None:
    args = parse_args(["--commit", "HEAD~1", "--rounds", "4", "--", "--deliveries", "200", "--rates", "100"])
    assert args.commit == "HEAD~1" and args.rounds == 4
    assert args.bench_args == ["--deliveries", "200", "--rates", "100"]
