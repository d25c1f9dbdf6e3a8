"""``python -m infra.audit [LOCK]``: known vulnerabilities of the pinned dependencies.

The lock (``requirements.lock``, every transitive dependency pinned with its hashes, made by
``pip-compile --generate-hashes``) is audited as it is, by pip-audit: no resolver runs and
nothing is installed (``--disable-pip``). The data is PyPI's own (pip-audit's ``pypi``
service: each release's JSON, its ``vulnerabilities``), so only PyPI needs to be reachable;
``CHOREO_AUDIT_OSV_URL`` points pip-audit at an OSV API instead (a mirror of osv.dev).

Exit status: 0 no known vulnerability; 1 at least one (each printed with its ids and the
versions that fix it); 2 the audit could not be completed (pins whose data could not be
fetched, or pip-audit failed): an audit that saw nothing is never reported as clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from choreo.config import REPO_ROOT

LOCK = REPO_ROOT / "requirements.lock"
CLEAN, VULNERABLE, INCOMPLETE = 0, 1, 2


@dataclass(frozen=True)
class Finding:
    name: str
    version: str
    ids: tuple[str, ...]
    fixed_in: tuple[str, ...]

    def line(self) -> str:
        fix = ", ".join(self.fixed_in) or "no fixed release"
        return f"{self.name}=={self.version}: {', '.join(self.ids)} (fixed in {fix})"


@dataclass(frozen=True)
class Audit:
    status: int
    findings: list[Finding]
    unaudited: dict[str, str]  # name==version -> why it could not be audited
    audited: int

    def report(self) -> str:
        lines = [f"known vulnerability: {f.line()}" for f in self.findings]
        if self.unaudited:
            first = next(iter(self.unaudited.items()))
            lines.append(f"audit incomplete: {len(self.unaudited)} of {self.audited + len(self.unaudited)} "
                         f"pins could not be audited, e.g. {first[0]}: {first[1]}")
        if self.status == CLEAN:
            lines.append(f"no known vulnerability in {self.audited} pinned packages")
        return "\n".join(lines)


def command(lock: Path, output: Path) -> list[str]:
    pip_audit = Path(sys.executable).with_name("pip-audit")
    args = [str(pip_audit), "-r", str(lock), "--disable-pip", "--progress-spinner", "off",
            "--format", "json", "--output", str(output)]
    osv = os.environ.get("CHOREO_AUDIT_OSV_URL", "").strip()
    return args + (["--vulnerability-service", "osv", "--osv-url", osv] if osv
                   else ["--vulnerability-service", "pypi"])


def audit(lock: Path = LOCK, timeout_s: float = 600.0) -> Audit:
    """Run pip-audit on ``lock`` and classify what it found (see the module doc)."""
    with tempfile.TemporaryDirectory(prefix="choreo-audit-") as tmp:
        output = Path(tmp) / "audit.json"
        done = subprocess.run(command(lock, output), capture_output=True, text=True, timeout=timeout_s)
        if not output.exists():
            reason = (done.stderr.strip().splitlines() or [f"pip-audit exited {done.returncode}"])[-1]
            return Audit(INCOMPLETE, [], {"pip-audit": reason[:300]}, 0)
        result = json.loads(output.read_text())
    findings: list[Finding] = []
    unaudited: dict[str, str] = {}
    audited = 0
    for dep in result.get("dependencies", []):
        pin = str(dep.get("name")) + (f"=={dep['version']}" if "version" in dep else "")
        if "skip_reason" in dep:
            unaudited[pin] = str(dep["skip_reason"])
            continue
        audited += 1
        for vuln in dep.get("vulns", []):
            findings.append(Finding(str(dep["name"]), str(dep["version"]),
                                    (str(vuln["id"]), *map(str, vuln.get("aliases", []))),
                                    tuple(map(str, vuln.get("fix_versions", [])))))
    status = VULNERABLE if findings else INCOMPLETE if unaudited else CLEAN
    return Audit(status, findings, unaudited, audited)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    result = audit(Path(args[0]) if args else LOCK)
    print(result.report(), file=sys.stderr if result.status else sys.stdout)
    return result.status


if __name__ == "__main__":
    raise SystemExit(main())
