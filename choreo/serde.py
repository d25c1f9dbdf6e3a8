"""Avro with the Confluent wire format, through confluent-kafka's registry client.

The registry client and ``AvroSerializer`` are used unchanged with their defaults, so any
Confluent-compatible registry works; decoding reads the writer schema through the same
client and resolves it with fastavro (``Decoder``). This module adds what a pipeline needs
on top: the handler's schema as the reader schema, pydantic validation, and a
classification of every decoding failure into a dead-letter reason (permanent) or a
transient error (retry: e.g. the registry is briefly unreachable).
"""

from __future__ import annotations

import io
import json
from typing import Any, Generic, TypeVar

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro import parse_schema, schemaless_reader
from fastavro.read import SchemaResolutionError
from pydantic import ValidationError

from choreo.config import settings
from choreo.errors import DeadLetterReason
from choreo.events import Event

E = TypeVar("E", bound=Event)

MAGIC_BYTE = 0
MAX_VALUE_BYTES = 512 * 1024
MAX_WRITER_SCHEMAS = 1000  # parsed writer schemas a decoder keeps (one per version it met)


class DecodeFailure(Exception):
    """The bytes can never become a valid event: dead-letter them with ``reason``."""

    def __init__(self, reason: DeadLetterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RegistryUnavailable(Exception):
    """The registry could not be asked right now: a transient failure, retry later."""


SCHEMA_NOT_FOUND = 40403  # the registry API's error code for an unknown schema id

_clients: dict[str, SchemaRegistryClient] = {}


def registry_client(url: str | None = None) -> SchemaRegistryClient:
    """One client per registry URL and process, so schema lookups are cached once."""
    url = url or settings().schema_registry_url
    if url not in _clients:
        _clients[url] = SchemaRegistryClient({"url": url})
    return _clients[url]


def forget_registry_clients() -> None:
    """Drop every cached client with the ids it learnt: for a process that next talks to a
    new registry at the same URL (the chaos runner, run after run on fresh stacks), where a
    cached registration would hand out another registry's schema id."""
    _clients.clear()


class Encoder(Generic[E]):
    """Serializes one event type to one topic (subject ``<topic>-value``, auto-registered)."""

    def __init__(self, model: type[E], topic: str, client: SchemaRegistryClient) -> None:
        self.topic = topic
        self._ctx = SerializationContext(topic, MessageField.VALUE)
        self._serializer = AvroSerializer(client, model.avro_schema())

    def __call__(self, event: E) -> bytes:
        data = self._serializer(event.to_avro(), self._ctx)
        if not isinstance(data, bytes):
            raise TypeError(f"serializer returned {type(data).__name__} for {self.topic}")
        return data


class Decoder(Generic[E]):
    """Deserializes one topic into the handler's event type, with the handler's schema as reader.

    The writer's schema comes from the registry by the id in the message (the client caches
    it); fastavro resolves it against the handler's. This is what ``AvroDeserializer`` does,
    less what it does again for every message: expanding the reader schema and collecting
    its tags for data-contract rules, which this pipeline does not use. That was 31 µs of
    a 33 µs decode, and a delivery is decoded seven times (bench/README.md, "Decoding
    without the rule machinery").
    A writer schema with references to other subjects, or with data-contract rules, is
    dead-lettered as incompatible.
    """

    def __init__(self, model: type[E], topic: str, client: SchemaRegistryClient) -> None:
        self.model = model
        self._client = client
        self._reader = parse_schema(json.loads(model.avro_schema()))
        self._writers: dict[int, Any] = {}  # schema id → parsed writer schema

    def __call__(self, value: bytes | None) -> E:
        if value is None:
            raise DecodeFailure(DeadLetterReason.UNDECODABLE, "empty value (tombstone)")
        if len(value) > MAX_VALUE_BYTES:
            raise DecodeFailure(DeadLetterReason.OVERSIZED, f"value of {len(value)} bytes")
        if len(value) <= 5 or value[0] != MAGIC_BYTE:
            raise DecodeFailure(
                DeadLetterReason.UNDECODABLE, "not in Confluent wire format (magic byte 0 + schema id)"
            )
        schema_id = int.from_bytes(value[1:5], "big")
        writer = self._writers.get(schema_id)
        if writer is None:
            writer = self._writer(schema_id)
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

    def _writer(self, schema_id: int) -> Any:
        """The writer schema of ``schema_id``, parsed; remembered for the process."""
        try:
            schema = self._client.get_schema(schema_id)
        except SchemaRegistryError as exc:
            # only the registry's own "schema not found" condemns the event: any other 404 (a
            # wrong URL, a proxy, another server on the port) must not dead-letter good events
            if exc.http_status_code == 404 and exc.error_code == SCHEMA_NOT_FOUND:
                raise DecodeFailure(
                    DeadLetterReason.UNKNOWN_SCHEMA, f"schema id {schema_id} unknown to the registry"
                ) from exc
            raise RegistryUnavailable(str(exc)) from exc
        except (OSError, ConnectionError) as exc:
            raise RegistryUnavailable(str(exc)) from exc
        except Exception as exc:
            if _is_transport_error(exc):
                raise RegistryUnavailable(str(exc)) from exc
            raise DecodeFailure(
                DeadLetterReason.UNDECODABLE, f"schema id {schema_id}: {type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        if (schema.schema_type or "AVRO") != "AVRO" or schema.references:
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                                f"schema id {schema_id} is not a self-contained Avro schema")
        if schema.rule_set is not None:  # e.g. encrypted fields: read as they are, they would pass
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                                f"schema id {schema_id} has data-contract rules this decoder does not apply")
        try:
            writer = parse_schema(json.loads(schema.schema_str or ""))
        except Exception as exc:  # the registry holds it, but it is no Avro schema we can read
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA,
                                f"schema id {schema_id}: {type(exc).__name__}: {str(exc)[:300]}") from exc
        if len(self._writers) < MAX_WRITER_SCHEMAS:
            self._writers[schema_id] = writer
        return writer


def _is_transport_error(exc: BaseException) -> bool:
    """httpx errors (connection refused, timeouts) surface from the registry client."""
    return type(exc).__module__.startswith(("httpx", "httpcore"))
