"""The one command for people: the local stack, services, events, schemas, the demo and recovery."""

# The composition root: it mounts the stack, chaos, the registry and ingestion on the
# runtime's commands, so it lives above them all (the runtime package imports none of them).

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra.chaos import app as chaos_app
from infra.process import StackError
from infra.up_cli import app as up_app
from registry.cli import app as registry_app
from choreo.ops.cli import app as ops_app
from choreo.workflow import load_workflow
from producers import cli as ingestion_cli

if TYPE_CHECKING:
    from choreo.events import Event
    from choreo.workflow import Workflow

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
stack_app = typer.Typer(no_args_is_help=True, help="The local Kafka, Redis and registry.")
app.add_typer(stack_app, name="stack")
console = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(1)


REDIS_CLUSTER_HELP = ("a Redis Cluster too, beside the single Redis: three masters with one replica "
                      "each on 127.0.0.1:7000-7005 (REDIS_URL=redis://127.0.0.1:7000)")
SECURE_HELP = ("the secured stack instead (SECURITY.md), all over TLS with a local CA: SASL/SCRAM + "
               "ACL broker on 29092 (SASL_SSL), ACL Redis on 26379 (rediss), registry with basic auth "
               "on https://127.0.0.1:28081, under $CHOREO_DATA_DIR/secured")


@stack_app.command("start")
def stack_start(nodes: int = typer.Option(1, help="Kafka nodes: 1, or 3 for failover tests"),
                secure: bool = typer.Option(False, "--secure", help=SECURE_HELP),
                redis_cluster: bool = typer.Option(False, "--redis-cluster", help=REDIS_CLUSTER_HELP)) -> None:
    """Start the stack (idempotent: what already runs is reused)."""
    from infra import stack

    if secure:
        _secure_start(nodes)
        return
    try:
        if nodes == 1:
            started = stack.start()
        else:
            from choreo.config import settings

            started = stack.kafka_cluster(settings(), nodes=nodes).start(settings().start_timeout_s)
        if redis_cluster:
            started += stack.redis_cluster().start()
    except StackError as exc:
        fail(str(exc))
    console.print(f"started: {', '.join(started) or 'nothing (already running)'}")
    if redis_cluster:
        console.print(f"Redis Cluster ok: REDIS_URL={stack.redis_cluster().url}")


def _secure_start(nodes: int) -> None:
    """``stack start --secure``: ``infra.security.up``, so there is one command to remember.
    Prints where each principal's env file is (never their contents: they hold passwords)."""
    from choreo.config import settings
    from infra import security

    if nodes != 1:
        fail("--secure runs a single secured broker; --nodes does not apply")
    data_dir = security.default_data_dir()
    try:
        files = security.up(data_dir, settings().start_timeout_s)
    except StackError as exc:
        fail(str(exc))
    for user, path in files.items():
        console.print(f"{user}: {path}")
    console.print(f"secured stack up: Kafka {security.SECURED_HOST}:{security.SECURED_KAFKA_PORT}, "
                  f"Redis {security.SECURED_HOST}:{security.SECURED_REDIS_PORT}, registry "
                  f"{security.registry_url(None, security.Secrets(data_dir / 'secrets'))}")
    console.print(f"every connection is TLS; clients trust {security.Secrets(data_dir / 'secrets').tls.ca_cert} "
                  "(KAFKA_SSL_CA_LOCATION, SSL_CERT_FILE and REDIS_URL in the env files name it)")
    console.print(f"run as a principal: set -a; . {data_dir / 'env'}/<user>.env; set +a")


@stack_app.command("stop")
def stack_stop(nodes: int = typer.Option(1, help="Kafka nodes of the cluster to stop"),
               secure: bool = typer.Option(False, "--secure", help="stop the secured stack only"),
               redis_cluster: bool = typer.Option(False, "--redis-cluster",
                                                  help="stop the Redis Cluster only")) -> None:
    """Stop the stack, its Redis Cluster too (with --secure or --redis-cluster: only that one,
    the rest keeps running)."""
    from infra import stack

    if redis_cluster:
        stopped = stack.redis_cluster().stop()
    elif secure:
        from infra import security

        stopped = security.down(security.default_data_dir())
    elif nodes == 1:
        try:
            stopped = stack.stop()
        except StackError as exc:
            fail(str(exc))
    else:
        stopped = stack.kafka_cluster(nodes=nodes).stop()
    console.print(f"stopped: {', '.join(stopped) or 'nothing (was not running)'}")


