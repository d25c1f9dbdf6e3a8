"""``choreo up``: the whole workflow on one host, from one configuration file.

The file (TOML) names the workflow, each service with its module:attr and instance count,
the ingestion server, and the environment of every process; the same file serves every
host of a multi-host deployment. Instance ids are stable: the host's ordinal (``--ordinal``,
else ``CHOREO_ORDINAL``, else the number a StatefulSet puts at the end of the host name,
``drone-2`` → 2) times the service's instance count, plus the instance's index on the host.
So host 0 of a two-instance service runs ``0`` and ``1``, host 1 runs ``2`` and ``3``, and a
process restarted anywhere keeps its transactional id (``<service>-<instance>``), which
fences the zombie it replaces.

A process that exits is started again after a back-off that doubles up to a ceiling and
starts over once a process has stayed up long enough. The supervisor writes what it sees
to a state file that ``choreo up status`` reads; SIGTERM or Ctrl-C stops intake first (the
ingestion server), then every service at once, each draining as ``choreo run`` does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from choreo.config import REPO_ROOT, settings
from infra.process import ManagedProcess, StackError, describe_exit, pid_alive, stop_all
from infra.services import ServiceSpec, ingestion_process, service_process

DEFAULT_CONFIG = REPO_ROOT / "deploy" / "drone.toml"
ORDINAL_ENV = "CHOREO_ORDINAL"


class ConfigError(StackError):
    """The configuration file cannot be used; the message says where and why."""


@dataclass(frozen=True)
class ServiceConfig:
    name: str
    ref: str
    instances: int
    environment: dict[str, str]


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``initial_s`` doubling up to ``max_s``; back to ``initial_s`` after a
    process stayed up ``stable_s``."""

    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0


@dataclass(frozen=True)
class UpConfig:
    path: Path
    workflow: str
    services: list[ServiceConfig]
    environment: dict[str, str]
    ingestion_url: str | None  # None: this host runs no ingestion server
    ingestion_environment: dict[str, str]
    backoff: Backoff

    @property
    def name(self) -> str:
        return self.path.stem


