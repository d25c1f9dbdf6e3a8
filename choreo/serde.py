"""Avro with the Confluent wire format, through confluent-kafka's own serializers.

The registry client, ``AvroSerializer`` and ``AvroDeserializer`` are used unchanged with
their defaults, so any Confluent-compatible registry works. This module adds what a
pipeline needs on top: the handler's schema as the reader schema, pydantic validation,
and a classification of every decoding failure into a dead-letter reason (permanent) or a
transient error (retry: e.g. the registry is briefly unreachable).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro.read import SchemaResolutionError
from pydantic import ValidationError

from choreo.config import settings
from choreo.errors import DeadLetterReason
from choreo.events import Event

E = TypeVar("E", bound=Event)

MAGIC_BYTE = 0
MAX_VALUE_BYTES = 512 * 1024


class DecodeFailure(Exception):
    """The bytes can never become a valid event: dead-letter them with ``reason``."""

    def __init__(self, reason: DeadLetterReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RegistryUnavailable(Exception):
    """The registry could not be asked right now: a transient failure, retry later."""


_clients: dict[str, SchemaRegistryClient] = {}


def registry_client(url: str | None = None) -> SchemaRegistryClient:
    """One client per registry URL and process, so schema lookups are cached once."""
    url = url or settings().schema_registry_url
    if url not in _clients:
        _clients[url] = SchemaRegistryClient({"url": url})
    return _clients[url]


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
    """Deserializes one topic into the handler's event type, with the handler's schema as reader."""

    def __init__(self, model: type[E], topic: str, client: SchemaRegistryClient) -> None:
        self.model = model
        self._ctx = SerializationContext(topic, MessageField.VALUE)
        self._deserializer = AvroDeserializer(client, model.avro_schema())

    def __call__(self, value: bytes | None) -> E:
        if value is None:
            raise DecodeFailure(DeadLetterReason.UNDECODABLE, "empty value (tombstone)")
        if len(value) > MAX_VALUE_BYTES:
            raise DecodeFailure(DeadLetterReason.OVERSIZED, f"value of {len(value)} bytes")
        if len(value) < 5 or value[0] != MAGIC_BYTE:
            raise DecodeFailure(
                DeadLetterReason.UNDECODABLE, "not in Confluent wire format (magic byte 0 + schema id)"
            )
        try:
            record: Any = self._deserializer(value, self._ctx)
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                schema_id = int.from_bytes(value[1:5], "big")
                raise DecodeFailure(
                    DeadLetterReason.UNKNOWN_SCHEMA, f"schema id {schema_id} unknown to the registry"
                ) from exc
            raise RegistryUnavailable(str(exc)) from exc
        except SchemaResolutionError as exc:
            raise DecodeFailure(DeadLetterReason.INCOMPATIBLE_SCHEMA, str(exc)[:500]) from exc
        except (OSError, ConnectionError) as exc:
            raise RegistryUnavailable(str(exc)) from exc
        except Exception as exc:  # fastavro raises many types on corrupt or truncated data
            if _is_transport_error(exc):
                raise RegistryUnavailable(str(exc)) from exc
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


def _is_transport_error(exc: BaseException) -> bool:
    """httpx errors (connection refused, timeouts) surface from the registry client."""
    return type(exc).__module__.startswith(("httpx", "httpcore"))
