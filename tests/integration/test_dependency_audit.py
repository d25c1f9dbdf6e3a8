"""The vulnerability audit of requirements.lock (``python -m infra.audit``), with pip-audit.

The lock is audited as it is against PyPI's vulnerability data; a lock with a release that
has a known advisory fails the audit (status 1) naming it. That failure is shown against an
OSV API served here with one real advisory (PYSEC-2018-28: requests before 2.20.0 sends the
Authorization header across an https-to-http redirect), because the data service is the only
part this test does not own; pip-audit and the audit's classification run for real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from choreo.config import REPO_ROOT
from infra.audit import CLEAN, INCOMPLETE, LOCK, VULNERABLE, audit
from tests.helpers import free_port

pytestmark = pytest.mark.integration

ADVISORY = {
    "schema_version": "1.6.0",
    "id": "PYSEC-2018-28",
    "aliases": ["CVE-2018-18074", "GHSA-x84v-xcm2-53pg"],
    "summary": "Requests sends an HTTP Authorization header to an http URI upon a same-hostname "
               "https-to-http redirect",
    "published": "2018-10-09T00:29:00Z",
    "affected": [{"package": {"name": "requests", "ecosystem": "PyPI"},
                  "ranges": [{"type": "ECOSYSTEM", "events": [{"introduced": "0"}, {"fixed": "2.20.0"}]}]}],
}
VULNERABLE_PIN = ("requests==2.19.0 \\\n"
                  "    --hash=sha256:421cfc8d9dde7d6aff68196420afd86b88c65d77d8da9cf83f4ecad785d7b9d6\n")


class Osv(BaseHTTPRequestHandler):
    """The OSV query API (``POST /v1/query``) knowing one advisory."""

    def do_POST(self) -> None:
        query = json.loads(self.rfile.read(int(self.headers["content-length"])))
        hit = query["package"]["name"] == "requests" and tuple(map(int, query["version"].split(".")[:2])) < (2, 20)
        body = json.dumps({"vulns": [ADVISORY]} if hit else {}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture()
def osv(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Osv)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/query"
    monkeypatch.setenv("CHOREO_AUDIT_OSV_URL", url)
    yield url
    server.shutdown()
    server.server_close()


def test_a_lock_with_a_known_vulnerable_pin_fails_the_audit(osv: str, tmp_path: Path) -> None:
    """The project's lock with its ``requests`` pin moved back to 2.19.0."""
    lock = tmp_path / "requirements.lock"
    pinned = re.sub(r"^requests==.*?(?=^\S)", VULNERABLE_PIN, LOCK.read_text(), flags=re.M | re.S)
    assert VULNERABLE_PIN in pinned
    lock.write_text(pinned)
    result = audit(lock)
    assert result.status == VULNERABLE, result.report()
    assert [(f.name, f.version) for f in result.findings] == [("requests", "2.19.0")]
    assert "PYSEC-2018-28" in result.report() and "fixed in 2.20.0" in result.report()
    # the command the test run calls exits non-zero and says why
    done = subprocess.run([sys.executable, "-m", "infra.audit", str(lock)], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "CHOREO_AUDIT_OSV_URL": osv})
    assert done.returncode == VULNERABLE and "requests==2.19.0: PYSEC-2018-28" in done.stderr, done.stderr


def test_the_project_lock_is_clean_against_the_same_data(osv: str) -> None:
    result = audit(LOCK)
    assert result.status == CLEAN, result.report()
    assert result.audited > 50 and not result.unaudited


def test_a_pin_whose_data_cannot_be_fetched_is_never_reported_clean(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CHOREO_AUDIT_OSV_URL", f"http://127.0.0.1:{free_port()}/v1/query")  # nobody listens
    result = audit(LOCK)
    assert result.status == INCOMPLETE and not result.findings, result.report()


def test_the_lock_has_no_known_vulnerability_in_pypis_data() -> None:
    """The audit the test run exists for: the real lock against PyPI's vulnerability data."""
    result = audit(LOCK)
    assert result.status != VULNERABLE, result.report()
    if result.status == INCOMPLETE:
        pytest.skip("PyPI's vulnerability data could not be fetched here, nothing was audited: "
                    + result.report())
    assert result.status == CLEAN
