"""``emit`` and ``serve``: delivery requests from the command line, and the HTTP endpoint.

emit, one request from flags:
    choreo emit --owner acme --pickup "52.52,13.40,Alexanderplatz 1" \\
                --dropoff "52.50,13.37,Potsdamer Platz 2" --size SMALL --weight 1.5
emit, many from a JSON-lines file (one POST /deliveries body per line; '-' reads stdin):
    choreo emit --file requests.jsonl [--json] [--strict]

A malformed or invalid line is reported with its line number and skipped; the other lines
are published and the exit code is 1 (``--strict`` checks the whole file first and publishes
nothing if any line is bad). Admission refusals are waited out (Retry-After) up to
``--max-wait`` seconds in total, then emit stops and says which line to resume from (exit 3).
Delivery ids go to stdout, one per line, or as one JSON object with ``--json``; progress and
errors go to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from choreo.text import printable
from producers.errors import AdmissionRefused, PublishError
from producers.model import InvalidRequest, parse_request
from producers.settings import IngestionSettings

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Submit delivery requests, or serve the ingestion HTTP endpoint.")
err = Console(stderr=True)

EXIT_REJECTED_LINES = 1
EXIT_STOPPED = 3
EXIT_INSECURE = 2  # serve: a non-loopback address without owner tokens or --insecure
WINDOW = 500  # submissions awaited together (confirmation is per broker round trip)


@dataclass
class Outcome:
    delivery_ids: list[str] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    stopped_at_line: int | None = None
    stop_reason: str = ""
    strict_abort: bool = False  # --strict found invalid lines: nothing was published

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"accepted": len(self.delivery_ids), "rejected": len(self.errors),
                               "delivery_ids": self.delivery_ids, "errors": self.errors}
        if self.stopped_at_line is not None:
            out["stopped_at_line"] = self.stopped_at_line
            out["stop_reason"] = self.stop_reason
        return out


def parse_location(flag: str, value: str) -> dict[str, Any]:
    """``LAT,LON,ADDRESS`` (the address may itself contain commas)."""
    parts = value.split(",", 2)
    if len(parts) != 3:
        raise typer.BadParameter("expected LAT,LON,ADDRESS", param_hint=flag)
    try:
        lat, lon = float(parts[0]), float(parts[1])
    except ValueError:
        raise typer.BadParameter("LAT and LON must be numbers", param_hint=flag) from None
    return {"lat": lat, "lon": lon, "address": parts[2].strip()}


def _lines(source: TextIO, most: int) -> Iterator[tuple[int, str | None]]:
    """Each line that is not blank, with its number; ``None`` for one longer than ``most``
    characters (more than the HTTP endpoint takes), which is read past in pieces, never held
    whole."""
    number = 0
    while line := source.readline(most + 1):
        number += 1
        if len(line) > most and not line.endswith("\n"):
            while line and not line.endswith("\n"):
                line = source.readline(most + 1)
            yield number, None
        elif line.strip():
            yield number, line


def _open(path: Path) -> TextIO:
    return sys.stdin if str(path) == "-" else path.open(encoding="utf-8", errors="replace")


def _describe(exc: InvalidRequest) -> str:
    if exc.malformed:
        return "malformed JSON: " + "; ".join(e["message"] for e in exc.errors)
    return "invalid: " + str(exc)


def emit_file(path: Path, strict: bool, max_wait_s: float, show_progress: bool) -> Outcome:
    """Publish every valid line of a JSON-lines file; see the module doc for the rules."""
    from producers.client import DeliveryClient

    outcome = Outcome()
    most = IngestionSettings().max_body_bytes
    too_long = f"longer than the {most} characters a request may be"
    total: int | None = None
    if str(path) != "-":
        with _open(path) as source:
            total = 0
            for number, line in _lines(source, most):
                total += 1
                if not strict:
                    continue
                if line is None:
                    outcome.errors.append({"line": number, "error": too_long})
                    continue
                try:
                    parse_request(line)
                except InvalidRequest as exc:
                    outcome.errors.append({"line": number, "error": _describe(exc)})
        if strict and outcome.errors:
            outcome.stopped_at_line = outcome.errors[0]["line"]
            outcome.stop_reason = "invalid lines (--strict): nothing was published"
            outcome.strict_abort = True
            return outcome

    columns = (TextColumn("emit"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with DeliveryClient() as client, _open(path) as source, \
            Progress(*columns, console=err, disable=not show_progress) as progress:
        task = progress.add_task("emit", total=total)
        window: list[tuple[int, Any]] = []
        waited = 0.0

        def drain() -> None:
            for number, submission in window:
                try:
                    outcome.delivery_ids.append(client.confirm(submission))
                except PublishError as exc:
                    outcome.errors.append({"line": number, "error": f"not published: {exc}"})
                progress.advance(task)
            window.clear()

        for number, line in _lines(source, most):
            if line is None:
                outcome.errors.append({"line": number, "error": too_long})
                progress.advance(task)
                continue
            while True:
                try:
                    window.append((number, client.start(line)))
                    break
                except InvalidRequest as exc:
                    outcome.errors.append({"line": number, "error": _describe(exc)})
                    progress.advance(task)
                    break
                except AdmissionRefused as exc:
                    drain()
                    if waited + exc.retry_after_s > max_wait_s:
                        outcome.stopped_at_line = number
                        outcome.stop_reason = f"admission refused ({exc.reason}): {exc.detail}"
                        return outcome
                    time.sleep(exc.retry_after_s)
                    waited += exc.retry_after_s
                except PublishError as exc:
                    drain()
                    outcome.stopped_at_line = number
                    outcome.stop_reason = f"publish failed: {exc}"
                    return outcome
            if len(window) >= WINDOW:
                drain()
        drain()
    return outcome


def _report(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        print(json.dumps(outcome.as_json()))
    else:
        for delivery_id in outcome.delivery_ids:
            print(delivery_id)
        for item in outcome.errors:
            where = f"line {item['line']}" if item["line"] else "request"
            err.print(f"[red]{where}:[/] {escape(printable(str(item['error'])))}", highlight=False)
        err.print(f"accepted {len(outcome.delivery_ids)}, rejected {len(outcome.errors)}")
    if outcome.stopped_at_line:
        err.print(f"[bold red]stopped at line {outcome.stopped_at_line}:[/] {escape(printable(outcome.stop_reason))}"
                  f" (resume from line {outcome.stopped_at_line})", highlight=False)
    elif outcome.stopped_at_line == 0:
        err.print(f"[bold red]not submitted:[/] {escape(printable(outcome.stop_reason))}", highlight=False)


@app.command("emit")
def emit(
    owner: str | None = typer.Option(None, "--owner", help="owner (account) id"),
    pickup: str | None = typer.Option(None, help="LAT,LON,ADDRESS"),
    dropoff: str | None = typer.Option(None, help="LAT,LON,ADDRESS"),
    size: str = typer.Option("SMALL", help="SMALL, MEDIUM or LARGE"),
    weight: float | None = typer.Option(None, help="kilograms"),
    deadline: str | None = typer.Option(None, help="ISO-8601 with a timezone, e.g. 2030-01-01T12:00Z"),
    reply_topic: str | None = typer.Option(None, help="a topic to copy the outcome to"),
    idempotency_key: str | None = typer.Option(None, help="a retry with the same key gives the same delivery"),
    file: Path | None = typer.Option(None, "--file", "-f", help="JSON lines, one request per line; '-' is stdin"),
    strict: bool = typer.Option(False, help="with --file: publish nothing if any line is invalid"),
    max_wait: float = typer.Option(60.0, help="seconds to wait out admission refusals in total"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    verbose: bool = typer.Option(False, help="log every accepted delivery (JSON, stderr)"),
) -> None:
    """Submit delivery requests straight to Kafka (validated and admitted like HTTP ones)."""
    from choreo.logs import configure

    configure("INFO" if verbose else "WARNING")
    flags = [owner, pickup, dropoff, weight]
    if file is not None and any(v is not None for v in flags):
        raise typer.BadParameter("give either --file or the request flags, not both")
    if file is None and any(v is None for v in flags):
        raise typer.BadParameter("--owner, --pickup, --dropoff and --weight are required (or --file)")
    try:
        if file is not None:
            if strict and str(file) == "-":
                raise typer.BadParameter("--strict reads the file twice: give a path, not '-'")
            if str(file) != "-" and not file.is_file():
                raise typer.BadParameter(f"no such file: {file}", param_hint="--file")
            outcome = emit_file(file, strict, max_wait, show_progress=True)
        else:
            outcome = _emit_one(owner, pickup, dropoff, size, weight, deadline, reply_topic,
                                idempotency_key, max_wait)
    except typer.BadParameter:
        raise
    except Exception as exc:  # infrastructure down etc.: a sentence, not a traceback
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(EXIT_STOPPED) from None
    _report(outcome, as_json)
    if outcome.stopped_at_line is not None and not outcome.strict_abort:
        raise typer.Exit(EXIT_STOPPED)
    if outcome.errors:
        raise typer.Exit(EXIT_REJECTED_LINES)


def _emit_one(owner: str | None, pickup: str | None, dropoff: str | None, size: str,
              weight: float | None, deadline: str | None, reply_topic: str | None,
              idempotency_key: str | None, max_wait_s: float) -> Outcome:
    from producers.client import DeliveryClient

    assert owner is not None and pickup is not None and dropoff is not None
    body: dict[str, Any] = {
        "owner_id": owner, "pickup": parse_location("--pickup", pickup),
        "dropoff": parse_location("--dropoff", dropoff), "package_size": size.upper(),
        "weight_kg": weight,
    }
    if deadline:
        body["deadline"] = deadline
    if reply_topic:
        body["reply_topic"] = reply_topic
    outcome = Outcome()
    try:
        request = parse_request(body)
    except InvalidRequest as exc:
        outcome.errors.append({"line": 0, "error": _describe(exc)})
        return outcome
    waited = 0.0
    with DeliveryClient() as client:
        while True:
            try:
                outcome.delivery_ids.append(client.submit(request, idempotency_key))
                return outcome
            except AdmissionRefused as exc:
                if waited + exc.retry_after_s > max_wait_s:
                    outcome.stopped_at_line = 0
                    outcome.stop_reason = f"admission refused ({exc.reason}): {exc.detail}"
                    return outcome
                time.sleep(exc.retry_after_s)
                waited += exc.retry_after_s


@app.command("serve")
def serve(
    host: str | None = typer.Option(None, help="default: the host of INGESTION_URL"),
    port: int | None = typer.Option(None, help="default: the port of INGESTION_URL"),
    limit_concurrency: int = typer.Option(2000, help="connections served at once; more get 503"),
    log_level: str = typer.Option("warning", help="uvicorn's own log level"),
    insecure: bool = typer.Option(False, "--insecure",
                                  help="serve a non-loopback address without owner tokens"),
) -> None:
    """Serve the ingestion HTTP endpoint with uvicorn (SIGTERM drains and flushes).

    Without owner tokens anyone who reaches the port submits for any owner and reads any
    delivery: a non-loopback address is refused unless ``--insecure`` says so."""
    from choreo.http_serving import loopback
    from producers.http_server import run_http
    from producers.ingestion import create_app

    cfg = IngestionSettings()
    bind = host or cfg.host
    if not cfg.auth_enabled and not loopback(bind):
        if not insecure:
            err.print(f"[bold red]refused:[/] {bind} is not a loopback address and no owner tokens are "
                      "set (INGESTION_TOKENS_FILE); set them, or pass --insecure", highlight=False)
            raise typer.Exit(EXIT_INSECURE)
        err.print(f"[bold yellow]warning:[/] serving {bind} without owner tokens (--insecure)", highlight=False)
    run_http(create_app(cfg, settle_gc=True), bind, port or cfg.port, limit_concurrency, log_level)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
