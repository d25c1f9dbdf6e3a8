"""Pure logic of the ops tools: partitioners, times, causal order, the topology check on
deliberately broken topologies, and the generated docs being current."""

from __future__ import annotations

import json
import uuid
import zlib
from datetime import UTC, date, datetime
from datetime import time as dt_time
from decimal import Decimal

import pytest

from choreo.envelope import H_CORRELATION_ID, Envelope, header_value
from choreo.ops import flowdoc, topocheck
from choreo.ops.cli import _as_written
from choreo.ops.rebuild import delivery_of
from choreo.ops.records import Rec, _plain, murmur2, parse_time, partition_for
from choreo.ops.trace import Keeping, causal_order
from choreo.serde import MAX_VALUE_BYTES
from choreo.runner import H_DLQ_REASON
from choreo.service import Context, Service
from choreo.workflow import Workflow
from consumers.workflow import WORKFLOW
from schemas.models import DeliveryRequested, DroneScheduled, PackageReady


@pytest.mark.parametrize("key, expected", [
    (b"21", -973932308), (b"foobar", -790332482), (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829), (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
])
def test_murmur2_matches_kafka_java_client(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected  # vectors of Kafka's own UtilsTest


def test_default_partitioner_is_librdkafka_crc32() -> None:
    assert partition_for(b"d-1", 6) == zlib.crc32(b"d-1") % 6
    assert partition_for(b"21", 6, "murmur2_random") == (murmur2(b"21") & 0x7FFFFFFF) % 6


def test_parse_time_forms() -> None:
    now = 1_800_000_000_000
    assert parse_time("now", now) == now
    assert parse_time("-15m", now) == now - 15 * 60_000
    assert parse_time("2h ago", now) == now - 2 * 3_600_000
    assert parse_time("1700000000000") == 1_700_000_000_000
    assert parse_time("2026-11-29T10:00") == int(datetime(2026, 11, 29, 10, tzinfo=UTC).timestamp() * 1000)
    assert parse_time("2026-11-29T10:00+01:00") == int(datetime(2026, 11, 29, 9, tzinfo=UTC).timestamp() * 1000)
    assert parse_time("0") == 0  # the start of every log
    for pasted in ("1700000000", "\u00b2"):  # epoch seconds would select every record; a digit int() refuses
        with pytest.raises(ValueError):
            parse_time(pasted)


def test_a_pasted_delivery_id_is_read_as_the_pipeline_writes_it() -> None:
    written = "0f1a4a88-6cde-4ccc-aaa4-ab307c16e78b"
    for pasted in (written.upper(), "{%s}" % written, f" {written} ", written.replace("-", "")):
        assert _as_written(pasted) == written
    assert _as_written("poison-run-1") == "poison-run-1"


def test_a_header_given_twice_reads_as_its_last_as_the_services_read_it() -> None:
    # a producer's own copy of a runtime header comes first; the runtime's (its envelope, a
    # dead letter's dlq.* appended on dead-lettering) last. The ops tools and the rebuild
    # read the value the services keyed their state by, never the producer's
    env = Envelope.first("e1", "d-runtime", "DeliveryRequested", "ingestion")
    headers = [(H_CORRELATION_ID, b"d-forged"), (H_DLQ_REASON, b"forged"),
               *((k, v if isinstance(v, bytes) else str(v).encode()) for k, v in env.to_headers()),
               (H_DLQ_REASON, b"handler_error")]
    parsed = Envelope.from_headers(headers)
    assert parsed is not None and parsed.correlation_id == "d-runtime"
    assert header_value(headers, H_CORRELATION_ID) == delivery_of(headers, b"key") == "d-runtime"
    assert Rec("t.dlq", 0, 0, 0, b"key", b"", headers).header(H_DLQ_REASON) == "handler_error"
    assert header_value(headers, "absent") is None and delivery_of([], b"key") == "key"


def _rec(topic: str, env: Envelope, ts: int) -> Rec:
    return Rec(topic, 0, ts, ts, b"d", b"", [(k, v if isinstance(v, bytes) else b"") for k, v in env.to_headers()])


def test_causal_order_never_shows_an_effect_before_its_cause() -> None:
    first = Envelope.first("e1", "d", "DeliveryRequested", "ingestion")
    child = first.child("e2", "PackageReady", "package")
    grandchild = child.child("e3", "DeliveryShipped", "delivery")
    # a skewed producer clock puts the effect 5 ms before its cause
    records = [_rec("c", grandchild, 100), _rec("b", child.__class__(**{**child.__dict__, "produced_at_ms": 10}), 10),
               _rec("a", first.__class__(**{**first.__dict__, "produced_at_ms": 15}), 15)]
    ordered = [r.envelope.event_id for r in causal_order(records) if r.envelope]
    assert ordered == ["e1", "e2", "e3"]


def test_causal_order_reads_each_envelope_once_whatever_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Records under one key, each naming the next as its cause (the reverse of their time
    order), in a cycle at the end: each in its place, each envelope parsed once."""
    n = 3000
    envs = [Envelope.first(f"e{i}", "d", "X", "p") for i in range(n)]
    envs = [env.__class__(**{**env.__dict__, "causation_id": f"e{i + 1}" if i + 1 < n else "e0",
                             "produced_at_ms": 1000 + i}) for i, env in enumerate(envs)]
    records = [_rec("t", env, 1000 + i) for i, env in enumerate(envs)]
    parsed = []
    real = Envelope.from_headers
    monkeypatch.setattr(Envelope, "from_headers", staticmethod(lambda h: parsed.append(1) or real(h)))
    ordered = [r.envelope.event_id for r in causal_order(records) if r.envelope]
    # e0 waits for e1 ... e(n-1) for e0: a cycle, broken at the earliest; then each effect
    # follows its cause, walking the chain backwards
    assert ordered == ["e0"] + [f"e{i}" for i in range(n - 1, 0, -1)]
    assert len(parsed) == n
    # a copy of an event (the same id) frees what waits for it; a record of no event waits for nothing
    first = Envelope.first("a", "d", "X", "p")
    child = first.child("b", "Y", "q")
    late_copy = first.__class__(**{**first.__dict__, "produced_at_ms": 500})
    early_child = child.__class__(**{**child.__dict__, "produced_at_ms": 1})
    mixed = [_rec("t", early_child, 1), _rec("t.dlq", early_child, 2), _rec("t", late_copy, 500),
             _rec("t", first.__class__(**{**first.__dict__, "produced_at_ms": 600}), 600)]
    assert [(r.topic, r.envelope.event_id) for r in causal_order(mixed) if r.envelope] == [
        ("t.dlq", "b"), ("t", "a"), ("t", "b"), ("t", "a")]


def test_a_bounded_scan_keeps_the_values_it_reads_and_no_more() -> None:
    def rec(topic: str, size: int) -> Rec:
        return Rec(topic, 0, 0, 0, b"d", b"x" * size)

    everything = Keeping()
    assert everything.kept(rec("any", 100)).value == b"x" * 100
    big = everything.kept(rec("any", MAX_VALUE_BYTES + 1))  # what every consumer refuses
    assert big.value is None and big.cut_bytes == MAX_VALUE_BYTES + 1
    status = Keeping(values_of=frozenset({"wanted"}), max_value_bytes=10)
    assert status.kept(rec("wanted", 10)).value == b"x" * 10
    assert (status.kept(rec("wanted", 11)).cut_bytes, status.kept(rec("other", 1)).cut_bytes) == (11, 1)
    headed = Keeping(max_header_bytes=10)
    assert headed.kept(Rec("t", 0, 0, 0, b"d", b"", [("a", b"12345678")])).headers == [("a", b"12345678")]
    assert headed.kept(Rec("t", 0, 0, 0, b"d", b"", [("a", b"123456789"), ("b", b"")])).headers == []


def test_a_body_of_any_type_a_writer_schema_decodes_to_prints_as_json() -> None:
    """``ops trace --bodies`` printed bodies with ``json.dumps``: a registered schema with
    bytes, a decimal, a UUID or a date made it raise."""
    body = {"raw": b"\x00\xff", "amount": Decimal("1.50"), "id": uuid.UUID(int=5), "day": date(2030, 1, 2),
            "at": dt_time(1, 2), "odd": float("nan"), "list": [1, None, True, "x"]}
    assert json.loads(json.dumps(_plain(body), allow_nan=False)) == {
        "raw": "00ff", "amount": "1.50", "id": "00000000-0000-0000-0000-000000000005", "day": "2030-01-02",
        "at": "01:02:00", "odd": "nan", "list": [1, None, True, "x"]}


def _flow(*services: Service, extra: dict[str, str] | None = None) -> Workflow:
    flow = Workflow("broken", service_refs=[], extra_producers=extra or {})
    flow.__dict__["services"] = list(services)
    return flow


def _noop(model: type) -> object:
    def handle(event: object, ctx: Context) -> None:
        del event, ctx

    handle.__annotations__ = {"event": model, "ctx": Context, "return": None}
    return handle


def test_the_real_workflow_is_sound() -> None:
    assert topocheck.check(WORKFLOW) == []


def test_a_consumer_of_a_topic_no_one_produces_fails() -> None:
    orphan = Service("orphan")
    orphan.on("t.nobody.produces")(_noop(DeliveryRequested))  # type: ignore[arg-type]
    findings = topocheck.check(_flow(orphan))
    assert [f.rule for f in findings] == ["producer"]
    assert "t.nobody.produces" in findings[0].message


def test_a_fan_in_pair_with_different_partition_counts_fails() -> None:
    join = Service("join")
    join.on("t.left", step="join")(_noop(PackageReady))  # type: ignore[arg-type]
    join.on("t.right", step="join")(_noop(DroneScheduled))  # type: ignore[arg-type]
    flow = _flow(join, extra={"t.left": "a", "t.right": "b"})
    assert topocheck.check(flow) == []
    findings = topocheck.check(flow, partitions={"t.left": 6, "t.right": 3})
    assert [f.rule for f in findings] == ["co-partitioned"]
    assert "t.left=6" in findings[0].message and "t.right=3" in findings[0].message


def test_a_fan_in_input_not_keyed_by_delivery_fails() -> None:
    class OddKey(PackageReady):
        @property
        def key(self) -> str:
            return self.package_id

    join = Service("join")
    join.on("t.left", step="join")(_noop(OddKey))  # type: ignore[arg-type]
    join.on("t.right", step="join")(_noop(DroneScheduled))  # type: ignore[arg-type]
    findings = topocheck.check(_flow(join, extra={"t.left": "a", "t.right": "b"}))
    assert [(f.rule, f.subject) for f in findings] == [("keyed", "t.left")]


def test_a_cycle_without_hop_guard_fails_and_with_one_passes() -> None:
    def pair(max_hops: int) -> Workflow:
        ping, pong = Service("ping", max_hops=max_hops), Service("pong")
        ping.on("t.pong", produces=[PackageReady])(_noop(DroneScheduled))  # type: ignore[arg-type]
        pong.on("package.ready", produces=[DroneScheduled])(_noop(PackageReady))  # type: ignore[arg-type]
        # pong's output is drone.scheduled; route ping's input there to close the loop
        ping.handlers["drone.scheduled"] = ping.handlers.pop("t.pong")
        return _flow(ping, pong)

    assert topocheck.check(pair(20)) == []
    findings = topocheck.check(pair(10**9))
    assert [f.rule for f in findings] == ["cycle"]
    assert "ping" in findings[0].message


def test_schema_rule_needs_a_registered_subject() -> None:
    findings = topocheck.check(WORKFLOW, subjects=["delivery.requested-value"])
    assert {f.rule for f in findings} == {"schema"}
    assert not any(f.subject == "delivery.requested" for f in findings)


def test_generated_docs_are_current() -> None:
    """docs/ is generated from the declarations: regenerate with `choreo ops topology doc`."""
    spec = flowdoc.asyncapi(WORKFLOW)
    assert spec["asyncapi"] == "3.0.0"
    assert spec["channels"]["delivery_requested"]["bindings"]["kafka"]["partitions"] == 6
    receive = spec["operations"]["delivery_receive_package_ready"]
    assert receive["action"] == "receive" and receive["x-choreo-step"]["name"] == "delivery"
    assert (flowdoc.DOCS / "asyncapi.yaml").read_text().endswith(flowdoc.to_yaml(spec))
    assert (flowdoc.DOCS / "event-flow.md").read_text() == flowdoc.flow_markdown(WORKFLOW)
    assert "fan-in delivery" in flowdoc.mermaid(WORKFLOW)


@pytest.mark.parametrize("raised, code", [("refused", 1), ("kafka", 3), ("unacted", 2)])
def test_an_operators_decision_tells_by_its_exit_code_what_happened(monkeypatch: pytest.MonkeyPatch,
                                                                    raised: str, code: int) -> None:
    """1: refused, nothing published; 2: published, no supervisor acted within --wait; 3:
    Kafka or Redis failed on the way (the decision may be published: deciding again is safe)."""
    from typer.testing import CliRunner

    from choreo.ops import cli, compensation

    def decide(*_: object) -> compensation.DecisionResult:
        if raised == "refused":
            raise compensation.DecisionRefused("step drone of delivery d-1 is compensating")
        if raised == "kafka":
            raise RuntimeError("Kafka refused the decision: not authorized")
        return compensation.DecisionResult("d-1", "drone", compensation.DONE_BY_HAND, "compensation.operator",
                                           "e-1", False, "compensation_failed", {"drone": "compensation_failed"})

    monkeypatch.setattr(compensation, "decide", decide)
    result = CliRunner().invoke(cli.app, ["mark-compensated", "d-1", "drone", "--wait", "0"])
    assert result.exit_code == code, result.output


def test_the_status_view_prints_hostile_text_from_redis_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error text or a delivery id is whatever a service, a remote or a forged record put
    there: Rich markup in it ("[/bold]" closes no tag) crashed the command before; now it is
    printed as text."""
    from typer.testing import CliRunner

    from choreo.ops import cli, status

    hostile = "refused [/bold] [link=http://x]y[/link] \x1b[2J"
    view = status.StepView("d-[/x]", "drone", "compensation_failed", 0, 0, 3, 6, hostile, "failed", 1_000)
    result_view = status.Status(61_000, 1, 1, 0, awaiting_operator=[view], failed=[view])

    monkeypatch.setattr(status, "status", lambda *_, **__: result_view)
    monkeypatch.setattr(cli, "_workflow", lambda _: None)
    result = CliRunner().invoke(cli.app, ["status", "--no-lag"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "d-[/x]" in result.output and "refused [/bold] [link=http://x]y[/link]" in result.output
    assert "\x1b[2J" not in result.output  # the terminal's controls are not passed through
    assert "60" in result.output.split("d-[/x]")[1].splitlines()[0]  # failed 60 s ago


def test_a_letter_keeps_what_its_headers_say_cut() -> None:
    """A letter's headers are anybody's who writes its topic: held whole, a megabyte reason,
    error or key would weigh on every listing, a redrive's result and the live view's sampler
    (whose page prints each reason four times a row); a redrive starts from the record's
    time, not the header's."""
    from choreo.ops.dlq import MAX_TOPIC_CHARS, DeadLetter
    from choreo.runner import DLQ_HEADERS, H_DLQ_TIME_MS

    headers = [(name, b"999" if name == H_DLQ_TIME_MS else "\U0001f4a5".encode() * 250_000)
               for name in DLQ_HEADERS]
    letter = DeadLetter.of(Rec("t.dlq", 0, 5, 1_800_000_000_000, b"k" * 1_000_000, b"v", headers), set())
    assert len(letter.reason) == len(letter.service) == len(letter.delivery_id) == 200
    assert len(letter.error) == 500 and len(letter.source_topic) == MAX_TOPIC_CHARS and letter.problem
    assert (letter.time_ms, letter.written_ms) == (999, 1_800_000_000_000)


def test_a_letter_with_numbers_past_any_offset_or_date_is_read_and_shown() -> None:
    """Whoever writes a dead-letter topic writes its headers: 5,000 digits (past what ``int``
    reads) stopped every reader of the letter (the tools, the live view's sampler, the
    rebuild), and a time past year 9999 the live view's page."""
    from choreo.ops.dlq import DeadLetter
    from choreo.ops.records import shown_time
    from choreo.runner import DLQ_HEADERS, H_DLQ_SOURCE_OFFSET, H_DLQ_TIME_MS

    headers = [(name, b"9" * 5000 if name == H_DLQ_SOURCE_OFFSET else b"1") for name in DLQ_HEADERS]
    letter = DeadLetter.of(Rec("t.dlq", 0, 5, 1_800_000_000_000, b"k", b"v", headers), set())
    assert letter.source_offset == -1 and letter.problem  # not an offset: never redriven
    huge = [(name, b"9" * 18 if name == H_DLQ_TIME_MS else b"1") for name in DLQ_HEADERS]
    letter = DeadLetter.of(Rec("t.dlq", 0, 6, 1_800_000_000_000, b"k", b"v", huge), set())
    assert shown_time(letter.time_ms) == f"{'9' * 18} ms"
    assert shown_time(1_800_000_000_000) == "2027-01-15 08:00:00.000"
    assert shown_time(1_800_000_000_000, with_date=False) == "08:00:00.000"


@pytest.mark.parametrize("args, refusal", [
    (["status", "--no-lag", "--window", "9" * 400 + "h"], "longer than 9999 years"),
    (["status", "--no-lag", "--window", "yesterday"], "not a span of time"),
    (["dlq", "list", "--since", "99999999999999999999d"], "longer than 9999 years"),
    (["dlq", "list", "--since", "9" * 30], "not a time between 1970 and 9999"),
    (["dlq", "show", "t.dlq", "2147483648", "0"], "less than or equal to 2147483647"),
    (["dlq", "list", "-p", "-1"], "greater than or equal to 0"),
    (["trace", "d-1", "--partitioner", "foo"], "the partitioner is one of"),
])
def test_what_an_operator_pastes_is_refused_in_a_sentence_before_anything_is_read(
        monkeypatch: pytest.MonkeyPatch, args: list[str], refusal: str) -> None:
    """Times past any date (400 nines are a float's infinity), partitions past a 32-bit
    integer, an unknown partitioner: each is refused in a sentence, not a traceback."""
    from typer.testing import CliRunner

    from choreo.ops import cli, dlq, status, trace

    def unread(*_: object, **__: object) -> None:
        raise AssertionError("read before the arguments were checked")

    for module, name in [(status, "status"), (dlq, "dead_letters"), (dlq, "show"), (trace, "trace")]:
        monkeypatch.setattr(module, name, unread)
    monkeypatch.setattr(cli, "_workflow", lambda _: None)
    result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert refusal in " ".join(result.output.split()), result.output


def test_a_redrive_counts_what_committed_and_sends_one_letter_per_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A redrive commits a transaction per chunk: one stopped by a later chunk's failure has
    redriven the earlier ones, and says so. Two letters of one event are one redrive: the
    second's forget would make the first's copy, handled meanwhile, a first sighting again."""
    from choreo.ops import dlq
    from choreo.runner import DLQ_HEADERS, H_DLQ_SERVICE, H_DLQ_SOURCE_TOPIC

    def letter(offset: int, event_id: str) -> tuple[dlq.DeadLetter, Rec]:
        envelope = Envelope.first(event_id, "d-1", "T", "test")
        headers = [*envelope.to_headers(), *[(name, {H_DLQ_SOURCE_TOPIC: b"t", H_DLQ_SERVICE: b"svc"}.get(name, b"1"))
                                             for name in DLQ_HEADERS]]
        record = Rec("t.dlq", 0, offset, 1_800_000_000_000, b"d-1", b"v", [(k, v) for k, v in headers if v is not None])
        return dlq.DeadLetter.of(record, set()), record

    class Producer:
        def __init__(self) -> None:
            self.commits = 0

        def begin_transaction(self) -> None: ...

        def produce(self, *_: object, **__: object) -> None: ...

        def poll(self, _: float) -> None: ...

        def abort_transaction(self, _: float) -> None: ...

        def commit_transaction(self, _: float) -> None:
            self.commits += 1
            if self.commits == 2:
                raise RuntimeError("the broker went away")

    pipe = type("Pipe", (), {"hdel": lambda self, *a: None, "execute": lambda self: None})()
    client = type("Client", (), {"pipeline": lambda self, transaction: pipe})()
    letters = [letter(1, "e-1"), letter(2, "e-1"), letter(3, "e-2"), letter(4, "e-3")]
    assert not any(d.problem for d, _ in letters)
    monkeypatch.setattr(dlq, "ensure_topics", lambda *a, **k: None)
    monkeypatch.setattr(dlq, "_sender", lambda: (Producer(), client))
    monkeypatch.setattr(dlq, "_selected", lambda *a: (each for each in letters))
    monkeypatch.setattr(dlq, "REDRIVE_CHUNK_LETTERS", 1)
    with pytest.raises(dlq.RedriveStopped, match="after 1 redriven: RuntimeError: the broker went away") as info:
        dlq.redrive(dlq.Selection(topics=["t"]))
    assert [d.offset for d in info.value.done.redriven] == [1]
    assert [(d.offset, why) for d, why in info.value.done.skipped] == [
        (2, "another letter of the same event is redriven")]