@stack_app.command("status")
def stack_status(as_json: bool = typer.Option(False, "--json", help="machine-readable")) -> None:
    """What runs, with pids and log files; exit code 1 if any part is down."""
    from infra import stack

    try:
        parts = stack.status()
    except StackError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps([p.__dict__ for p in parts]))
    else:
        table = Table("part", "running", "pid", "log")
        for p in parts:
            table.add_row(p.name, "yes" if p.running else "[red]no[/]", str(p.pid or "-"), p.log)
        Console().print(table)
    if not all(p.running for p in parts):
        raise typer.Exit(1)


@app.command("run")
def run_service(
    ref: str = typer.Argument(..., help="module:service, e.g. consumers.notifier:service"),
    instance: str = typer.Option("0", help="stable instance id (fences a zombie of the same id)"),
    metrics_port: int = typer.Option(0, help="serve Prometheus metrics on this port (0: off)"),
    metrics_host: str = typer.Option("", help="address the metrics bind (CHOREO_METRICS_HOST; "
                                              "default: 127.0.0.1)"),
    metrics_public: bool = typer.Option(False, "--metrics-public",
                                        help="bind the metrics beyond loopback (CHOREO_METRICS_PUBLIC)"),
    workflow: str = typer.Option("consumers.workflow:WORKFLOW",
                                 help="module:attr of the Workflow whose steps outputs open ('' for none)"),
) -> None:
    """Run one instance of a service until SIGTERM, after creating the topics it declares
    that do not exist yet (a new subscriber needs no manual step)."""
    from confluent_kafka import KafkaException

    from choreo import topology
    from choreo.config import settings
    from choreo.layout import LayoutMismatch
    from choreo.runner import Runner, RunnerOptions
    from choreo.service import load_service

    if workflow:  # the supervisor watches the workflow its instance runs in, unless told otherwise
        os.environ.setdefault("SUPERVISOR_WORKFLOW", workflow)
    if metrics_host:
        os.environ["CHOREO_METRICS_HOST"] = metrics_host
    if metrics_public:
        os.environ["CHOREO_METRICS_PUBLIC"] = "true"
    if metrics_port:
        from choreo.metrics import MetricsRefused, bind_host

        try:
            bind_host()
        except MetricsRefused as exc:
            console.print(f"[bold red]refused:[/] {escape(str(exc))}")
            raise typer.Exit(ingestion_cli.EXIT_INSECURE)  # as serve refuses an unguarded address
    service = load_service(ref)
    flow = _load_workflow(workflow)
    try:
        topology.ensure_service(service, flow)
    except topology.TopicsMissing as exc:
        fail(str(exc))
    except KafkaException as exc:  # the broker's first answer is this service's first need
        fail(f"Kafka at {settings().kafka_bootstrap_servers} did not answer within "
             f"{settings().kafka_connect_timeout_s:g} s: {exc.args[0].str()}")
    try:
        Runner(service, RunnerOptions(instance=instance, metrics_port=metrics_port), workflow=flow).run()
    except LayoutMismatch as exc:
        fail(str(exc))


def _load_workflow(ref: str) -> "Workflow | None":
    """The workflow ``ref`` names; none for an empty ``ref`` (a service run on its own)."""
    return load_workflow(ref) if ref else None


@app.command("topics")
def create_topics(
    workflow: str = typer.Option("consumers.workflow:WORKFLOW", help="module:attr of the Workflow"),
    partitions: int = typer.Option(6, help="partitions per topic (fan-in topics share it)"),
) -> None:
    """Create every topic the workflow's services declare (idempotent), and check the topology."""
    from choreo import topology

    topo = topology.create(load_workflow(workflow), partitions)
    found = topology.problems(topo)
    for problem in found:
        console.print(f"[red]topology:[/] {escape(problem)}")
    console.print(f"{len(topo.partitions)} topics ready")
    if found:
        raise typer.Exit(1)


