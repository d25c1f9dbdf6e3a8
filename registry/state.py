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
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from choreo import avro_bounds
from registry import avro_schema, errors

Record = tuple[bytes, bytes | None]


def _key(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _value(payload: dict[str, Any] | None) -> bytes | None:
    return None if payload is None else json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def schema_id_record(schema_id: int, text: str, references: Sequence[avro_schema.Reference] = ()) -> Record:
    """``references`` only when there are some: a record without them is what it always was."""
    value: dict[str, Any] = {"id": schema_id, "schema": text, "schemaType": "AVRO"}
    if references:
        value["references"] = [r.as_json() for r in references]
    return _key({"keytype": "SCHEMA_ID", "id": schema_id, "magic": 0}), _value(value)


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


MAX_INT = 2**31 - 1  # schema ids and versions are 32-bit, as clients hold them


def _number(value: Any) -> int:
    """A schema id or version as a record must hold it. JSON also holds ``1e999`` (a float:
    infinity), ``true`` and numbers of any size; one of those taken as an id would move
    every later id out of the 32-bit range."""
    if type(value) is not int or not 0 < value <= MAX_INT:
        raise ValueError("an id or version that is not a positive 32-bit integer")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string field of another type")
    return value


def _optional_subject(key: dict[str, Any]) -> str | None:
    """Config and mode keys name a subject, or none for the global setting."""
    subject = key.get("subject")
    return None if subject is None else _text(subject)


@dataclass(frozen=True)
class StoredSchema:
    schema_id: int
    text: str
    identity: str
    references: tuple[avro_schema.Reference, ...] = ()


@dataclass(frozen=True)
class SubjectVersion:
    subject: str
    version: int
    schema_id: int
    deleted: bool


_Parsed = tuple[StoredSchema, "avro_schema.ParsedSchema | None"]


def _parsed_schema(schema_id: int, text: str, references: tuple[avro_schema.Reference, ...] = ()) -> _Parsed:
    """A stored schema and its parse (None: a schema valid under older rules, which stays
    readable by id, its identity its text). A schema with references is parsed when it is
    first needed (``State.parsed``): what they resolve to is the state's to say, and a log
    replayed in another order (compaction) may not hold them yet."""
    if references:
        try:
            identity = avro_schema.identity_of(json.loads(text), references)
        except (ValueError, RecursionError):
            identity = json.dumps({"schema": text, "references": [r.as_json() for r in references]})
        return StoredSchema(schema_id, text, identity, references), None
    try:
        parsed = avro_schema.parse(text)
    except Exception:  # the parsers raise a zoo of types; any of them means "not parsed"
        return StoredSchema(schema_id, text, text), None
    return StoredSchema(schema_id, text, parsed.identity), parsed


def _put(table: MutableMapping[str | None, Any], key: str | None, value: Any) -> None:
    """A config or mode record: set, or removed by its tombstone (None)."""
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


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
        self.last_skipped = ""  # why the last skipped record was skipped
        self._parsed: dict[int, avro_schema.ParsedSchema] = {}
        # indexes, kept by ``apply``, so that a lookup by id and a delete cost what they find,
        # not a walk over every version (for a referenced version, once per referrer)
        self._uses: dict[int, dict[tuple[str, int], SubjectVersion]] = {}  # schema id -> versions of it
        self._referrers: dict[tuple[str, int], set[int]] = {}  # (subject, version) -> schema ids naming it

    def apply(self, key: bytes | None, value: bytes | None) -> bool:
        """Apply one record; a record we cannot understand is counted and skipped, never fatal
        (``last_skipped`` says why). It is decoded, checked field by field and its schema
        parsed before the lock is taken: readers never wait on a parse, and a record is
        applied whole or not at all."""
        try:
            k = json.loads(key) if key else None
            v = json.loads(value) if value else None
            if not isinstance(k, dict) or (v is not None and not isinstance(v, dict)):
                raise ValueError("not a registry record")
            change = self._decode(k, v)
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
            self.skipped += 1
            self.last_skipped = f"{type(exc).__name__}: {str(exc)[:200]}"
            return False
        with self.lock:
            change()
        return True

    def _decode(self, k: dict[str, Any], v: dict[str, Any] | None) -> Callable[[], None]:
        """The change a record makes, once every field has been checked."""
        kind = k["keytype"]
        if kind == "SCHEMA_ID" and v is not None:
            return partial(self._add_schema, _parsed_schema(_number(v["id"]), _text(v["schema"]),
                                                            avro_schema.references_of(v.get("references"))))
        if kind == "SCHEMA":
            subject, version = _text(k["subject"]), _number(k["version"])
            if v is None:
                return partial(self._drop_version, subject, version)
            deleted = v.get("deleted", False)
            if not isinstance(deleted, bool):
                raise ValueError("a deleted flag that is not a boolean")
            found = SubjectVersion(subject, version, _number(v["id"]), deleted)
            # records written by other registries carry the text along (``schemas`` is ours
            # to read without the lock: only this thread writes it)
            text = v.get("schema")
            schema = (_parsed_schema(found.schema_id, text, avro_schema.references_of(v.get("references")))
                      if isinstance(text, str) and found.schema_id not in self.schemas else None)
            return partial(self._add_version, found, schema)
        if kind == "CONFIG":
            return partial(_put, self.configs, _optional_subject(k), v)
        if kind == "MODE":
            return partial(_put, self.modes, _optional_subject(k), None if v is None else _text(v["mode"]))
        raise ValueError(f"unknown keytype {str(kind)[:40]!r}")

    def _add_version(self, found: SubjectVersion, schema: _Parsed | None) -> None:
        if schema is not None and found.schema_id not in self.schemas:
            self._add_schema(schema)
        self._drop_use(self.subjects.get(found.subject, {}).get(found.version))
        self.subjects.setdefault(found.subject, {})[found.version] = found
        self._uses.setdefault(found.schema_id, {})[(found.subject, found.version)] = found
        self.max_id = max(self.max_id, found.schema_id)

    def _drop_version(self, subject: str, version: int) -> None:
        versions = self.subjects.get(subject, {})
        self._drop_use(versions.pop(version, None))
        if not versions:
            self.subjects.pop(subject, None)

    def _drop_use(self, sv: SubjectVersion | None) -> None:
        uses = {} if sv is None else self._uses.get(sv.schema_id, {})
        if sv is not None and uses.pop((sv.subject, sv.version), None) is not None and not uses:
            del self._uses[sv.schema_id]

    def _add_schema(self, schema: _Parsed) -> None:
        stored, parsed = schema
        if parsed is not None:
            self._parsed[stored.schema_id] = parsed
        replaced = self.schemas.get(stored.schema_id)
        for r in () if replaced is None else replaced.references:
            self._referrers.get((r.subject, r.version), set()).discard(stored.schema_id)
        for r in stored.references:
            self._referrers.setdefault((r.subject, r.version), set()).add(stored.schema_id)
        self.schemas[stored.schema_id] = stored
        self.by_identity.setdefault(stored.identity, stored.schema_id)
        self.max_id = max(self.max_id, stored.schema_id)

    # -- queries (callers hold ``lock``) -------------------------------------------------

    def parsed(self, schema_id: int) -> avro_schema.ParsedSchema | None:
        """The parse of a stored schema; one with references is resolved now and remembered
        (None: it cannot be, e.g. its references form a cycle, or it is invalid)."""
        found = self._parsed.get(schema_id)
        stored = self.schemas.get(schema_id)
        if found is not None or stored is None or not stored.references:
            return found
        try:
            found = avro_schema.parse(stored.text, stored.references, self.dependencies(stored.references))
        except Exception:  # the parsers raise a zoo of types; any of them means "not parsed"
            return None
        self._parsed[schema_id] = found
        return found

    def dependencies(self, references: Sequence[avro_schema.Reference]) -> list[str]:
        """The texts ``references`` resolve to, in definition order (``avro_bounds.resolve``);
        ``RegistryError`` 42201 names a reference that resolves to nothing, or why the whole
        cannot be resolved in bounds. A soft-deleted version still resolves: the schemas that
        reference it stay readable."""
        try:
            return avro_bounds.resolve(references, self._referenced)
        except avro_bounds.UnboundedSchema as exc:
            raise errors.invalid_schema(f"the schema cannot be decoded in bounded work: {exc}") from None

    def _referenced(self, reference: avro_schema.Reference) -> tuple[int, str, tuple[avro_schema.Reference, ...]]:
        sv = self.subjects.get(reference.subject, {}).get(reference.version)
        stored = None if sv is None else self.schemas.get(sv.schema_id)
        if stored is None:
            raise errors.reference_not_found(reference.subject, reference.version)
        return stored.schema_id, stored.text, stored.references

    def referrers(self, subject: str, version: int, include_deleted: bool = False) -> list[int]:
        """The ids of the schemas that reference ``subject`` ``version`` and are in use (by a
        live version, or by any version with ``include_deleted``)."""
        return sorted(schema_id for schema_id in self._referrers.get((subject, version), ())
                      if self.usages(schema_id, include_deleted))

    def versions(self, subject: str, include_deleted: bool = False) -> list[SubjectVersion]:
        found = self.subjects.get(subject, {})
        return [found[v] for v in sorted(found) if include_deleted or not found[v].deleted]

    def usages(self, schema_id: int, include_deleted: bool = False) -> list[SubjectVersion]:
        """The versions of ``schema_id``, by subject and version."""
        uses = self._uses.get(schema_id, {})
        return [uses[k] for k in sorted(uses) if include_deleted or not uses[k].deleted]
