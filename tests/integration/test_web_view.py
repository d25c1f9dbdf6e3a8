"""The operators' live view in a real browser (Debian's chromium driven by Playwright) while
a pipeline runs on the real stack.

The pipeline is the ops tests' isolated one (the real business rules on this test's own
topics, groups and Redis: ``test_ops_pipeline``), deadlines shortened
(``CHOREO_DEADLINE_SCALE``); ``choreo ops web`` runs as its own process with an operator
token. The page must draw the flow with non-zero rates, open a searched delivery's timeline,
redrive dead letters for a signed-in operator, and show a stopped service as lag and stuck
deliveries; a screenshot is kept
(``.artifacts/web-view.png``).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Producer
from playwright.sync_api import Page, sync_playwright

from choreo.config import settings
from choreo.envelope import Envelope, now_ms
from choreo.publisher import Publisher
from choreo.state import StateTable, index_member
from choreo.supervision import awaiting_operator_index
from tests.factories import delivery_request
from tests.helpers import REPO, free_port, wait_for
from infra.tls import ensure_certificates
from tests.integration.test_ops_pipeline import IsolatedPipeline, isolated, private_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
TOKEN = "op-" + uuid.uuid4().hex + uuid.uuid4().hex[:8]
SCALE = "0.2"  # the package step's 30 s deadline becomes 6 s


class Submitter(threading.Thread):
    """A steady trickle of deliveries into the isolated pipeline until stopped."""

    def __init__(self, pipeline: IsolatedPipeline, per_second: float = 6.0) -> None:
        super().__init__(daemon=True)
        self.pipeline, self.pause = pipeline, 1.0 / per_second
        self.ids: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        publisher = Publisher("test", self.pipeline.flow, redis_client=self.pipeline.client)
        while not self.done.is_set():
            request = delivery_request()
            publisher.publish(request, str(uuid.uuid4()), topic=self.pipeline.prefix + "delivery.requested")
            publisher.flush(30)
            self.ids.append(request.delivery_id)
            self.done.wait(self.pause)


@pytest.fixture()
def running(isolated: IsolatedPipeline, monkeypatch: pytest.MonkeyPatch) -> Iterator[IsolatedPipeline]:  # noqa: F811
    monkeypatch.setenv("CHOREO_DEADLINE_SCALE", SCALE)  # the steps this process opens
    isolated.env = {"CHOREO_DEADLINE_SCALE": SCALE, "OPS_BATCH": "20"}
    yield isolated.start()


@pytest.fixture()
def web(running: IsolatedPipeline) -> Iterator[str]:
    """``choreo ops web`` on the pipeline's workflow and Redis, with one operator token."""
    with serving_web({**running._env(), "CHOREO_DEADLINE_SCALE": SCALE}, "tests.services.ops_pipeline:WORKFLOW") as url:
        yield url


@contextmanager
def serving_web(env: dict[str, str], workflow: str, scheme: str = "http", verify: str | bool = True) -> Iterator[str]:
    """``choreo ops web`` as its own process, with one operator token, until the block ends."""
    port = free_port()
    log_path = REPO / ".stack" / "test-logs" / f"ops-web-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "ops", "web", "--workflow", workflow,
                                 "--port", str(port), "--interval", "1"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "CHOREO_OPS_TOKENS": f"{TOKEN}=alice"})
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url, verify), timeout_s=30, interval_s=0.3, what="the live view to serve")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str, verify: str | bool = True) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


def _poison(topic: str) -> None:
    """An event with the runtime's envelope and a value no schema decodes."""
    envelope = Envelope.first(str(uuid.uuid4()), str(uuid.uuid4()), "DeliveryRequested", "test")
    producer = Producer({"bootstrap.servers": settings().kafka_bootstrap_servers})
    producer.produce(topic, key=envelope.correlation_id.encode(), value=b"\xff\xfe not avro",
                     headers=envelope.to_headers())
    producer.flush(10)


def _number(page: Page, selector: str, attribute: str) -> float:
    found = page.locator(selector)
    return float(found.first.get_attribute(attribute) or 0) if found.count() else 0.0


