"""Outcome webhooks on the real stack: a local HTTP receiver per owner gets each delivery's
outcome, signed, with an id it dedupes by; a receiver failing N times gets it on try N+1;
one that never answers well ends in a dead letter with its reason, one that never ends its
answer too; a bad signature shows."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from choreo import topology
from choreo.webhooks import H_ID, H_SIGNATURE, H_TIMESTAMP, sign
from consumers.workflow import WORKFLOW
from tests.factories import delivery_request
from tests.helpers import ServiceProcess, free_port, read_topic, start_group_at_end, wait_for
from tests.pipeline import Pipeline, of, submit, wait_terminal

pytestmark = pytest.mark.integration

FAILS = 2  # the flaky receiver refuses each outcome this many times first


@dataclass
class Receiver:
    """Every POST as it came: per path (one per owner), the id, timestamp, signature, body."""

    posts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: threading.Event = field(default_factory=threading.Event)  # the stalling answers end

    def answer(self, path: str, delivery_id: str) -> int:
        with self.lock:
            tries = sum(1 for p in self.posts[path] if p["body"]["delivery_id"] == delivery_id)
        if path == "/dead":
            return 500
        if path == "/flaky" and tries <= FAILS:
            return 503
        return 204

    def by_delivery(self, path: str) -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = defaultdict(list)
        with self.lock:
            for post in self.posts[path]:
                found[post["body"]["delivery_id"]].append(post)
        return found


@pytest.fixture()
def receiver() -> Iterator[tuple[Receiver, int]]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            body = json.loads(raw)
            with got.lock:
                got.posts[self.path].append({"id": self.headers[H_ID], "ts": self.headers[H_TIMESTAMP],
                                             "sig": self.headers[H_SIGNATURE], "raw": raw, "body": body})
            if self.path in ("/continue", "/drip"):  # a hostile receiver: it never ends its answer
                stall = b"HTTP/1.1 100 Continue\r\n\r\n" if self.path == "/continue" else b"H"
                while not got.closing.wait(0.5):
                    self.wfile.write(stall)
                    self.wfile.flush()
                return
            self.send_response(got.answer(self.path, body["delivery_id"]))
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield got, port
    got.closing.set()
    server.shutdown()
    server.server_close()


def test_each_owner_gets_one_signed_outcome_per_delivery_retries_then_dead_letters(
        receiver: tuple[Receiver, int], tmp_path: Path, unique: str) -> None:
    got, port = receiver
    owners = {f"ok-{unique}": "/ok", f"flaky-{unique}": "/flaky", f"dead-{unique}": "/dead"}
    secrets = {owner: f"secret-{owner}-{i}".encode() for i, owner in enumerate(owners)}
    config = {}
    for owner, path in owners.items():
        secret_file = tmp_path / f"{owner}.secret"
        secret_file.write_bytes(secrets[owner])
        secret_file.chmod(0o600)
        config[owner] = {"url": f"http://127.0.0.1:{port}{path}", "secret_file": str(secret_file), "internal": True}
    hooks = tmp_path / "webhooks.json"
    hooks.write_text(json.dumps(config))
    topology.create(WORKFLOW)
    for topic in ("delivery.shipped", "delivery.failed", "compensation.log"):  # a new subscriber starts at the end
        start_group_at_end("webhooks", topic)
    env = {"WEBHOOKS_FILE": str(hooks), "WEBHOOK_COOLDOWN_S": "60"}
    running = Pipeline().start()
    hook = ServiceProcess("choreo.webhooks:service", env=env).start()
    running.procs.append(hook)
    try:
        ok = [delivery_request(owner_id=f"ok-{unique}") for _ in range(20)]
        ok += [delivery_request(owner_id=f"ok-{unique}", weight_kg=99.0) for _ in range(3)]  # compensated
        flaky = [delivery_request(owner_id=f"flaky-{unique}") for _ in range(3)]
        dead = [delivery_request(owner_id=f"dead-{unique}") for _ in range(3)]
        ids = set(submit(ok[:10]))
        wait_for(lambda: got.by_delivery("/ok"), timeout_s=60, what="the first webhook")
        hook.kill()  # kill -9 mid-run: what it posted and did not commit is posted again, same id
        ids |= set(submit(ok[10:] + flaky + dead))
        running.procs.append(ServiceProcess("choreo.webhooks:service", instance="1", env=env).start())
        wait_terminal(ids, timeout_s=180)
        ok_ids = {r.delivery_id for r in ok}
        posted = wait_for(lambda: set(p := got.by_delivery("/ok")) >= ok_ids and p, timeout_s=60,
                          what="every ok outcome posted")
        assert set(posted) == ok_ids
        for delivery_id, posts in posted.items():
            assert len({p["id"] for p in posts}) == 1  # one id per delivery: the receiver dedupes
            for post in posts:
                assert hmac.compare_digest(post["sig"], sign(secrets[f"ok-{unique}"], post["ts"], post["raw"]))
        outcomes = {d: posts[0]["body"]["outcome"] for d, posts in posted.items()}
        # a failure whose package was cancelled is told once, compensated, as on the reply topic
        assert sorted(outcomes.values()).count("compensated") == 3
        assert set(outcomes.values()) == {"shipped", "compensated"}

        # a receiver failing N times gets the outcome on try N + 1
        flaky_ids = {r.delivery_id for r in flaky}
        tries = wait_for(lambda: set(t := got.by_delivery("/flaky")) == flaky_ids
                         and all(len(v) == FAILS + 1 for v in t.values()) and t, timeout_s=60,
                         what="the flaky receiver served on its third try")
        assert all(len({p["id"] for p in v}) == 1 for v in tries.values())

        # a receiver that never answers well: dead letters with their reasons
        dead_ids = {r.delivery_id for r in dead}
        letters = wait_for(lambda: {(r.key or b"").decode(): r for r in of(read_topic("delivery.shipped.dlq"), dead_ids)
                                    if r.header("dlq.service") == "webhooks"} or None, timeout_s=90,
                           what="the dead receiver's outcomes dead-lettered")
        letters = wait_for(lambda: len(x := {(r.key or b"").decode(): r for r in of(read_topic("delivery.shipped.dlq"), dead_ids)
                                             if r.header("dlq.service") == "webhooks"}) == 3 and x, timeout_s=90,
                           what="all three dead-lettered")
        reasons = [r.header("dlq.error") or "" for r in letters.values()]
        assert any("receiver answered 500" in why for why in reasons)
        assert all("receiver answered 500" in why or "cooling down" in why for why in reasons)
        assert len(got.by_delivery("/dead")) >= 1  # it was tried, within its budget only
        assert all(len(v) <= 4 for v in got.by_delivery("/dead").values())

        # a bad signature is detectable: another secret, or a body changed on the way
        post = next(iter(posted.values()))[0]
        assert not hmac.compare_digest(post["sig"], sign(b"not-the-secret", post["ts"], post["raw"]))
        tampered = post["raw"].replace(b'"outcome":"', b'"outcome":"x')
        assert not hmac.compare_digest(post["sig"], sign(secrets[f"ok-{unique}"], post["ts"], tampered))
        assert post["sig"] == "sha256=" + hmac.new(secrets[f"ok-{unique}"], post["ts"].encode() + b"." + post["raw"],
                                                   hashlib.sha256).hexdigest()
        assert abs(int(post["ts"]) - time.time()) < 600
        log = hook.log_file.read_text(errors="replace")
        assert not any(s.decode() in log for s in secrets.values())  # never logged
    finally:
        running.kill()


def _configured(owners: dict[str, str], port: int, tmp_path: Path, outside: str = "") -> Path:
    """The operator's webhooks file: each owner's path on the receiver, with a secret; the
    receiver is on loopback, so each endpoint is marked internal but ``outside``'s."""
    config = {}
    for i, (owner, path) in enumerate(owners.items()):
        secret_file = tmp_path / f"{owner}.secret"
        secret_file.write_bytes(f"secret-{i}".encode())
        secret_file.chmod(0o600)
        config[owner] = {"url": f"http://127.0.0.1:{port}{path}", "secret_file": str(secret_file),
                         "internal": owner != outside}
    hooks = tmp_path / "webhooks.json"
    hooks.write_text(json.dumps(config))
    return hooks


