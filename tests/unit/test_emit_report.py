"""``choreo emit``'s report prints what a request file held as text: a line whose error
quotes Rich markup (a key ``[/x]``) raised ``MarkupError`` and the report never told where
to resume."""

from __future__ import annotations

import pytest

from producers.cli import Outcome, _report


def test_errors_and_stop_reasons_print_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    outcome = Outcome(errors=[{"line": 3, "error": "unknown field '[/x]' [bold]"}], stopped_at_line=4,
                      stop_reason="admission refused ([/]): [red]")
    _report(outcome, as_json=False)
    printed = capsys.readouterr().err
    assert "unknown field '[/x]' [bold]" in printed
    assert "stopped at line 4: admission refused ([/]): [red] (resume from line 4)" in printed