def test_the_live_view_shows_the_flow_a_stopped_service_and_a_timeline(running: IsolatedPipeline, web: str,
                                                                       tmp_path: Path) -> None:
    prefix = running.prefix
    package = f'g.node.service[data-name="{prefix}package"]'
    submitter = Submitter(running)
    submitter.start()
    try:
        shipped = wait_for(lambda: running.terminal(set(submitter.ids)), timeout_s=90, interval_s=1,
                           what="the first deliveries to end")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(web)
            page.fill("#token", TOKEN)  # every page needs a token: the view sent us to sign in
            page.click("button[type=submit]")
            page.wait_for_selector("svg#flow")

            # the flow from the declarations, with what flows through it now
            for role in ("package", "drone-scheduler", "delivery", "notifier"):
                assert page.locator(f'g.node.service[data-name="{prefix}{role}"]').count() == 1
            into_package = f'g.arrow.consume[data-source="t:{prefix}delivery.requested"][data-target="s:{prefix}package"]'
            wait_for(lambda: _number(page, into_package, "data-rate") > 0, timeout_s=30, interval_s=0.5,
                     what="a non-zero rate into the package service")
            published = f'g.arrow.publish[data-target="t:{prefix}delivery.requested"]'
            assert _number(page, published, "data-rate") > 0
            assert page.locator("g.arrow.busy").count() >= 4

            # a searched delivery opens its timeline
            delivery_id = next(iter(shipped))
            page.fill("#delivery", delivery_id)
            page.click("#search button")
            page.wait_for_selector("#timeline-id", timeout=60_000)
            assert page.inner_text("#timeline-id") == delivery_id
            types = [page.locator("#timeline .hop").nth(i).get_attribute("data-type")
                     for i in range(page.locator("#timeline .hop").count())]
            assert types[0] == "DeliveryRequested" and types[-1] == "DeliveryShipped"
            assert {"PackageReady", "DroneScheduled"} <= set(types)

            # a poison event is dead-lettered by both services that read it; an operator redrives them
            dlq_row = f'#dead-letters tr[data-topic="{prefix}delivery.requested.dlq"][data-reason="UNDECODABLE"]'
            _poison(prefix + "delivery.requested")
            wait_for(lambda: page.locator(dlq_row).count() and page.inner_text(f"{dlq_row} td.count") == "2",
                     timeout_s=60, interval_s=0.5, what="the poison event's two dead letters on the page")
            page.once("dialog", lambda dialog: dialog.accept())
            page.click(f"{dlq_row} button.redrive")
            page.wait_for_selector("#redrive-result .done", timeout=60_000)
            assert "redriven 2, skipped 0" in page.inner_text("#redrive-result")
            # the answer stays through the view's next refreshes
            with page.expect_response(lambda response: response.url.endswith("/live")):
                pass
            page.wait_for_timeout(2_500)
            assert "redriven 2, skipped 0" in page.inner_text("#redrive-result")

            # an undo failed for good waits for an operator: listed, its error shown as text
            waiting = str(uuid.uuid4())
            StateTable(running.client).put(waiting, {"outcome": "failed", "package.status": "compensation_failed",
                                                     "package.error": "<script>window.pwned = 1</script> [/b]"})
            running.client.zadd(awaiting_operator_index(waiting), {index_member(waiting, "package"): now_ms() - 60_000})
            awaiting = 'table.steps[data-kind="waiting for an operator"] tr'
            wait_for(lambda: page.locator(awaiting, has_text=waiting).count() == 1, timeout_s=30, interval_s=0.5,
                     what="the undo waiting for an operator on the page")
            assert page.inner_text("#awaiting-operator") == "1"
            assert "<script>window.pwned = 1</script> [/b]" in page.inner_text(f"{awaiting} td.error")
            waited = page.locator(f"{awaiting} td", has_text=re.compile(r"^\d+ s$")).inner_text()
            assert int(waited.split()[0]) >= 60  # listed a minute ago
            assert page.evaluate("window.pwned") is None

            # the package service stops: its group falls behind and its steps pass their deadline
            [proc] = [p for p in running.procs if p.ref.endswith(":package")]
            proc.stop()
            wait_for(lambda: _number(page, package, "data-lag") > 0 and _number(page, package, "data-stuck") > 0,
                     timeout_s=60, interval_s=0.5, what="the stopped package service to show lag and stuck steps")
            assert int(page.inner_text("#stuck")) > 0
            assert page.locator(f'#lag tr[data-group="{prefix}package"]').get_attribute("data-lag") != "0"
            assert page.locator('table.steps[data-kind="stuck past deadline"] td', has_text="package").count() > 0

            shot = tmp_path / "web-view.png"
            page.screenshot(path=str(shot), full_page=True)
            kept = REPO / ".artifacts" / "web-view.png"
            kept.parent.mkdir(exist_ok=True)
            shutil.copyfile(shot, kept)
            print(f"screenshot: {shot} (kept as {kept})")
            browser.close()
    finally:
        submitter.done.set()
        submitter.join(30)