def test_a_receiver_that_never_ends_its_answer_holds_no_outcome_of_another_owner(
        receiver: tuple[Receiver, int], tmp_path: Path, unique: str) -> None:
    """Two receivers that answer ``100 Continue`` every half second, or their head a byte at
    a time, for ever: each read came within httpx's read timeout, so a try never ended, the
    batch never did, and no owner behind them was told anything. Each try now ends within
    its timeout in all: their outcomes are dead-lettered and the other owners' are posted.
    An endpoint not marked internal reaches no loopback address (its name could resolve to
    one, or to a cloud's metadata service): its outcome is dead-lettered unsent."""
    got, port = receiver
    owners = {f"ok-{unique}": "/ok", f"continue-{unique}": "/continue", f"drip-{unique}": "/drip",
              f"outside-{unique}": "/outside"}
    hooks = _configured(owners, port, tmp_path, outside=f"outside-{unique}")
    topology.create(WORKFLOW)
    for topic in ("delivery.shipped", "delivery.failed", "compensation.log"):
        start_group_at_end("webhooks", topic)
    running = Pipeline().start()
    hook = ServiceProcess("choreo.webhooks:service", env={"WEBHOOKS_FILE": str(hooks), "WEBHOOK_MAX_TRIES": "2",
                                                          "WEBHOOK_BATCH_SIZE": "2"}).start()
    running.procs.append(hook)
    try:
        stalling = [delivery_request(owner_id=f"{kind}-{unique}") for kind in ("continue", "drip", "outside")]
        ok = [delivery_request(owner_id=f"ok-{unique}") for _ in range(3)]
        ids = set(submit(stalling + ok))
        wait_terminal(ids, timeout_s=120)
        ok_ids = {r.delivery_id for r in ok}
        wait_for(lambda: set(got.by_delivery("/ok")) == ok_ids, timeout_s=60, what="the other owner's outcomes")
        stalled_ids = {r.delivery_id for r in stalling}
        letters = wait_for(lambda: len(x := {(r.key or b"").decode(): r for r in of(read_topic("delivery.shipped.dlq"),
                                                                                     stalled_ids)
                                             if r.header("dlq.service") == "webhooks"}) == 3 and x,
                           timeout_s=60, what="the stalling and the outside receivers' outcomes dead-lettered")
        errors = [r.header("dlq.error") or "" for r in letters.values()]
        assert sum("network: ReadTimeout" in why for why in errors) == 2
        assert sum("network: ConnectError" in why for why in errors) == 1, errors
        assert all(len(got.by_delivery(path)) == 1 for path in ("/continue", "/drip"))  # tried, not forgotten
        assert not got.by_delivery("/outside")  # never reached
        assert hook.alive()
    finally:
        running.kill()