def load(path: Path) -> UpConfig:
    """Read and check the configuration file; a mistake is one sentence naming it."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    services = raw.get("services")
    if not isinstance(services, dict) or not services:
        raise ConfigError(f"{path}: no [services.<name>] table")
    ingestion = _table(raw, "ingestion", path)
    restart = _table(raw, "restart", path)
    return UpConfig(
        path=path,
        workflow=str(raw.get("workflow", "consumers.workflow:WORKFLOW")),
        services=[_service(name, body, path) for name, body in services.items()],
        environment=_environment(raw, path, "environment"),
        ingestion_url=_expand(str(ingestion["url"]), path) if ingestion.get("url") else None,
        ingestion_environment=_environment(ingestion, path, "ingestion.environment"),
        backoff=_backoff(restart, path),
    )


def _backoff(restart: dict[str, Any], path: Path) -> Backoff:
    unknown = set(restart) - set(Backoff.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"{path}: [restart] knows {', '.join(Backoff.__dataclass_fields__)}, "
                          f"not {', '.join(sorted(unknown))}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in restart.values()):
        raise ConfigError(f"{path}: [restart] values are seconds, numbers above 0")
    return Backoff(**{k: float(v) for k, v in restart.items()})


def _table(raw: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: [{key}] must be a table")
    return value


def _environment(raw: dict[str, Any], path: Path, where: str) -> dict[str, str]:
    env = raw.get("environment", {})
    if not isinstance(env, dict):
        raise ConfigError(f"{path}: [{where}] must be a table")
    bad = [k for k, v in env.items() if not isinstance(v, (str, int, float, bool))]
    if bad:
        raise ConfigError(f"{path}: [{where}] {', '.join(bad)}: values must be strings or numbers")
    return {k: _expand(str(v).lower() if isinstance(v, bool) else str(v), path) for k, v in env.items()}


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _expand(value: str, path: Path) -> str:
    """``${NAME}`` and ``${NAME:-default}`` from the host's environment, so one file can
    name what differs by host (its address, say); an unset variable without a default is
    refused rather than left in."""
    def one(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(f"{path}: ${{{name}}} is not set in the environment")
        return default

    return _VARIABLE.sub(one, value)


def _service(name: str, body: Any, path: Path) -> ServiceConfig:
    if not isinstance(body, dict) or not isinstance(body.get("ref"), str) or ":" not in body["ref"]:
        raise ConfigError(f"{path}: [services.{name}] needs ref = \"module:attr\"")
    instances = body.get("instances", 1)
    if not isinstance(instances, int) or instances < 1:
        raise ConfigError(f"{path}: [services.{name}] instances must be a whole number ≥ 1")
    if name == "ingestion":
        raise ConfigError(f"{path}: [services.ingestion]: that name is the [ingestion] server's")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"{path}: service name {name!r} may hold letters, digits, '.', '_', '-' only")
    return ServiceConfig(name, body["ref"], instances, _environment(body, path, f"services.{name}.environment"))


def ordinal(explicit: int | None = None, hostname: str | None = None) -> int:
    """This host's ordinal: given, else ``CHOREO_ORDINAL``, else a StatefulSet host name's
    trailing ``-<n>``, else 0."""
    if explicit is not None:
        return explicit
    if os.environ.get(ORDINAL_ENV, "").strip():
        try:
            return int(os.environ[ORDINAL_ENV])
        except ValueError:
            raise ConfigError(f"{ORDINAL_ENV}={os.environ[ORDINAL_ENV]!r} is not a whole number") from None
    host = hostname if hostname is not None else os.environ.get("HOSTNAME") or socket.gethostname()
    match = re.search(r"-(\d+)$", host)
    return int(match.group(1)) if match else 0


def instance_ids(service: ServiceConfig, host_ordinal: int) -> list[str]:
    """The ids this host runs for ``service``: unique across hosts, the same after a restart."""
    first = host_ordinal * service.instances
    return [str(first + i) for i in range(service.instances)]


def workdir(config_path: Path) -> Path:
    """Pid, log and state files of one configuration, apart from the demo's and the tests'.
    Named by the file alone, so status and stop need not read it."""
    return settings().data_dir / "up" / config_path.stem


@dataclass
class Member:
    """One process ``up`` keeps running, and what happened to it."""

    proc: ManagedProcess
    service: str
    instance: str
    state: str = "starting"  # starting | running | backoff | stopped
    pid: int | None = None
    restarts: int = 0
    last_exit: str = ""
    started_at: float = 0.0  # wall clock of the last start
    delay_s: float = 0.0
    due: float = 0.0  # monotonic time of the next start attempt
    _started_mono: float = field(default=0.0, repr=False)

    def view(self) -> dict[str, Any]:
        return {"name": self.proc.name, "service": self.service, "instance": self.instance,
                "state": self.state, "pid": self.pid, "restarts": self.restarts,
                "last_exit": self.last_exit, "started_at": self.started_at,
                "log": str(self.proc.log_file)}


def members(config: UpConfig, host_ordinal: int) -> list[Member]:
    """Every process this host runs: the ingestion server first (stopped first), then each
    instance of each service."""
    where = workdir(config.path)
    found = []
    if config.ingestion_url:
        found.append(Member(ingestion_process(config.ingestion_url, config.ingestion_environment,
                                              workdir=where), "ingestion", str(host_ordinal)))
    for service in config.services:
        for instance in instance_ids(service, host_ordinal):
            spec = ServiceSpec(service.name, service.ref, instance)
            found.append(Member(service_process(spec, service.environment, workdir=where,
                                                workflow=config.workflow), service.name, instance))
    return found


Say = Callable[[str], None]


class Supervisor:
    """Starts every member, restarts the ones that exit, and stops them all on request."""

    def __init__(self, config: UpConfig, host_ordinal: int, say: Say, tick_s: float = 0.5) -> None:
        self.config = config
        self.ordinal = host_ordinal
        self.members = members(config, host_ordinal)
        self.say = say
        self.tick_s = tick_s
        self.dir = workdir(config.path)
        self.stopping = threading.Event()

    @property
    def pid_file(self) -> Path:
        return self.dir / "up.pid"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    def run(self, on_tick: Callable[[], None] | None = None) -> None:
        """Until SIGTERM/SIGINT (or ``stopping`` is set): keep every member running."""
        self._claim()
        previous = {sig: signal.signal(sig, lambda *_: self.stopping.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            while not self.stopping.is_set():
                self.tick(time.monotonic())
                self.write_state(running=True)
                if on_tick is not None:
                    on_tick()
                self.stopping.wait(self.tick_s)
        finally:  # a failure of the supervisor itself leaves no service behind either
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.write_state(running=False)
            self.pid_file.unlink(missing_ok=True)

    def _claim(self) -> None:
        """One supervisor per configuration and host: a second ``up`` is refused."""
        self.dir.mkdir(parents=True, exist_ok=True)
        other = read_pid(self.pid_file)
        if other is not None and other != os.getpid():
            raise StackError(f"choreo up is already running for {self.config.path} (pid {other}); "
                             f"`choreo up stop --config {self.config.path}` stops it")
        self.pid_file.write_text(str(os.getpid()))

    def tick(self, now: float) -> None:
        for member in self.members:
            if self.stopping.is_set():
                return
            if member.state == "running" and member.proc.pid() is None:
                # known when this ``up`` started it, not when it adopted an earlier one's
                member.last_exit = describe_exit(member.proc.exit_code(wait_s=1.0))
                self.say(f"{member.proc.name} ended ({member.last_exit})")
                self._back_off(member, now)
            elif member.state in ("starting", "backoff") and now >= member.due:
                self._start(member, now)

    def _start(self, member: Member, now: float) -> None:
        restart = member.state == "backoff"
        try:
            new = member.proc.start(settings().start_timeout_s)
        except StackError as exc:
            member.last_exit = str(exc)
            self.say(f"{member.proc.name} did not start: {exc}")
            self._back_off(member, time.monotonic())
            return
        member.pid = member.proc.pid()
        member.state = "running"
        member.started_at = time.time()
        member._started_mono = now
        member.restarts += int(restart)
        verb = "restarted" if restart else "started" if new else "adopted (left running by an earlier up)"
        self.say(f"{member.proc.name} {verb} (pid {member.pid})")

    def _back_off(self, member: Member, now: float) -> None:
        policy = self.config.backoff
        stable = member._started_mono and now - member._started_mono >= policy.stable_s
        delay = policy.initial_s if stable or not member.delay_s else min(member.delay_s * 2, policy.max_s)
        member.delay_s, member.due, member.state, member.pid = delay, now + delay, "backoff", None
        self.say(f"{member.proc.name}: next start in {delay:g}s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop intake first, then every service at once (each drains on SIGTERM)."""
        ingestion = [m.proc for m in self.members if m.service == "ingestion"]
        services = [m.proc for m in self.members if m.service != "ingestion"]
        self.say("stopping: ingestion first, then the services (SIGTERM, they drain)")
        stop_all(ingestion, timeout_s)
        stop_all(services, timeout_s)
        for member in self.members:
            member.state, member.pid = "stopped", None

    def write_state(self, running: bool) -> None:
        """Atomically, so ``choreo up status`` never reads half a file."""
        body = {"config": str(self.config.path), "ordinal": self.ordinal, "pid": os.getpid(),
                "running": running, "written_at": time.time(),
                "processes": [m.view() for m in self.members]}
        partial = self.state_file.with_suffix(".partial")
        partial.write_text(json.dumps(body))
        partial.replace(self.state_file)


