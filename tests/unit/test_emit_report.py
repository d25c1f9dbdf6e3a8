"""``choreo emit``'s report prints what a request file held as text: a line whose error
quotes Rich markup (a key ``[/x]``) raised ``MarkupError`` and the report never told where
to resume."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from producers.cli import Outcome, _lines, _report, emit_file
from tests.factories import request_body


def test_errors_and_stop_reasons_print_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = Outcome(errors=[{"line": 3, "error": "unknown field '[/x]' [bold]"}], stopped_at_line=4,
                      stop_reason="admission refused ([/]): [red]")
    _report(outcome, as_json=False)
    printed = capsys.readouterr().err
    assert "unknown field '[/x]' [bold]" in printed
    assert "stopped at line 4: admission refused ([/]): [red] (resume from line 4)" in printed


def test_a_files_escape_sequences_are_shown_not_sent_and_a_line_past_the_limit_is_never_held(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key that sets the terminal's title and clears its screen is shown escaped, not sent
    to the terminal; a line longer than a request may be is refused without being held."""
    hostile = json.dumps({**request_body(), "\u001b]0;owned\u001b\\\u001b[2J": 1})
    path = tmp_path / "requests.jsonl"
    path.write_text(hostile + "\n" + "x" * 200_000 + "\n\n" + json.dumps(request_body()) + "\n")
    outcome = emit_file(path, strict=True, max_wait_s=0, show_progress=False)
    assert [e["line"] for e in outcome.errors] == [1, 2] and outcome.strict_abort
    assert outcome.errors[1]["error"] == "longer than the 65536 characters a request may be"
    _report(outcome, as_json=False)
    printed = capsys.readouterr().err
    assert "\u001b" not in printed and "\\x1b]0;owned" in printed


def test_lines_are_read_in_bounded_pieces() -> None:
    source = io.StringIO("a\n" + "b" * 25 + "\n\n" + "c" * 10 + "\n" + "d" * 11)
    assert list(_lines(source, 10)) == [(1, "a\n"), (2, None), (4, "c" * 10 + "\n"), (5, None)]
