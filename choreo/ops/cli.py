"""``choreo ops``: the commands an operator reaches for during an incident.

Mounted on the main CLI with ``app.add_typer(ops_app, name="ops")``. Every command prints
Rich tables for people (progress bars on long scans, on stderr) and takes ``--json`` for
scripts (one JSON document on stdout).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from choreo.text import printable
from choreo.workflow import Workflow, load_workflow

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
dlq_app = typer.Typer(no_args_is_help=True, help="Dead letters: list, show, redrive.")
topology_app = typer.Typer(no_args_is_help=True, help="The topology as data: check it, document it.")
app.add_typer(dlq_app, name="dlq")
app.add_typer(topology_app, name="topology")
err = Console(stderr=True, emoji=False)
out = Console(markup=False, emoji=False)  # what it prints comes from Redis and Kafka: never markup

WORKFLOW_OPT = typer.Option("consumers.workflow:WORKFLOW", "--workflow", help="module:attr of the Workflow")
JSON_OPT = typer.Option(False, "--json", help="one JSON document on stdout, for scripts")


def _time(text: str) -> int:
    """An operator's ``--since``/``--from`` as epoch ms, or a clear refusal."""
    from choreo.ops.records import parse_time

    return _parsed(parse_time, text)


def _duration(text: str) -> int:
    """An operator's ``--window`` in ms, or a clear refusal."""
    from choreo.ops.records import parse_duration

    return _parsed(parse_duration, text)


def _parsed(parse: Callable[[str], int], text: str) -> int:
    try:
        return parse(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)[:200]) from None


def _partitioner(name: str) -> str:
    from choreo.ops.records import PARTITIONERS

    if name not in PARTITIONERS:
        raise typer.BadParameter(f"the partitioner is one of {', '.join(PARTITIONERS)}")
    return name


def _as_written(delivery_id: str) -> str:
    """A pasted delivery id as the pipeline writes it (a UUID in its canonical lowercase,
    whatever form it was pasted in: braces, capitals); any other id as it is."""
    try:
        return str(uuid.UUID(delivery_id.strip()))
    except ValueError:
        return delivery_id


def _workflow(ref: str) -> Workflow:
    try:
        return load_workflow(ref)
    except TypeError as exc:
        raise typer.BadParameter(str(exc)) from None


def _emit_json(value: Any) -> None:
    def plain(v: Any) -> Any:
        if is_dataclass(v) and not isinstance(v, type):
            return asdict(v)
        return str(v)

    print(json.dumps(value, default=plain, indent=2))


def _safe(text: str) -> str:
    """Such text inside a message that has markup of its own."""
    return escape(printable(text))


def _add_row(table: Table, *cells: str, style: str = "") -> None:
    table.add_row(*(printable(cell) for cell in cells), style=style)


def _when(ms: int) -> str:
    from choreo.ops.records import shown_time

    return shown_time(ms)


def _fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {_safe(message)}")
    raise typer.Exit(1)


@contextmanager
def _progress(label: str, quiet: bool) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """(set_total, advance) callbacks driving a Rich progress bar on stderr."""
    if quiet or not sys.stderr.isatty():
        yield (lambda _: None), (lambda _: None)
        return
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield (lambda n: bar.update(task, total=n)), (lambda n: bar.advance(task, n))


def _offsets(specs: list[str]) -> dict[int, tuple[int, int]] | None:
    """``P:A-B`` (inclusive) → {P: (A, B + 1)}."""
    if not specs:
        return None
    result = {}
    for spec in specs:
        try:
            part, _, rng = spec.partition(":")
            first, _, last = rng.partition("-")
            result[int(part)] = (int(first), int(last) + 1)
        except ValueError as exc:
            raise typer.BadParameter(f"{spec!r}: expected PARTITION:FIRST-LAST") from exc
    return result


# -- replay ---------------------------------------------------------------------------------

