"""Profiling the Kafka broker with Java Flight Recorder, which ships with the JDK (no agent to
install): ``jcmd <pid> JFR.start`` / ``JFR.stop``, then ``jfr print --json`` of the execution
samples, turned into collapsed stacks (``thread;frame;...;leaf count``, root first) so the same
summary as the Python profiles applies. The broker used more CPU per delivery under the
pipeline than under the no-logic ceiling; this says on what."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import thread_group

RECORDING = "choreo-bench"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"--profile kafka needs the JDK's {name} on PATH")
    return found


def start(pid: int, out: Path) -> None:
    subprocess.run([_tool("jcmd"), str(pid), "JFR.start", f"name={RECORDING}", "settings=profile",
                    f"filename={out}"], check=True, capture_output=True, timeout=60)


def stop(pid: int, out: Path) -> str:
    """Stop the recording (JFR writes it to ``out``) and return its collapsed stacks."""
    subprocess.run([_tool("jcmd"), str(pid), "JFR.stop", f"name={RECORDING}"],
                   check=True, capture_output=True, timeout=120)
    printed = subprocess.run([_tool("jfr"), "print", "--json", "--events", "jdk.ExecutionSample",
                              str(out)], check=True, capture_output=True, timeout=600).stdout
    return collapse(json.loads(printed))


def collapse(printed: dict[str, Any]) -> str:
    """``jfr print --json`` → collapsed stacks, the thread pool as the root frame (JFR lists
    frames leaf first)."""
    stacks: Counter[str] = Counter()
    for event in printed.get("recording", {}).get("events", []):
        values = event.get("values", {})
        thread = values.get("sampledThread") or {}
        pool = thread_group(str(thread.get("javaName") or thread.get("osName") or "?"))
        frames = (values.get("stackTrace") or {}).get("frames") or []
        names = [f"{f['method']['type']['name']}.{f['method']['name']} (java)" for f in reversed(frames)]
        stacks[";".join([f"thread {pool} (java)", *names])] += 1
    return "\n".join(f"{stack} {count}" for stack, count in stacks.most_common())
