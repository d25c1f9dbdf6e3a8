"""The registry's in-memory view, rebuilt from the ``_schemas`` log record by record.

Everything the registry knows is a pure function of the log, so a restart, a second
instance or a reader that lags all converge on the same answers. Each record's key
identifies *what* it describes (one schema id, one subject version, one config, one mode),
so Kafka compaction keeps exactly the latest fact per key and a compacted log replays to
the same state. Schema ids have their own never-deleted records: even after every version
using an id is permanently deleted, the id stays allocated, so it is never reused.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from infra.registry import avro_schema

Record = tuple[bytes, bytes | None]


def _key(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _value(payload: dict[str, Any] | None) -> bytes | None:
    return None if payload is None else json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def schema_id_record(schema_id: int, text: str) -> Record:
    return (_key({"keytype": "SCHEMA_ID", "id": schema_id, "magic": 0}),
            _value({"id": schema_id, "schema": text, "schemaType": "AVRO"}))


def version_record(subject: str, version: int, schema_id: int | None, deleted: bool = False) -> Record:
    """``schema_id=None`` writes the tombstone of a permanent delete."""
    key = _key({"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1})
    if schema_id is None:
        return key, None
    return key, _value({"subject": subject, "version": version, "id": schema_id, "deleted": deleted})


def config_record(subject: str | None, config: dict[str, Any] | None) -> Record:
    return _key({"keytype": "CONFIG", "subject": subject, "magic": 0}), _value(config)


def mode_record(subject: str | None, mode: str | None) -> Record:
    return _key({"keytype": "MODE", "subject": subject, "magic": 0}), _value(None if mode is None else {"mode": mode})


def _optional_subject(key: dict[str, Any]) -> str | None:
    """Config and mode keys name a subject, or none for the global setting."""
    subject = key.get("subject")
    return None if subject is None else str(subject)


@dataclass(frozen=True)
class StoredSchema:
    schema_id: int
    text: str
    identity: str


@dataclass(frozen=True)
class SubjectVersion:
    subject: str
    version: int
    schema_id: int
    deleted: bool


class State:
    """Mutated only by ``apply`` (the log reader); read by the API under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.schemas: dict[int, StoredSchema] = {}
        self.by_identity: dict[str, int] = {}
        self.subjects: dict[str, dict[int, SubjectVersion]] = {}
        self.configs: dict[str | None, dict[str, Any]] = {}
        self.modes: dict[str | None, str] = {}
        self.max_id = 0
        self.skipped = 0
        self._parsed: dict[int, avro_schema.ParsedSchema] = {}

    def apply(self, key: bytes | None, value: bytes | None) -> bool:
        """Apply one record; a record we cannot understand is counted and skipped, never fatal."""
        try:
            k = json.loads(key) if key else None
            v = json.loads(value) if value else None
            if not isinstance(k, dict) or (v is not None and not isinstance(v, dict)):
                raise ValueError("not a registry record")
            with self.lock:
                self._apply(k, v)
            return True
        except (ValueError, TypeError, KeyError):
            self.skipped += 1
            return False

    def _apply(self, k: dict[str, Any], v: dict[str, Any] | None) -> None:
        kind = k["keytype"]
        if kind == "SCHEMA_ID" and v is not None:
            self._add_schema(int(v["id"]), str(v["schema"]))
        elif kind == "SCHEMA":
            subject, version = str(k["subject"]), int(k["version"])
            versions = self.subjects.setdefault(subject, {})
            if v is None:
                versions.pop(version, None)
                if not versions:
                    del self.subjects[subject]
            else:
                schema_id = int(v["id"])
                if schema_id not in self.schemas and isinstance(v.get("schema"), str):
                    self._add_schema(schema_id, v["schema"])  # records written by other registries
                versions[version] = SubjectVersion(subject, version, schema_id, bool(v.get("deleted", False)))
                self.max_id = max(self.max_id, schema_id)
        elif kind == "CONFIG":
            config_subject = _optional_subject(k)
            if v is None:
                self.configs.pop(config_subject, None)
            else:
                self.configs[config_subject] = v
        elif kind == "MODE":
            mode_subject = _optional_subject(k)
            if v is None:
                self.modes.pop(mode_subject, None)
            else:
                self.modes[mode_subject] = str(v["mode"])
        else:
            raise ValueError(f"unknown keytype {kind!r}")

    def _add_schema(self, schema_id: int, text: str) -> None:
        try:
            parsed = avro_schema.parse(text)
            identity = parsed.identity
            self._parsed[schema_id] = parsed
        except Exception:  # a schema valid under older rules stays readable by id
            identity = text
        self.schemas[schema_id] = StoredSchema(schema_id, text, identity)
        self.by_identity.setdefault(identity, schema_id)
        self.max_id = max(self.max_id, schema_id)

    # -- queries (callers hold ``lock``) -------------------------------------------------

    def parsed(self, schema_id: int) -> avro_schema.ParsedSchema | None:
        return self._parsed.get(schema_id)

    def versions(self, subject: str, include_deleted: bool = False) -> list[SubjectVersion]:
        found = self.subjects.get(subject, {})
        return [found[v] for v in sorted(found) if include_deleted or not found[v].deleted]

    def usages(self, schema_id: int, include_deleted: bool = False) -> list[SubjectVersion]:
        return [
            sv for subject in sorted(self.subjects) for sv in self.versions(subject, include_deleted)
            if sv.schema_id == schema_id
        ]
