"""``choreo registry ...``: run the schema registry in the foreground."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="The Confluent-compatible schema registry (store: the compacted _schemas topic).")


@app.callback()
def main() -> None:
    """Keep ``serve`` a named sub-command even though it is the only one."""


@app.command()
def serve(
    host: str | None = typer.Option(None, help="bind address (default: the host of SCHEMA_REGISTRY_URL)"),
    port: int | None = typer.Option(None, help="port (default: the port of SCHEMA_REGISTRY_URL)"),
    topic: str | None = typer.Option(None, help="store topic (default: SCHEMA_REGISTRY_TOPIC or _schemas)"),
) -> None:
    """Serve the REST API; it answers once the store topic has been read to its end."""
    import dataclasses

    from choreo.config import settings
    from registry.service import RegistryConfig
    from registry.service import serve as run

    config = RegistryConfig.from_settings(settings(), host=host, port=port)
    if topic:
        config = dataclasses.replace(config, topic=topic)
    run(config)
