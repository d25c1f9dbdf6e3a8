"""Avro with the Confluent wire format, through confluent-kafka's registry client.

The registry client and ``AvroSerializer`` are used unchanged with their defaults, so any
Confluent-compatible registry works; decoding reads the writer schema through the same
client and resolves it with fastavro (``Decoder``). This module adds what a pipeline needs
on top: the handler's schema as the reader schema, pydantic validation, and a
classification of every decoding failure into a dead-letter reason (permanent) or a
transient error (retry: e.g. the registry is briefly unreachable). A writer schema is input
too: one not registered under the topic's subject, or one that would let a few bytes demand
unbounded decoding work (``choreo.avro_bounds``), dead-letters its records.
"""

from __future__ import annotations

import io
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from functools import cache, partial
from typing import Any, Generic, TypeVar

from confluent_kafka.schema_registry import SchemaReference, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from pydantic import ValidationError

from choreo import avro_bounds
from choreo.config import settings
from choreo.errors import DeadLetterReason
from choreo.events import Event
from choreo.logs import get_logger

E = TypeVar("E", bound=Event)
T = TypeVar("T")
log = get_logger(component="serde")

MAGIC_BYTE = 0
MAX_VALUE_BYTES = 512 * 1024
MAX_WRITER_SCHEMAS = 1000  # parsed writer schemas a decoder keeps (one per version it met, the least used out)
MAX_REFUSED_SCHEMAS = 1000  # refused schema ids a decoder remembers (the oldest is forgotten first)
REFUSAL_TTL_S = 5.0  # how long a refusal stands before the registry is asked again
MAX_OWN_VERSIONS = 100  # versions of the topic's subject read to tell a denied schema id is not ours


