"""A registry that accepts connections and never answers must not stall a consumer: the
decoder's and the encoder's lookups give up within a bound and say the registry is
unavailable (the batch is then retried), where the registry client's default waits for ever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from choreo import serde
from choreo.config import settings
from choreo.serde import Decoder, Encoder, RegistryUnavailable
from schemas.models import PackageReady

TIMEOUT_S = 0.5


@contextmanager
def silent_registry() -> Iterator[str]:
    """A TCP server on loopback that takes every connection and never sends a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.fixture()
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CHOREO_REGISTRY_TIMEOUT_S", str(TIMEOUT_S))
    settings.cache_clear()
    serde.forget_registry_clients()
    yield
    serde.forget_registry_clients()
    settings.cache_clear()


@pytest.mark.parametrize("side", ["decoder", "encoder"])
def test_a_registry_that_never_answers_is_unavailable_within_the_bound(short_timeout: None, side: str) -> None:
    with ThreadPoolExecutor(1) as pool, silent_registry() as url:  # the server ends first
        client = serde.registry_client(url)
        if side == "decoder":
            decoder = Decoder(PackageReady, "package.ready", client)
            value = b"\x00" + (42).to_bytes(4, "big") + b"\x00"  # a schema id it has not cached
            call = lambda: decoder(value)  # noqa: E731
        else:
            encoder = Encoder(PackageReady, "package.ready", client)
            event = PackageReady(delivery_id="d", package_id="p", package_size="S", weight_kg=1.0,
                                 ready_at=datetime.now(UTC))
            call = lambda: encoder(event)  # noqa: E731
        started = time.monotonic()
        lookup = pool.submit(call)
        with pytest.raises(RegistryUnavailable):
            lookup.result(timeout=15)  # a TimeoutError here: the lookup hangs
        # every try's timeout and the short waits between them
        tries = serde.REGISTRY_RETRIES + 1
        assert time.monotonic() - started < tries * TIMEOUT_S + (tries - 1) * serde.REGISTRY_RETRY_MAX_WAIT_MS / 1000 + 1