def test_the_live_view_refuses_strangers_and_cross_site_changes(running: IsolatedPipeline, web: str) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=web, timeout=30) as client:
        assert client.get("/").status_code == 303  # to /login
        assert client.get("/live", headers={"HX-Request": "true"}).status_code == 401
        assert client.get("/", headers={"Authorization": "Bearer " + "x" * 40}).status_code == 303
        assert client.get("/", headers={"Host": "rebound.example"}).status_code == 421  # DNS rebinding
        assert client.get("/live", headers=bearer).status_code == 200
        assert client.get("/timeline", params={"delivery": "'; drop"}, headers=bearer).status_code == 422
        assert client.post("/dead-letters/redrive", data={"topic": "x", "reason": "Y"}).status_code == 401
        cross_site = {**bearer, "Origin": "https://elsewhere.example", "Sec-Fetch-Site": "cross-site"}
        assert client.post("/dead-letters/redrive", data={"topic": "x"}, headers=cross_site).status_code == 403
        assert client.post("/dead-letters/redrive", content=b"a=" + b"x" * 5000, headers={
            **bearer, "Content-Type": "application/x-www-form-urlencoded"}).status_code == 413
        assert client.post("/dead-letters/redrive", data={"topic": "x", "reason": "Y"},
                           headers=bearer).status_code == 422  # nothing the page shows
        # a signed-in browser: the cookie alone does not make a change, its CSRF token must come too
        signed_in = client.post("/login", data={"token": TOKEN})
        assert signed_in.status_code == 303 and "samesite=strict" in signed_in.headers["set-cookie"].lower()
        assert "secure" not in signed_in.headers["set-cookie"].lower()  # plain HTTP: it would never come back
        assert TOKEN not in signed_in.headers["set-cookie"]
        assert client.get("/").status_code == 200
        assert client.post("/dead-letters/redrive", data={"topic": "x", "reason": "Y"}).status_code == 403
        assert client.post("/login", data={"token": "wrong-" + "y" * 30}).status_code == 401


def test_over_https_the_session_cookie_is_secure(stack: None, tmp_path: Path) -> None:
    """Served with its own TLS certificate, the view marks its session cookie ``Secure``, so a
    browser never sends it over plain HTTP; signing out clears it the same way."""
    tls = ensure_certificates(tmp_path / "tls")
    env = {"CHOREO_HTTP_TLS_CERT_FILE": str(tls.server_cert), "CHOREO_HTTP_TLS_KEY_FILE": str(tls.server_key)}
    with serving_web(env, "consumers.workflow:WORKFLOW", "https", str(tls.ca_cert)) as url, \
            httpx.Client(base_url=url, timeout=30, verify=str(tls.ca_cert)) as client:
        signed_in = client.post("/login", data={"token": TOKEN})
        assert signed_in.status_code == 303
        cookie = [part.strip().lower() for part in signed_in.headers["set-cookie"].split(";")]
        assert {"secure", "httponly", "samesite=strict"} <= set(cookie)
        page = client.get("/")
        assert page.status_code == 200  # the cookie came back, over HTTPS
        csrf = re.search(r'"x-csrf-token": "([^"]+)"', html.unescape(page.text))
        assert csrf is not None
        signed_out = client.post("/logout", headers={"x-csrf-token": csrf.group(1), "Origin": url})
        assert signed_out.status_code == 204
        assert "secure" in [part.strip().lower() for part in signed_out.headers["set-cookie"].split(";")]
