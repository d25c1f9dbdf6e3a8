"""The second test lane: the pipeline's tests with Apicurio Registry as the external registry.

Starts Apicurio on loopback, runs pytest with ``SCHEMA_REGISTRY_URL`` at its Confluent API
and ``CHOREO_EXTERNAL=registry`` (so the stack starts no registry of its own), stops
Apicurio, and exits with pytest's code. ``make test`` runs it after the main lane:
``python -m infra.apicurio_lane [more pytest args]``.
"""

from __future__ import annotations

import os
import sys

from choreo.config import settings
from infra import apicurio
from infra.lanes import run_pytest
from infra.process import StackError

# never the shared stack's 8081, the chaos run's 18081 nor the secured stack's 28081
PORT = int(os.environ.get("APICURIO_PORT", "18480"))
# the pipeline's own tests, unchanged (tests/integration/test_external_registry.py, in the
# main lane, covers the stack, the demo and the deploy gate on Apicurio)
TESTS = ["tests/integration/test_pipeline.py"]


def main(args: list[str]) -> int:
    try:
        process = apicurio.start(PORT, settings().data_dir / "apicurio")
    except StackError as exc:
        print(f"apicurio lane: {exc}", file=sys.stderr)
        return 1
    print(f"apicurio lane: Apicurio Registry {apicurio.VERSION} at {apicurio.url(PORT)}", file=sys.stderr)
    try:
        return run_pytest("registry", {"SCHEMA_REGISTRY_URL": apicurio.url(PORT)}, TESTS, args)
    finally:
        process.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