class DecodeFailure(Exception):
    """The bytes can never become a valid event: dead-letter them with ``reason``."""

    def __init__(self, reason: DeadLetterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Unwritable(Exception):
    """An event whose own values Avro cannot write under its schema (a string that is not
    Unicode, a number past its type's range): no retry writes it."""


class RegistryUnavailable(Exception):
    """The registry could not be asked right now: a transient failure, retry later."""


class RegistryDenied(RegistryUnavailable):
    """The registry refused this login a lookup (403). Retried like an outage unless the
    reader can tell, from the topic's subject, that the schema id is not its
    (``not_registered_under``)."""


SCHEMA_NOT_FOUND = 40403  # the registry API's error code for an unknown schema id
SUBJECT_NOT_FOUND = 40401  # and for a subject it does not have
# the codes of what a reference may name that the registry no longer has (hard-deleted since)
REFERENCE_NOT_FOUND = {SUBJECT_NOT_FOUND: "subject", 40402: "version"}
MAX_SCHEMA_ID = 2**31 - 1  # a registry's ids are positive 32-bit integers (Java's int)
RETRIABLE_STATUS = (408, 429, 500, 502, 503, 504)  # answers of a registry that may answer later
REGISTRY_RETRIES = 2  # after the first try of a request
REGISTRY_RETRY_MAX_WAIT_MS = 2000  # the longest wait before a retry

_clients: dict[str, SchemaRegistryClient] = {}


def registry_client(url: str | None = None) -> SchemaRegistryClient:
    """One client per registry URL and process, so schema lookups are cached once. Each
    request is bounded (``CHOREO_REGISTRY_TIMEOUT_S``) and retried twice, shortly: the
    client's defaults wait for ever and back off up to 20 s, past a consumer's poll interval
    (60 s), which three tries and their waits stay well within."""
    url = url or settings().schema_registry_url
    if url not in _clients:
        _clients[url] = SchemaRegistryClient({
            "url": url, "timeout": settings().registry_timeout_s, "max.retries": REGISTRY_RETRIES,
            "retries.wait.ms": 500, "retries.max.wait.ms": REGISTRY_RETRY_MAX_WAIT_MS})
    return _clients[url]


def forget_registry_clients() -> None:
    """Drop every cached client with the ids it learnt: for a process that next talks to a
    new registry at the same URL (the chaos runner, run after run on fresh stacks), where a
    cached registration would hand out another registry's schema id."""
    _clients.clear()


FRAME_BYTES = 5  # the Confluent wire format's magic byte and schema id before the Avro body


@cache
def _writer_schema(model: type[Event]) -> Any:
    return parse_schema(json.loads(model.avro_schema()))


def avro_body(model: type[Event], record: dict[str, Any]) -> bytes:
    """``record`` (an event of ``model``, as ``to_avro`` gives it) in Avro, without the
    registry's framing; ``Unwritable`` when Avro cannot write its values."""
    out = io.BytesIO()
    try:
        schemaless_writer(out, _writer_schema(model), record)
    except Exception as exc:  # noqa: BLE001 - whatever the writer refuses a value with
        raise Unwritable(f"{model.__name__}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    return out.getvalue()


class Encoder(Generic[E]):
    """Serializes one event type to one topic (subject ``<topic>-value``).

    The schema is looked up, not registered (``SCHEMA_REGISTRY_AUTO_REGISTER`` off): the
    contracts are registered at deploy time, so a producer needs only a read login, and an
    event whose schema was never registered fails to publish instead of changing the contract.
    """

    def __init__(self, model: type[E], topic: str, client: SchemaRegistryClient) -> None:
        self.topic = topic
        self._model = model
        self._ctx = SerializationContext(topic, MessageField.VALUE)
        register = settings().schema_registry_auto_register
        self._serializer = AvroSerializer(client, model.avro_schema(), conf={"auto.register.schemas": register})

    def __call__(self, event: E) -> bytes:
        """The event's bytes. ``RegistryUnavailable`` when the registry cannot be asked now
        (its schema id is looked up once, then cached): the caller retries; ``Unwritable``
        when the event's own values are what Avro cannot write; any other error (a schema
        never registered) is for the deployment to fix."""
        record = event.to_avro()
        try:
            data = self._serializer(record, self._ctx)
        except SchemaRegistryError as exc:
            if exc.http_status_code in RETRIABLE_STATUS:
                raise RegistryUnavailable(str(exc)) from exc
            raise
        except Exception as exc:
            if _is_transport_error(exc):
                raise RegistryUnavailable(str(exc)) from exc
            avro_body(self._model, record)  # Unwritable when the event's own values are the fault
            raise
        if not isinstance(data, bytes):
            raise TypeError(f"serializer returned {type(data).__name__} for {self.topic}")
        return data


class Decoder(Generic[E]):
    """Deserializes one topic into the handler's event type, with the handler's schema as reader.

    The writer's schema comes from the registry by the id in the message (the client caches
    it); fastavro resolves it against the handler's. This is what ``AvroDeserializer`` does,
    less what it does again for every message: expanding the reader schema and collecting
    its tags for data-contract rules, which this pipeline does not use. That was 31 µs of
    a 33 µs decode, and a delivery is decoded six times.
    A writer schema is dead-lettered as incompatible when its id is not registered under the
    topic's subject ``<topic>-value`` (a soft-deleted version still counts: records written
    before the delete stay readable), when decoding with it is not bounded by the value's
    size (``avro_bounds``, references included), and when it has data-contract rules. A
    refusal (these, or an unknown id) is remembered a while (``WriterSchemas``).
    """

    def __init__(self, model: type[E], topic: str, client: SchemaRegistryClient) -> None:
        self.model = model
        self.subject = f"{topic}-value"
        self._client = client
        self._reader = parse_schema(json.loads(model.avro_schema()))
        self._schemas = WriterSchemas(self._admit, self.subject)

    def __call__(self, value: bytes | None) -> E:
        if value is None:
            raise DecodeFailure(DeadLetterReason.UNDECODABLE, "empty value (tombstone)")
        if len(value) > MAX_VALUE_BYTES:
            raise DecodeFailure(DeadLetterReason.OVERSIZED, f"value of {len(value)} bytes")
        if len(value) <= 5 or value[0] != MAGIC_BYTE:
            raise DecodeFailure(
                DeadLetterReason.UNDECODABLE, "not in Confluent wire format (magic byte 0 + schema id)"
            )
        writer = self._schemas.get(schema_id_of(value))
        try:
            record: Any = schemaless_reader(io.BytesIO(value[5:]), writer, self._reader)
        except SchemaResolutionError as exc:
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA, str(exc)[:500]) from exc
        except Exception as exc:  # fastavro raises many types on corrupt or truncated data
            raise DecodeFailure(
                DeadLetterReason.UNDECODABLE, f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        try:
            return self.model.from_avro(record)
        except ValidationError as exc:
            raise DecodeFailure(
                DeadLetterReason.INVALID_PAYLOAD,
                "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())[:500],
            ) from exc

    def _admit(self, schema_id: int) -> Any:
        """Ask the registry about ``schema_id`` and parse its schema, or say why not."""
        try:
            subjects = _ask(schema_id, lambda: self._client.get_subjects_by_schema_id(schema_id, deleted=True))
        except RegistryDenied:
            if not not_registered_under(self._client, self.subject, schema_id):
                raise
            subjects = []
        if self.subject not in subjects:
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                                f"schema id {schema_id} is not registered under {self.subject}")
        return bounded_writer(self._client, schema_id)


class WriterSchemas:
    """Writer schemas by id, parsed once ``admit`` let them in; a refusal is remembered for
    ``REFUSAL_TTL_S``, so a flood of records with a refused id costs a registry round trip per
    id and period, not per record; not for good, as a registry instance that lags may not
    know yet of an id the subject just got, and a refusal may be a registry's bad answer."""

    def __init__(self, admit: Callable[[int], Any], subject: str = "") -> None:
        self.admit = admit
        self.subject = subject  # for the log
        self.parsed: OrderedDict[int, Any] = OrderedDict()  # schema id → parsed writer schema, last used last
        self._refused: dict[int, tuple[float, DeadLetterReason, str]] = {}  # id → (until, reason, why)

    def get(self, schema_id: int) -> Any:
        """The writer schema of ``schema_id``, parsed, or ``DecodeFailure`` saying why not."""
        known = self.parsed.get(schema_id)
        if known is not None:
            self.parsed.move_to_end(schema_id)
            return known
        self.raise_refusal(schema_id)
        try:
            writer = self.admit(schema_id)
        except DecodeFailure as exc:
            self._refuse(schema_id, exc)
            raise
        self._refused.pop(schema_id, None)
        # the least used goes: a thousand versions registered by another must not stop the
        # caching of the ones in use
        if len(self.parsed) >= MAX_WRITER_SCHEMAS:
            self.parsed.popitem(last=False)
        self.parsed[schema_id] = writer
        return writer

    def raise_refusal(self, schema_id: int) -> None:
        """Raise the refusal of ``schema_id`` that still stands, if there is one, asking nothing."""
        refused = self._refused.get(schema_id)
        if refused is not None and refused[0] > time.monotonic():
            raise DecodeFailure(refused[1], refused[2])

    def _refuse(self, schema_id: int, failure: DecodeFailure) -> None:
        """Remember a refusal (the oldest goes first when full); the failure itself is not
        kept, its traceback would hold the frames."""
        log.warning("writer_schema_refused", subject=self.subject, schema_id=schema_id,
                    reason=failure.reason.value, why=str(failure))
        self._refused.pop(schema_id, None)
        if len(self._refused) >= MAX_REFUSED_SCHEMAS:
            del self._refused[next(iter(self._refused))]
        self._refused[schema_id] = (time.monotonic() + REFUSAL_TTL_S, failure.reason, str(failure))


def schema_id_of(value: bytes) -> int:
    """The writer schema's id in a Confluent-framed value. One past a 32-bit integer (four
    bytes of 0xff) is refused here: a registry answers a path id it cannot parse as one with
    a plain 404, which is no "schema not found", and a consumer that took it for an
    unavailable registry would retry that record for ever."""
    schema_id = int.from_bytes(value[1:5], "big")
    if schema_id > MAX_SCHEMA_ID:
        raise DecodeFailure(DeadLetterReason.UNKNOWN_SCHEMA, f"schema id {schema_id} is no registry's")
    return schema_id


def not_registered_under(client: SchemaRegistryClient, subject: str, schema_id: int) -> bool:
    """Whether ``subject``, read version by version, shows that ``schema_id`` is none of its
    versions (soft-deleted ones included): asked when the registry denies this login the id.

    A registry with per-subject read permissions (Confluent's RBAC) denies a schema id
    registered only under subjects this login may not read. Whoever may register under
    such a subject and write to the topic could otherwise stop the partition: a denial
    reads as an outage, retried for ever. An id found among the subject's versions, a
    subject with more versions than are read here, or a subject this login may not read
    either, tells nothing: the record waits as in an outage. The client caches each
    version it has read, so an id is looked for at the price of the versions not yet met."""
    try:
        versions = client.get_versions(subject, deleted=True)
    except SchemaRegistryError as exc:  # no such subject: nothing registered under it
        return exc.http_status_code == 404 and exc.error_code == SUBJECT_NOT_FOUND
    except Exception:  # the registry cannot be reached: nothing to tell
        return False
    if len(versions) > MAX_OWN_VERSIONS:
        return False
    try:
        return all(client.get_version(subject, version, deleted=True).schema_id != schema_id
                   for version in versions)
    except Exception:  # a version denied or gone meanwhile, or the registry unreachable
        return False


def bounded_writer(client: SchemaRegistryClient, schema_id: int) -> Any:
    """The writer schema of ``schema_id``, parsed, if it is an Avro schema that decodes in
    bounded work (``choreo.avro_bounds``); else ``DecodeFailure`` says why. Its references
    are fetched through the client (each version once, soft-deleted ones too: what was
    written with them stays readable) and parsed first; the bounds apply to the whole."""
    schema = _ask(schema_id, lambda: client.get_schema(schema_id))
    if (schema.schema_type or "AVRO") != "AVRO":
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id} is not an Avro schema")
    if schema.rule_set is not None:  # e.g. encrypted fields: read as they are, they would pass
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id} has data-contract rules this decoder does not apply")
    text = schema.schema_str or ""
    try:
        dependencies = avro_bounds.resolve(schema.references or [], partial(_referenced, client, schema_id))
        avro_bounds.check_size(text, dependencies)
        document = json.loads(text)
        before = [json.loads(dependency) for dependency in dependencies]
        avro_bounds.check(document, before)
        named: dict[str, Any] = {}
        for dependency in before:
            parse_schema(dependency, named_schemas=named)
        return parse_schema(document, named_schemas=named)
    except (DecodeFailure, RegistryUnavailable):
        raise
    except avro_bounds.UnboundedSchema as exc:
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id} cannot be decoded in bounded work: {exc}") from exc
    except Exception as exc:  # the registry holds it, but it is no Avro schema we can read
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id}: {type(exc).__name__}: {str(exc)[:300]}") from exc


