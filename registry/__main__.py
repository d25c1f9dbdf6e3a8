"""``python -m registry serve``: how the stack launches the registry process."""

from registry.cli import app

if __name__ == "__main__":
    app(prog_name="registry")
