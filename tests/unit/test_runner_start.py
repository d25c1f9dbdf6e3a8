"""A starting instance waits out Redis briefly unreachable (a cluster's failover) instead of
dying at its start; a call failing on what it was given still stops it at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from choreo import runner as runner_module
from choreo.runner import Runner


def _runner(hook: Any) -> Any:
    runner: Any = object.__new__(Runner)
    runner.service = SimpleNamespace(startup=[hook])
    runner.log = SimpleNamespace(warning=lambda *a, **k: None)
    runner.redis = object()
    return runner


def test_a_master_failing_over_at_the_start_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module.layout, "claim", lambda client: None)
    monkeypatch.setattr(runner_module.time, "sleep", lambda s: None)
    tries: list[int] = []

    def grow(client: Any) -> None:  # a pool's growth, as the drone scheduler starts
        tries.append(1)
        if len(tries) < 3:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:16402. Connection refused.")

    _runner(grow)._prepare_state()
    assert len(tries) == 3


def test_a_call_refused_for_its_arguments_stops_the_start_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module.layout, "claim", lambda client: None)
    tries: list[int] = []

    def broken(client: Any) -> None:
        tries.append(1)
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    with pytest.raises(ResponseError):
        _runner(broken)._prepare_state()
    assert len(tries) == 1


def test_redis_gone_past_the_wait_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module.layout, "claim", lambda client: None)
    monkeypatch.setattr(runner_module, "STARTUP_REDIS_WAIT_S", 0.0)

    def down(client: Any) -> None:
        raise RedisConnectionError("Connection refused.")

    with pytest.raises(RedisConnectionError):
        _runner(down)._prepare_state()