def _referenced(client: SchemaRegistryClient, schema_id: int,
                reference: SchemaReference) -> tuple[Hashable, str, list[SchemaReference]]:
    """What ``avro_bounds.resolve`` needs of one reference of ``schema_id``'s schema."""
    if reference.subject is None or reference.version is None:
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id} has a reference without subject or version")
    subject, version = reference.subject, reference.version
    if subject.strip(".") == "":
        # no URL names it: the client's ``subjects/../versions/1`` reaches ``/versions/1``,
        # whose plain 404 would read as a registry unavailable, for ever
        raise DecodeFailure(DeadLetterReason.UNKNOWN_SCHEMA,
                            f"schema id {schema_id} references the subject {subject[:20]!r}, which no URL names")
    found = _ask(schema_id, lambda: client.get_version(subject, version, deleted=True))
    if (found.schema.schema_type or "AVRO") != "AVRO":
        raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                            f"schema id {schema_id} references a schema that is not Avro")
    handle = found.schema_id if found.schema_id is not None else (subject, version)
    return handle, found.schema.schema_str or "", list(found.schema.references or [])


def _ask(schema_id: int, call: Callable[[], T]) -> T:
    """One registry call about ``schema_id``: an unknown id condemns the event, anything
    else that goes wrong is the registry being unavailable (retried)."""
    try:
        return call()
    except SchemaRegistryError as exc:
        # only the registry's own "schema not found" condemns the event: any other 404 (a
        # wrong URL, a proxy, another server on the port) must not dead-letter good events
        if exc.http_status_code == 404 and exc.error_code == SCHEMA_NOT_FOUND:
            raise DecodeFailure(
                DeadLetterReason.UNKNOWN_SCHEMA, f"schema id {schema_id} unknown to the registry"
            ) from exc
        if exc.http_status_code == 404 and exc.error_code in REFERENCE_NOT_FOUND:
            raise DecodeFailure(
                DeadLetterReason.UNKNOWN_SCHEMA,
                f"schema id {schema_id} references a {REFERENCE_NOT_FOUND[exc.error_code]} the registry does not have",
            ) from exc
        if exc.http_status_code == 403:
            raise RegistryDenied(str(exc)) from exc
        raise RegistryUnavailable(str(exc)) from exc
    except Exception as exc:
        if _is_transport_error(exc):
            raise RegistryUnavailable(str(exc)) from exc
        raise DecodeFailure(
            DeadLetterReason.UNDECODABLE, f"schema id {schema_id}: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc


def _is_transport_error(exc: BaseException) -> bool:
    """The registry could not be reached: a socket error, or one of httpx's (connection
    refused, timeouts), which surface from the registry client as they are."""
    return isinstance(exc, OSError) or type(exc).__module__.startswith(("httpx", "httpcore"))
