"""``python -m infra.registry serve``: how the stack launches the registry process."""

from infra.registry.cli import app

if __name__ == "__main__":
    app(prog_name="infra.registry")
