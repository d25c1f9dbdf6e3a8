"""The ``choreo up`` commands: run the workflow from its configuration file, show each
process, stop them (``infra.up`` does the work)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from infra import up
from infra.process import StackError

app = typer.Typer(invoke_without_command=True, no_args_is_help=False,
                  help="The whole workflow on this host from one configuration file.")
console = Console(stderr=True, soft_wrap=True)

CONFIG_HELP = "the deployment's configuration file (TOML): services, instances, environment"


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(1)


def _config(path: Path) -> up.UpConfig:
    try:
        return up.load(path)
    except StackError as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


@app.callback()
def run(ctx: typer.Context,
        config: Path = typer.Option(up.DEFAULT_CONFIG, "--config", "-c", help=CONFIG_HELP),
        ordinal: int | None = typer.Option(None, help="this host's ordinal (default: $CHOREO_ORDINAL, "
                                                      "else the -<n> ending the host name, else 0)"),
        live: bool = typer.Option(False, "--live", help="a live table of the processes instead of log lines"),
        prepare: bool = typer.Option(True, help="create the workflow's topics and register its "
                                                "contracts before starting")) -> None:
    """Run every service of the workflow (N instances each, stable ids) and the ingestion
    server, restart what crashes with back-off, until SIGTERM or Ctrl-C (which drain)."""
    if ctx.invoked_subcommand is not None:
        return
    cfg = _config(config)
    up.apply_environment(cfg)
    try:
        host = up.ordinal(ordinal)
        if prepare:
            up.prepare(cfg)
        supervisor = up.Supervisor(cfg, host, say=lambda line: None if live else console.print(escape(line)))
        console.print(f"choreo up: {cfg.path} as host {host}, {len(supervisor.members)} processes "
                      f"(state in {supervisor.dir})")
        if live:
            def show() -> None:
                screen.update(_table(up.Status(None, [m.view() for m in supervisor.members])))

            with Live(_table(up.status(cfg.path)), console=console, refresh_per_second=2) as screen:
                supervisor.run(on_tick=show)
                show()  # the last frame says they stopped
        else:
            supervisor.run()
    except SchemaRegistryError as exc:
        _fail(f"registry refused a contract: {exc.error_message} (code {exc.error_code})")
    except StackError as exc:
        _fail(str(exc))
    console.print("choreo up: stopped")


@app.command("status")
def show_status(config: Path = typer.Option(up.DEFAULT_CONFIG, "--config", "-c", help=CONFIG_HELP),
                as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """Each process of a running ``choreo up``; exit code 1 unless all run."""
    found = up.status(config)
    if as_json:
        print(json.dumps(found.as_dict()))
    elif found.supervisor_pid is None:
        console.print(f"choreo up is not running for {config}")
    else:
        console.print(f"choreo up (pid {found.supervisor_pid})")
        Console().print(_table(found))
    if not found.healthy:
        raise typer.Exit(1)


@app.command("stop")
def stop(config: Path = typer.Option(up.DEFAULT_CONFIG, "--config", "-c", help=CONFIG_HELP)) -> None:
    """Stop a running ``choreo up`` (SIGTERM: intake first, then the services drain)."""
    try:
        pid = up.stop(config)
    except StackError as exc:
        _fail(str(exc))
    console.print(f"stopped choreo up (pid {pid})" if pid else f"choreo up was not running for {config}")


def _table(found: up.Status) -> Table:
    table = Table("process", "state", "pid", "restarts", "up for", "last exit", "log")
    now = time.time()
    for p in found.processes:
        state = p["state"] if p["state"] == "running" else f"[red]{p['state']}[/]"
        uptime = f"{now - p['started_at']:.0f}s" if p["state"] == "running" and p["started_at"] else "-"
        table.add_row(p["name"], state, str(p["pid"] or "-"), str(p["restarts"]), uptime,
                      escape(p["last_exit"] or "-"), p["log"])
    return table
