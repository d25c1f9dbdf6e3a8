"""What the extra test lanes of ``make test`` share: pytest in a child process, with one part
of the stack taken from outside (``CHOREO_EXTERNAL``) and pointed at by the lane."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from choreo.config import REPO_ROOT


def run_pytest(part: str, addresses: Mapping[str, str], tests: Sequence[str], args: Sequence[str]) -> int:
    """pytest's exit code for ``tests`` (and more ``args``) with ``part`` (kafka, redis,
    registry) external and the environment's ``addresses`` for it."""
    outside = {*os.environ.get("CHOREO_EXTERNAL", "").split(","), part} - {""}
    env = {**os.environ, **addresses, "CHOREO_EXTERNAL": ",".join(sorted(outside))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *tests, *args],
                          cwd=REPO_ROOT, env=env, check=False).returncode