def read_pid(pid_file: Path) -> int | None:
    """The live supervisor's pid from ``pid_file``, or None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


@dataclass(frozen=True)
class Status:
    supervisor_pid: int | None
    processes: list[dict[str, Any]]

    @property
    def healthy(self) -> bool:
        return self.supervisor_pid is not None and bool(self.processes) and all(
            p["state"] == "running" and p["pid"] is not None and pid_alive(p["pid"]) for p in self.processes)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "healthy": self.healthy}


def status(config_path: Path) -> Status:
    """What the supervisor of ``config_path`` last wrote, if it runs."""
    where = workdir(config_path)
    pid = read_pid(where / "up.pid")
    try:
        processes = json.loads((where / "state.json").read_text())["processes"] if pid else []
    except (OSError, ValueError, KeyError):
        processes = []
    return Status(pid, processes)


def stop(config_path: Path, timeout_s: float = 120.0) -> int | None:
    """SIGTERM the supervisor of ``config_path`` and wait until it is gone; its pid, or None."""
    pid = read_pid(workdir(config_path) / "up.pid")
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            raise StackError(f"choreo up (pid {pid}) did not stop within {timeout_s:g}s")
        time.sleep(0.2)
    return pid


def apply_environment(config: UpConfig) -> None:
    """The file's ``[environment]`` as defaults for this process and every child: what the
    host's environment already sets wins, so one file serves hosts pointed at other servers."""
    for key, value in config.environment.items():
        os.environ.setdefault(key, value)
    settings.cache_clear()


def prepare(config: UpConfig) -> None:
    """Create the workflow's topics and register its contracts once, before any process
    starts: an incompatible contract stops ``up`` here with the registry's refusal."""
    from confluent_kafka import KafkaException
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from choreo import contracts, topology
    from choreo.runtime_events import RUNTIME_EVENTS
    from choreo.workflow import load_workflow

    flow = load_workflow(config.workflow)
    cfg = settings()
    try:
        topology.create(flow)
    except KafkaException as exc:
        raise StackError(f"cannot create the workflow's topics on Kafka at "
                         f"{cfg.kafka_bootstrap_servers}: {exc.args[0].str()}") from None
    try:
        contracts.register(contracts.topic_models(flow, RUNTIME_EVENTS))
    except SchemaRegistryError:
        raise  # a refusal: the caller shows the registry's reason
    except Exception as exc:  # the client raises its HTTP library's errors when nothing answers
        raise StackError(f"cannot register the workflow's contracts: {type(exc).__name__}: {exc}") from None
