"""``choreo up``'s configuration: the shipped example loads, ids are stable and unique
across hosts, and a wrong file is one clear sentence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from choreo.service import load_service
from choreo.workflow import load_workflow
from infra import up


def test_the_shipped_drone_config_runs_every_service_of_the_workflow() -> None:
    config = up.load(up.DEFAULT_CONFIG)
    flow = load_workflow(config.workflow)
    named = {s.name: load_service(s.ref).name for s in config.services}
    assert set(named) == set(named.values()) == {s.name for s in flow.services}
    assert config.ingestion_url and config.environment["KAFKA_BOOTSTRAP_SERVERS"]
    assert config.backoff == up.Backoff(1.0, 30.0, 60.0)


@pytest.mark.parametrize(("hostname", "expected"), [
    ("drone-0", 0), ("drone-pipeline-3", 3), ("worker", 0), ("node-12", 12), ("box7", 0)])
def test_the_ordinal_is_the_number_ending_a_statefulset_host_name(
        hostname: str, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(up.ORDINAL_ENV, raising=False)
    assert up.ordinal(hostname=hostname) == expected


def test_an_explicit_ordinal_wins_over_the_environment_and_the_host_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(up.ORDINAL_ENV, "5")
    assert up.ordinal(hostname="drone-2") == 5
    assert up.ordinal(4, hostname="drone-2") == 4
    monkeypatch.setenv(up.ORDINAL_ENV, "five")
    with pytest.raises(up.ConfigError, match="CHOREO_ORDINAL"):
        up.ordinal(hostname="drone-2")


def test_instance_ids_are_unique_across_hosts_and_the_same_after_a_restart() -> None:
    service = up.ServiceConfig("package", "consumers.package:service", 2, {})
    hosts = [up.instance_ids(service, n) for n in range(3)]
    assert hosts == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert up.instance_ids(service, 1) == hosts[1]


@pytest.mark.parametrize(("text", "complaint"), [
    ("workflow = 'x:y'", "no [services.<name>] table"),
    ("[services.a]\ninstances = 2", "needs ref"),
    ("[services.a]\nref = 'm:s'\ninstances = 0", "instances must be"),
    ("[services.a]\nref = 'm:s'\n[services.a.environment]\nX = [1]", "values must be"),
    ("[services", "not valid TOML"),
    ("[services.ingestion]\nref = 'm:s'", "the [ingestion] server's"),
    ("[services.a]\nref = 'm:s'\n[restart]\nmax = 3", "[restart] knows"),
    ("[services.a]\nref = 'm:s'\n[restart]\nmax_s = 'long'", "values are seconds"),
    ("[services.a]\nref = 'm:s'\nenvironment = 3", "[services.a.environment] must be a table"),
])
def test_a_wrong_config_is_refused_with_the_reason(text: str, complaint: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(up.ConfigError, match=complaint.replace("[", r"\[").replace(".", r"\.")):
        up.load(path)


def test_the_files_environment_is_a_default_the_hosts_environment_overrides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.toml"
    path.write_text("[environment]\nUP_TEST_A = 'file'\nUP_TEST_B = 'file'\n"
                    "[services.a]\nref = 'm:s'\n")
    monkeypatch.setenv("UP_TEST_A", "host")
    monkeypatch.delenv("UP_TEST_B", raising=False)
    up.apply_environment(up.load(path))
    assert (os.environ["UP_TEST_A"], os.environ["UP_TEST_B"]) == ("host", "file")
    monkeypatch.delenv("UP_TEST_B")


def test_values_take_the_hosts_variables_and_refuse_an_unset_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "vars.toml"
    path.write_text('[ingestion]\nurl = "http://${UP_TEST_IP}:${UP_TEST_PORT:-8000}"\n'
                    '[services.a]\nref = "m:s"\n[services.a.environment]\nZONE = "${UP_TEST_ZONE:-eu}-1"\n')
    monkeypatch.setenv("UP_TEST_IP", "10.1.2.3")
    monkeypatch.delenv("UP_TEST_PORT", raising=False)
    monkeypatch.delenv("UP_TEST_ZONE", raising=False)
    config = up.load(path)
    assert config.ingestion_url == "http://10.1.2.3:8000"
    assert config.services[0].environment == {"ZONE": "eu-1"}
    monkeypatch.delenv("UP_TEST_IP")
    with pytest.raises(up.ConfigError, match=r"\$\{UP_TEST_IP\} is not set"):
        up.load(path)