app.add_typer(registry_app, name="registry", help="The schema registry service.")
app.add_typer(ops_app, name="ops",
              help="Incident tooling: replay, rebuild-state, trace, dlq, mark-compensated, retry-undo, status, topology.")
app.add_typer(chaos_app, name="chaos", help="Chaos runner: faults on a three-node cluster, then checks.")
app.add_typer(up_app, name="up")
app.command("emit")(ingestion_cli.emit)
app.command("serve")(ingestion_cli.serve)

schemas_app = typer.Typer(no_args_is_help=True, help="Event contracts in the schema registry.")
app.add_typer(schemas_app, name="schemas")


def _contract_models(workflow: str) -> "dict[str, type[Event]]":
    from choreo import contracts
    from choreo.runtime_events import RUNTIME_EVENTS

    return contracts.topic_models(load_workflow(workflow), RUNTIME_EVENTS)


@schemas_app.command("register")
def schemas_register(workflow: str = typer.Option("consumers.workflow:WORKFLOW")) -> None:
    """Register every topic's schema under <topic>-value (refused when incompatible)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from choreo import contracts

    try:
        ids = contracts.register(_contract_models(workflow))
    except SchemaRegistryError as exc:
        fail(f"registry refused a schema: {exc.error_message} (code {exc.error_code})")
    for name, schema_id in ids.items():
        console.print(f"{name}: id {schema_id}")


@schemas_app.command("check")
def schemas_check(workflow: str = typer.Option("consumers.workflow:WORKFLOW"),
                  as_json: bool = typer.Option(False, "--json")) -> None:
    """The deploy gate: exit 1 when a local schema is incompatible with the registry's."""
    from choreo import contracts

    results = contracts.check(_contract_models(workflow))
    bad = [r for r in results if not r.compatible]
    if as_json:
        print(json.dumps([r.__dict__ for r in results]))
    for r in bad:
        reasons = '; '.join(r.messages) or 'no reason given'
        console.print(f"[red]incompatible:[/] {escape(r.subject)}: {escape(reasons)}")
    console.print(f"{len(results) - len(bad)}/{len(results)} subjects compatible")
    if bad:
        raise typer.Exit(1)


@app.command("demo")
def demo(
    requests: int = typer.Option(300, "--requests", "-n", help="deliveries to submit"),
    concurrency: int = typer.Option(16, help="HTTP requests in flight at once"),
    timeout_s: float = typer.Option(120.0, "--timeout", help="seconds to wait for every delivery"),
    fail_rate: float = typer.Option(0.05, help="permanent failure rate injected in each step's agent"),
    seed: int = typer.Option(7, help="seed of the generated requests"),
    stop: str = typer.Option("", help="kill -9 this service mid-run (e.g. drone-scheduler) to "
                                      "show requeue and compensation"),
    stop_after_s: float = typer.Option(1.0, help="seconds into the submission to kill it"),
    down_s: float = typer.Option(20.0, help="seconds it stays down before restarting"),
) -> None:
    """Run the whole choreography for real; the last line is the summary JSON."""
    from infra import demo as demo_run

    env = {"AGENT_WAREHOUSE_PERMANENT_RATE": str(fail_rate),
           "AGENT_DISPATCH_PERMANENT_RATE": str(fail_rate),
           "AGENT_WAREHOUSE_TRANSIENT_RATE": "0.05", "AGENT_DISPATCH_TRANSIENT_RATE": "0.05"}
    try:
        outage = demo_run.Outage(stop, stop_after_s, down_s) if stop else None
        if outage:  # short deadlines, so the outage outlives them and the supervisor steps in
            env["CHOREO_DEADLINE_SCALE"] = "0.2"
        summary = demo_run.run(requests, concurrency, timeout_s, seed, env, outage=outage)
    except StackError as exc:
        fail(str(exc))
    print(demo_run.main_line(summary))
    if summary["lost"] or summary["doubled"]:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