@app.command("replay")
def replay_cmd(
    service_ref: str = typer.Argument("", help="module:service whose handlers run over the range"),
    topic: list[str] = typer.Option([], "--topic", "-t", help="topic(s) to replay (default: the service's)"),
    since: str = typer.Option("", "--from", help="start time: ISO 8601 (UTC if naive), epoch ms, -15m"),
    until: str = typer.Option("", "--to", help="end time, exclusive (default: now)"),
    offsets: list[str] = typer.Option([], "--offsets", help="PARTITION:FIRST-LAST (inclusive), repeatable"),
    group: str = typer.Option("", "--group", help="consumer group for the replay (default: a fresh one)"),
    reset_live_group: bool = typer.Option(False, "--reset-live-group",
                                          help="move the service's live group to the range start instead "
                                               "(the service must be stopped; it re-runs the range itself)"),
    workflow: str = WORKFLOW_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Re-consume a topic range into a service's handlers (live group untouched), or move a group."""
    from choreo.ops.replay import RangeSpec, move_group, replay_into_service
    from choreo.service import load_service

    service = load_service(service_ref) if service_ref else None
    topics = topic or ([t for t in service.topics] if service else [])
    if not topics:
        _fail("name --topic (or a service whose topics to replay)")
    spec = RangeSpec(topics, _time(since) if since else None, _time(until) if until else None,
                     _offsets(offsets))
    if spec.since_ms is None and spec.offsets is None:
        _fail("give a range: --from/--to or --offsets")
    if service is None or reset_live_group:
        target = group or (service.name if service else "")
        if not target:
            _fail("--group is needed without a service")
        try:
            spans = move_group(target, spec, allow_existing=reset_live_group)
        except (ValueError, RuntimeError) as exc:
            _fail(str(exc))
        if as_json:
            _emit_json({"group": target, "moved": spans})
        else:
            err.print(f"group [bold]{_safe(target)}[/] now starts at the range on {len(spans)} partitions; "
                      "start its service to consume from there")
        return
    try:
        with _progress(f"replay into {service.name}", as_json) as (total, advance):
            result = replay_into_service(service, spec, group=group or None, workflow=_workflow(workflow),
                                         progress_total=total, progress=advance)
    except (ValueError, TimeoutError) as exc:
        _fail(str(exc))
    if as_json:
        _emit_json(result)
        return
    for warning in result.warnings:
        err.print(f"[yellow]warning:[/] {_safe(warning)}")
    table = Table("records in range", "handled (new to the service)", "skipped (already handled)",
                  "skipped (delivery released)", "batches read again", "seconds",
                  title=f"replay into {result.service} (group {result.group})")
    _add_row(table, str(result.records), str(result.handled), str(result.duplicates), str(result.released),
             str(result.rewound_batches), f"{result.seconds:.2f}")
    out.print(table)


# -- rebuild-state ----------------------------------------------------------------------------

@app.command("rebuild-state")
def rebuild_cmd(
    since: str = typer.Option("-7d", "--from", help="read the topics from this time (ISO, epoch ms, -7d)"),
    force: bool = typer.Option(False, "--force", help="rebuild even while services consume (unsafe)"),
    pass_records: int | None = typer.Option(
        None, "--pass-records", min=1,
        help="records a pass holds at most, about 3 KB each (default 500,000); a bigger partition is read "
             "once per share of its deliveries"),
    partitioner: str = typer.Option("consistent_random", help="the producers' partitioner"),
    workflow: str = WORKFLOW_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """Rebuild Redis (state table, joins, outcomes, pools, services' records, dedupe) from the topics, merge-only.

    Pause the workflow's services first (stop or SIGSTOP them), resume them afterwards.
    """
    from choreo.ops.rebuild import PASS_RECORDS, rebuild

    try:
        with _progress("reading topics", as_json) as (total, advance):
            report = rebuild(_workflow(workflow), since_ms=_time(since),
                             progress_total=total, progress=advance, force=force,
                             pass_records=pass_records or PASS_RECORDS, partitioner=_partitioner(partitioner))
    except RuntimeError as exc:
        _fail(str(exc))
    if as_json:
        _emit_json(report)
        return
    table = Table("restored", "count", title=f"rebuild from {_when(report.since_ms)} ({report.seconds:.1f}s)")
    for name in ("records_read", "deliveries", "outcomes", "fanin_fields", "steps", "open_steps",
                 "closed_steps", "bookings_restored", "bookings_left_free", "seen_entries", "service_records",
                 "pool_members", "released_skipped", "awaiting_release", "awaiting_operator"):
        _add_row(table, name.replace("_", " "), str(getattr(report, name)))
    out.print(table)
    out.print("seconds: " + ", ".join(f"{phase} {s:.1f}" for phase, s in report.phase_seconds.items()))
    out.print(f"read in {report.passes} passes, at most {report.most_deliveries_held} deliveries held at once")
    if report.one_group_because:
        err.print(f"[yellow]not a partition at a time:[/] {_safe(report.one_group_because)}")
    for conflict in report.booking_conflicts:
        err.print(f"[red]booking conflict:[/] {_safe(conflict)}")
    if report.booking_conflicts:
        raise typer.Exit(1)


# -- an undo that failed for good: done by hand, or asked again -------------------------------

NOTE_OPT = typer.Option("", "--note", help="what was done or why (a ticket, a short text; no customer data)")
BY_OPT = typer.Option("", "--by", help="who decided (default: your login)")
WAIT_OPT = typer.Option(30.0, "--wait", min=0, help="seconds to wait for the supervisor to act on it")


def _decide(workflow: str, delivery_id: str, step: str, action: str, note: str, by: str, wait_s: float,
            as_json: bool) -> None:
    """Publish the decision and wait for the supervisor (the exit codes: the commands' help).
    After a failure on the way the decision may or may not be published: deciding again is
    safe, as a second one is refused once the first acted."""
    import redis
    from confluent_kafka import KafkaException

    from choreo.ops.compensation import DecisionRefused, decide

    try:
        result = decide(_workflow(workflow), delivery_id, step, action, note, by, wait_s)
    except DecisionRefused as exc:
        _fail(str(exc))
    except (RuntimeError, KafkaException, redis.RedisError) as exc:
        err.print(f"[bold red]error:[/] {_safe(str(exc)[:300])}: the decision may or may not be published; "
                  f"look at the step (choreo ops trace {_safe(delivery_id)})")
        raise typer.Exit(3) from None
    if as_json:
        _emit_json(result)
    elif result.acted_on:
        out.print(printable(f"{step} of {delivery_id} is {result.status}; undo order: "
                             + ", ".join(f"{s} {status}" for s, status in result.undo_order.items())))
    else:
        err.print(f"[yellow]published to {_safe(result.topic)}; no supervisor acted on it within --wait[/] "
                  f"(the step is {_safe(result.status or 'gone')}): none reads that topic yet, or it found the step "
                  "no longer compensation_failed")
    if not result.acted_on:
        raise typer.Exit(2)


@app.command("mark-compensated")
def mark_compensated_cmd(
    delivery_id: str = typer.Argument(..., help="the delivery whose undo failed for good"),
    step: str = typer.Argument(..., help="the step whose work you undid by hand (its status: compensation_failed)"),
    note: str = NOTE_OPT, by: str = BY_OPT, wait_s: float = WAIT_OPT,
    workflow: str = WORKFLOW_OPT, as_json: bool = JSON_OPT,
) -> None:
    """After an alert.compensation_failed: you undid the step's work by hand; the supervisor
    marks it compensated, gives back what it held (a drone) and asks the next undo.

    Exit 0 once it did, 1 when refused (nothing published), 2 when published and not acted
    on within --wait, 3 when Kafka or Redis failed on the way."""
    from choreo.ops.compensation import DONE_BY_HAND

    _decide(workflow, delivery_id, step, DONE_BY_HAND, note, by, wait_s, as_json)


@app.command("retry-undo")
def retry_undo_cmd(
    delivery_id: str = typer.Argument(..., help="the delivery whose undo failed for good"),
    step: str = typer.Argument(..., help="the step whose undo to ask again (its status: compensation_failed)"),
    note: str = NOTE_OPT, by: str = BY_OPT, wait_s: float = WAIT_OPT,
    workflow: str = WORKFLOW_OPT, as_json: bool = JSON_OPT,
) -> None:
    """After an alert.compensation_failed: what made the undo fail is fixed; the supervisor
    asks the undo again (a new attempt, a full budget), and its confirmation goes on with the
    chain. It waits up to --wait for the undo to be confirmed (or to fail for good again) and
    prints the step's status.

    Exit 0 once the supervisor asked it again, 1 when refused (nothing published), 2 when
    published and not acted on within --wait, 3 when Kafka or Redis failed on the way."""
    from choreo.ops.compensation import ASK_AGAIN

    _decide(workflow, delivery_id, step, ASK_AGAIN, note, by, wait_s, as_json)


# -- trace ------------------------------------------------------------------------------------

@app.command("trace")
def trace_cmd(
    delivery_id: str = typer.Argument(..., help="the delivery id (the key of all its events)"),
    since: str = typer.Option("", "--since", help="scan from this time (default: the request time)"),
    partitioner: str = typer.Option("consistent_random", help="the producers' partitioner"),
    bodies: bool = typer.Option(False, "--bodies", help="show decoded bodies"),
    topic: list[str] = typer.Option([], "--topic", "-t", help="also scan this topic (e.g. a new subscriber's)"),
    workflow: str = WORKFLOW_OPT,
    as_json: bool = JSON_OPT,
) -> None:
    """The whole story of one delivery across every topic, in causal order."""
    from choreo.ops.trace import trace

    delivery_id = _as_written(delivery_id)
    with _progress(f"tracing {_safe(delivery_id)}", as_json) as (_, advance):
        result = trace(delivery_id, _workflow(workflow), since_ms=_time(since) if since else None,
                       partitioner=_partitioner(partitioner), progress=advance, extra_topics=topic)
    if as_json:
        _emit_json(result.as_dict())
        return
    table = Table("#", "time (UTC)", "+ms", "topic", "producer", "type", "att", "hops", "note", "handled by",
                  title=f"delivery {delivery_id}: {len(result.hops)} events")
    styles = {"dead-letter": "red", "retry": "yellow", "recovery": "magenta", "compensation": "cyan"}
    for i, hop in enumerate(result.hops, 1):
        handled = ", ".join(f"{s}{'' if ok else ' (pending)'}" for s, ok in hop.consumed_by.items())
        _add_row(table, str(i), _when(hop.time_ms), str(hop.since_previous_ms),
                 f"{hop.topic}[{hop.partition}]@{hop.offset}", hop.producer, hop.event_type, str(hop.attempt),
                 str(hop.hops), hop.note[:80], handled, style=styles.get(hop.kind, ""))
        if bodies:
            _add_row(table, "", "", "", "", "", "", "", "", json.dumps(hop.body)[:300], "")
    out.print(table)
    if result.state:
        state = Table("field", "value", title="state table (Redis)")
        for k, v in result.state.items():
            _add_row(state, k, v)
        out.print(state)
    err.print(f"scanned {result.stats.records_read} records in {result.stats.partitions} partitions in "
              f"{result.stats.seconds * 1000:.0f} ms (from {_when(result.since_ms)}, found by {result.found_start_by})")


# -- dlq --------------------------------------------------------------------------------------

def _selection(topic: list[str], reason: list[str], delivery: list[str], partition: int | None,
               offsets: str, since: str, limit: int) -> Any:
    from choreo.ops.dlq import Selection

    rng = None
    if offsets:
        first, _, last = offsets.partition("-")
        if not (first.isascii() and first.isdigit() and (last.isascii() and last.isdigit() or not last)):
            raise typer.BadParameter(f"--offsets {offsets[:40]!r}: give N or N-M")
        rng = (int(first), int(last or first))
    return Selection(topics=topic, reasons=reason, delivery_ids=[_as_written(d) for d in delivery],
                     partition=partition, offsets=rng,
                     since_ms=_time(since) if since else None, limit=limit)


TOPIC_OPT = typer.Option([], "--topic", "-t", help="DLQ topic or its source topic (repeatable)")
REASON_OPT = typer.Option([], "--reason", "-r", help="dlq.reason code (repeatable)")
DELIVERY_OPT = typer.Option([], "--delivery", "-d", help="delivery id (repeatable)")
PARTITION_OPT = typer.Option(None, "--partition", "-p", min=0, max=2**31 - 1, help="DLQ partition")
OFFSETS_OPT = typer.Option("", "--offsets", help="FIRST-LAST offsets in the DLQ partition (inclusive)")
SINCE_OPT = typer.Option("", "--since", help="only dead letters from this time")


@dlq_app.command("list")
def dlq_list(topic: list[str] = TOPIC_OPT, reason: list[str] = REASON_OPT, delivery: list[str] = DELIVERY_OPT,
             partition: int | None = PARTITION_OPT, offsets: str = OFFSETS_OPT, since: str = SINCE_OPT,
             limit: int = typer.Option(0, help="stop after this many (0: all)"),
             details: bool = typer.Option(False, "--details", help="one row per dead letter"),
             as_json: bool = JSON_OPT) -> None:
    """Dead letters by topic and reason (with how many were redriven)."""
    from choreo.ops.dlq import dead_letters, summary

    with _progress("reading dead letters", as_json) as (_, advance):
        letters = dead_letters(_selection(topic, reason, delivery, partition, offsets, since, limit), advance)
    if as_json:
        _emit_json({"summary": summary(letters), "dead_letters": letters})
        return
    table = Table("dlq topic", "reason", "count", "redriven", title="dead letters")
    for row in summary(letters):
        _add_row(table, row["topic"], row["reason"], str(row["count"]), str(row["redriven"]))
    out.print(table)
    if details:
        rows = Table("position", "time (UTC)", "reason", "service", "delivery", "redriven", "error")
        for letter in letters:
            _add_row(rows, f"{letter.dlq_topic}[{letter.partition}]@{letter.offset}", _when(letter.time_ms),
                     letter.reason, letter.service, letter.delivery_id, "yes" if letter.redriven else "",
                     letter.error[:80])
        out.print(rows)


@dlq_app.command("show")
def dlq_show(topic: str = typer.Argument(..., help="DLQ topic"),
             partition: int = typer.Argument(..., min=0, max=2**31 - 1),
             offset: int = typer.Argument(..., min=0, max=2**63 - 1), as_json: bool = JSON_OPT) -> None:
    """One dead letter: headers and the decoded body when it can be decoded."""
    from choreo.ops.dlq import show

    try:
        shown = show(topic, partition, offset)
    except LookupError as exc:
        _fail(str(exc))
    if as_json:
        _emit_json(shown)
        return
    headers = Table("header", "value", title=f"{topic}[{partition}]@{offset} ({shown['value_bytes']} bytes)")
    for k, v in shown["headers"].items():
        _add_row(headers, k, v, style="red" if k.startswith("dlq.") else "")
    out.print(headers)
    if shown["dead_letter"]["problem"]:
        err.print(f"[bold red]untrusted, never redriven:[/] {_safe(str(shown['dead_letter']['problem']))}",
                  highlight=False)
    # ASCII only: a body's control and direction characters stay escapes, not sent to the terminal
    out.print_json(json.dumps(shown["body"] if isinstance(shown["body"], dict) else str(shown["body"])),
                   ensure_ascii=True)


@dlq_app.command("redrive")
def dlq_redrive(topic: list[str] = TOPIC_OPT, reason: list[str] = REASON_OPT, delivery: list[str] = DELIVERY_OPT,
                partition: int | None = PARTITION_OPT, offsets: str = OFFSETS_OPT, since: str = SINCE_OPT,
                limit: int = typer.Option(0, help="redrive at most this many"),
                dry_run: bool = typer.Option(False, "--dry-run", help="show what would be redriven"),
                as_json: bool = JSON_OPT) -> None:
    """Send selected dead letters back to their source topic, each at most once (fix the cause first)."""
    from choreo.ops.dlq import RedriveStopped, redrive

    selection = _selection(topic, reason, delivery, partition, offsets, since, limit)
    if not (topic or reason or delivery or offsets or since):
        _fail("select what to redrive: --topic, --reason, --delivery, --offsets or --since")
    stopped: RedriveStopped | None = None
    with _progress("redriving", as_json) as (_, advance):
        try:
            result = redrive(selection, dry_run=dry_run, progress=advance)
        except RedriveStopped as exc:  # what committed before is redriven: shown, then the error
            result, stopped = exc.done, exc
    if as_json:
        _emit_json({"dry_run": result.dry_run, "redriven": result.redriven,
                    "skipped": [{"dead_letter": s, "why": why} for s, why in result.skipped],
                    **({"stopped": str(stopped)} if stopped is not None else {})})
        if stopped is not None:
            raise typer.Exit(1)
        return
    verb = "would redrive" if dry_run else "redriven"
    table = Table("position", "→ topic", "reason", "delivery", title=f"{verb}: {len(result.redriven)}")
    for letter in result.redriven:
        _add_row(table, letter.position, letter.source_topic, letter.reason, letter.delivery_id)
    out.print(table)
    for letter, why in result.skipped:
        err.print(f"[yellow]skipped[/] {_safe(f'{letter.position}: {why}')}")
    if stopped is not None:
        _fail(str(stopped))


# -- status -----------------------------------------------------------------------------------

@app.command("status")
def status_cmd(limit: int = typer.Option(1000, help="steps of the deadline index to look at, and of those "
                                                    "waiting for an operator"),
               window: str = typer.Option("1h", help="window for recent outcome counts (e.g. 15m, 1h)"),
               lag: bool = typer.Option(True, "--lag/--no-lag", help="consumer lag per group and partition"),
               workflow: str = WORKFLOW_OPT, as_json: bool = JSON_OPT) -> None:
    """Deliveries in flight, stuck (past deadline), failed, compensating and waiting for an
    operator's decision on an undo failed for good; consumer lag."""
    from choreo.ops.status import status

    window_ms = _duration(window)
    result = status(_workflow(workflow), limit=limit, window_ms=window_ms, with_lag=lag)
    if as_json:
        _emit_json(result)
        return
    summary = Table("in flight (deliveries)", "stuck steps", "failed steps", "compensating", "awaiting operator",
                    *[f"{t} ({window})" for t in result.recent_outcomes], title="deliveries")
    _add_row(summary, str(result.in_flight_deliveries), str(len(result.stuck)), str(len(result.failed)),
             str(len(result.compensating)), str(len(result.awaiting_operator)),
             *[str(n) for n in result.recent_outcomes.values()])
    out.print(summary)
    if result.awaiting_operator:
        table = Table("delivery", "step", "waiting s", "error",
                      title="undos failed for good: choreo ops mark-compensated | retry-undo <delivery> <step>")
        for v in result.awaiting_operator[:50]:
            waiting_s = (result.now_ms - v.waiting_since_ms) / 1000
            _add_row(table, v.delivery_id, v.step, f"{waiting_s:.0f}", v.error[:60])
        out.print(table)
    for title, rows in (("stuck", result.stuck), ("failed", result.failed), ("compensating", result.compensating)):
        if not rows:
            continue
        table = Table("delivery", "step", "status", "overdue s", "attempt", "failures", "error", title=title)
        for v in rows[:50]:
            _add_row(table, v.delivery_id, v.step, v.status, f"{v.overdue_ms / 1000:.1f}", str(v.attempt),
                     str(v.failures), v.error[:60])
        out.print(table)
    if result.lag:
        table = Table("group", "topic", "partition", "committed", "end", "lag", title="consumer lag")
        for row in result.lag:
            if row.lag or row.committed < 0:
                _add_row(table, row.group, row.topic, str(row.partition), str(row.committed), str(row.end),
                         str(row.lag), style="yellow" if row.lag > 100 else "")
        total = sum(r.lag for r in result.lag)
        out.print(table)
        err.print(f"total lag {total} over {len(result.lag)} partitions (rows with lag 0 hidden)")
    if result.indexed_steps > result.scanned_steps:
        err.print(f"looked at {result.scanned_steps} of {result.indexed_steps} indexed steps (--limit)")


# -- topology ---------------------------------------------------------------------------------

@topology_app.command("check")
def topology_check(workflow: str = WORKFLOW_OPT,
                   offline: bool = typer.Option(False, "--offline", help="declarations only: no broker, no registry"),
                   as_json: bool = JSON_OPT) -> None:
    """Exit 1 when the choreography is unsound (producers, schemas, co-partitioning, keys, cycles)."""
    from choreo.ops import topocheck

    flow = _workflow(workflow)
    partitions = subjects = None
    if not offline:
        from choreo.ops.records import existing_topics, reader
        from choreo.serde import registry_client

        consumer = reader()
        try:
            partitions = existing_topics(consumer)
        finally:
            consumer.close()
        subjects = list(registry_client().get_subjects())
    findings = topocheck.check(flow, partitions=partitions, subjects=subjects)
    if as_json:
        _emit_json({"ok": not findings, "findings": findings})
    else:
        for f in findings:
            err.print(f"[red]{_safe(f.rule)}:[/] {_safe(f.message)}")
        err.print("topology sound" if not findings else f"{len(findings)} problem(s)")
    if findings:
        raise typer.Exit(1)


@topology_app.command("doc")
def topology_doc(workflow: str = WORKFLOW_OPT,
                 out_dir: str = typer.Option("", "--out", help="directory (default: docs/)"),
                 as_json: bool = JSON_OPT) -> None:
    """Generate docs/asyncapi.yaml (+ .json) and docs/event-flow.md (Mermaid) from the declarations."""
    from pathlib import Path

    from choreo.ops import flowdoc

    files = flowdoc.write(_workflow(workflow), Path(out_dir) if out_dir else flowdoc.DOCS)
    if as_json:
        _emit_json([str(f) for f in files])
    else:
        for f in files:
            err.print(f"wrote {f}")


# -- web --------------------------------------------------------------------------------------

@app.command("web")
def web_cmd(workflow: str = WORKFLOW_OPT,
            host: str = typer.Option("127.0.0.1", help="address to bind; beyond loopback only with operator tokens"),
            port: int = typer.Option(8090, help="port to serve on"),
            interval: float = typer.Option(2.0, min=0.5, max=60, help="seconds between two readings of the stack"),
            log_level: str = typer.Option("warning", help="uvicorn's own log level")) -> None:
    """Serve the live web view: the flow with rates and lag, deliveries, dead letters (redrive), timelines.

    Operator tokens (CHOREO_OPS_TOKENS_FILE: <token>=<operator> lines) gate every page and
    allow the redrive; without them the view is read-only and served on loopback only."""
    from choreo.ops.web.app import serve

    try:
        serve(_workflow(workflow), host, port, interval_s=interval, log_level=log_level)
    except ValueError as exc:
        err.print(f"[bold red]refused:[/] {_safe(str(exc))}", highlight=False)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
