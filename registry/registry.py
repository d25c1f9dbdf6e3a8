"""The registry's rules: what each Confluent REST operation reads, decides and writes.

Reads answer from the replayed state. Writes run one at a time (a lock in the leader), each
computed from a state that has read the whole log and appended as one Kafka transaction,
so ids and versions derive from the log itself and concurrent registrations can never
produce duplicates. A write that needs no record (a schema already registered) is answered
by any instance without involving the leader.

A compatibility check can take seconds (``compat``), so it never runs under a lock: it runs
on a snapshot of what it depends on (``_Basis``), the write then verifies under the lock
that the basis is unchanged and checks again if it is not. Every lookup keeps answering
meanwhile, and a check is stopped at ``check_timeout_s``.
"""

from __future__ import annotations

import re
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, TypeVar

from choreo.logs import get_logger
from registry import avro_schema, errors
from registry.compat import DEFAULT_LEVEL, CheckTimeout, Level, problems, reader_writer_problems
from registry.leader import LeaderElection
from registry.state import (
    MAX_INT,
    Record,
    State,
    StoredSchema,
    SubjectVersion,
    config_record,
    mode_record,
    schema_id_record,
    version_record,
)
from registry.store import KafkaStore

log = get_logger(component="registry")

T = TypeVar("T")
RESERVED_SUBJECTS = frozenset({"__GLOBAL", "__EMPTY"})
MODES = ("READWRITE", "READONLY", "READONLY_OVERRIDE", "IMPORT")
READ_ONLY_MODES = ("READONLY", "READONLY_OVERRIDE")
CONFIG_EXTRAS = {"normalize": bool, "validateFields": bool, "alias": str, "compatibilityGroup": str}
LATEST = avro_schema.LATEST


def check_subject(subject: str) -> str:
    """Reject what Confluent rejects (control characters, reserved names) plus absurd lengths
    and names of dots only, which no URL path can carry (a client's ``subjects/..`` is
    ``/``)."""
    shown = subject if len(subject) <= 80 else subject[:80] + "..."
    if (not subject.strip() or not subject.strip(".") or len(subject) > avro_schema.MAX_NAME_CHARS
            or subject in RESERVED_SUBJECTS
            or any(unicodedata.category(ch) in ("Cc", "Cs") for ch in subject)):
        raise errors.invalid_subject(repr(shown))
    return subject


_INTEGER = re.compile(r"-?[0-9]{1,10}")


def parse_version(raw: str) -> int:
    """``latest``/``-1`` give LATEST; a number in [1, 2^31-1] gives itself; else 42202."""
    text = raw.strip()
    if text.lower() == "latest":
        return LATEST
    if _INTEGER.fullmatch(text):  # not isdigit: "²" is a digit to it, and "--1" passed lstrip("-")
        number = int(text)
        if number == LATEST or 1 <= number <= MAX_INT:
            return number
    raise errors.invalid_version(raw[:40])


def parse_schema_id(raw: str) -> int:
    """Like JAX-RS: a path id that is not a 32-bit integer is no resource at all (404/404)."""
    text = raw.strip()
    if _INTEGER.fullmatch(text) and -(2**31) <= int(text) <= MAX_INT:
        return int(text)
    raise errors.http_error(404, "Not Found")


def _optional_number(body: dict[str, Any], key: str) -> int | None:
    """An explicit ``id``/``version`` in a registration (IMPORT mode); absent, 0 or -1 mean none."""
    value = body.get(key)
    if value is None or (type(value) is int and value in (-1, 0)):
        return None
    if type(value) is int and 0 < value <= MAX_INT:
        return value
    raise errors.invalid_version(str(value)) if key == "version" else errors.invalid_schema(
        f"{key} must be a positive 32-bit integer")


def _both_ways(new: avro_schema.ParsedSchema, old: avro_schema.ParsedSchema, level: Level,
               deadline: float) -> list[str]:
    """``new`` against one given version, in the directions ``level`` asks for."""
    found = reader_writer_problems(reader=new, writer=old, deadline=deadline) if level.backward else []
    if level.forward:
        found += reader_writer_problems(reader=old, writer=new, deadline=deadline)
    return found


class _Basis(NamedTuple):
    """What a registration's compatibility verdict rests on: while it is unchanged, a
    verdict reached outside the lock still holds."""

    mode: str
    level: Level
    versions: tuple[tuple[int, int], ...]  # (version, schema id) of the subject's live versions


class _BasisMoved(Exception):
    """The subject changed between a registration's check and its write."""


class Registry:
    def __init__(self, state: State, store: KafkaStore, election: LeaderElection,
                 check_timeout_s: float = 2.0) -> None:
        self.state = state
        self.store = store
        self.election = election
        self.check_timeout_s = check_timeout_s
        self._write_lock = threading.Lock()

    # -- shared helpers ---------------------------------------------------------------------

    def _live(self, subject: str, include_deleted: bool = False) -> list[SubjectVersion]:
        return self.state.versions(subject, include_deleted)

    def _level(self, subject: str | None) -> Level:
        for key in (subject, None) if subject is not None else (None,):
            config = self.state.configs.get(key)
            if config and "compatibilityLevel" in config:
                try:
                    return Level.parse(config["compatibilityLevel"])
                except errors.RegistryError:
                    pass
        return DEFAULT_LEVEL

    def _mode(self, subject: str | None) -> str:
        if subject is not None and subject in self.state.modes:
            return self.state.modes[subject]
        return self.state.modes.get(None, "READWRITE")

    def _writable(self, subject: str) -> None:
        if self._mode(subject) in READ_ONLY_MODES:
            raise errors.operation_not_permitted(f"Subject {subject} is in read-only mode")

    def _find(self, subject: str, version: int, include_deleted: bool = False) -> SubjectVersion:
        versions = self._live(subject, include_deleted)
        if not versions:
            raise errors.subject_not_found(subject)
        if version == LATEST:
            return versions[-1]
        for sv in versions:
            if sv.version == version:
                return sv
        raise errors.version_not_found(version)

    def _previous(self, subject: str) -> list[tuple[int, avro_schema.ParsedSchema]]:
        found = []
        for sv in self._live(subject):
            parsed = self.state.parsed(sv.schema_id)
            if parsed is not None:
                found.append((sv.version, parsed))
        return found

    def _describe(self, sv: SubjectVersion) -> dict[str, Any]:
        return {"subject": sv.subject, "version": sv.version, "id": sv.schema_id,
                **self._schema_fields(self.state.schemas[sv.schema_id])}

    @staticmethod
    def _schema_fields(stored: StoredSchema) -> dict[str, Any]:
        """A stored schema as Confluent answers it: ``references`` only when there are some."""
        if not stored.references:
            return {"schema": stored.text}
        return {"schema": stored.text, "references": [r.as_json() for r in stored.references]}

    def _parsed_body(self, body: dict[str, Any]) -> avro_schema.ParsedSchema:
        """The schema of a request, its references pinned to versions and resolved (42201 if
        any is not). Only the resolution holds the lock; the parse runs outside it."""
        kind = body.get("schemaType", "AVRO")
        if kind is None:
            kind = "AVRO"
        if not isinstance(kind, str) or kind.upper() != "AVRO":
            raise errors.invalid_schema(
                f"schemaType {kind!r} is not supported by this registry; only AVRO schemas are accepted"
            )
        try:
            requested = avro_schema.references_of(body.get("references"), requested=True)
        except ValueError as exc:
            raise errors.invalid_schema(str(exc)) from None
        with self.state.lock:
            references = tuple(self._pinned(r) for r in requested)
            dependencies = self.state.dependencies(references)
        return avro_schema.parse(body.get("schema"), references, dependencies)

    def _pinned(self, reference: avro_schema.Reference) -> avro_schema.Reference:
        """A reference to a live version; ``latest`` (-1) is replaced by that version's number,
        as Confluent stores it, so a later version of the subject changes nothing here."""
        found = [sv for sv in self._live(reference.subject) if reference.version in (LATEST, sv.version)]
        if not found:
            raise errors.reference_not_found(reference.subject, reference.version)
        return replace(reference, version=found[-1].version)

    def _unreferenced(self, subject: str, versions: list[SubjectVersion]) -> None:
        """Refuse to delete a version another schema references (42206, as Confluent): that
        schema would no longer resolve. A soft-deleted referrer counts, it is still read by id."""
        for sv in versions:
            if self.state.referrers(subject, sv.version, include_deleted=True):
                raise errors.reference_exists(subject, sv.version)

    def _basis(self, subject: str) -> _Basis:
        return _Basis(self._mode(subject), self._level(subject),
                      tuple((sv.version, sv.schema_id) for sv in self._live(subject)))

    def _checked(self, subject: str, check: Callable[[float], list[str]], deadline: float) -> list[str]:
        """Run a compatibility check (never under a lock) until ``deadline``, then refuse."""
        try:
            return check(deadline)
        except CheckTimeout:
            raise errors.RegistryError(
                errors.HTTP_CONFLICT, errors.INCOMPATIBLE_SCHEMA,
                f'Compatibility with subject "{subject}" could not be established within '
                f"{self.check_timeout_s:g} s: the schema is too costly to check",
            ) from None

    def _require_leader(self) -> None:
        """Only the leader writes; elsewhere ``NotLeaderError`` names it (the API forwards)."""
        if not self.election.is_leader():
            self.store.drop_writer()
            lease = self.election.current()
            if lease is not None and not self.election.trusted(lease):
                log.warning("untrusted_leader_lease")  # never forwarded to: see registry.auth
                lease = None
            elsewhere = lease is not None and lease.url != self.election.url
            raise errors.NotLeaderError(lease.url if lease is not None and elsewhere else None)

    def _write(self, compute: Callable[[], tuple[list[Record], T]]) -> T:
        """Run ``compute`` against a complete view and append its records, as the only writer.

        One retry covers the case where another instance fenced our producer since our last
        write: the retry re-initializes, reads the log to its end and recomputes.
        """
        for attempt in (1, 2):
            self._require_leader()
            with self._write_lock:
                self.store.prepare_writer()
                with self.state.lock:
                    records, result = compute()
                if not records:
                    return result
                try:
                    self.store.append(records)
                except errors.RegistryError as exc:
                    if attempt == 2 or exc.error_code != errors.STORE_ERROR:
                        raise
                    log.warning("write_retry", error=exc.message)
                    continue
                log.info("write", records=len(records), term=self.election.token, position=self.store.position)
                return result
        raise AssertionError("unreachable")

    # -- subjects and versions --------------------------------------------------------------

    def subjects(self, deleted: bool, deleted_only: bool, prefix: str | None) -> list[str]:
        with self.state.lock:
            names = []
            for subject in sorted(self.state.subjects):
                if prefix and not subject.startswith(prefix):
                    continue
                live = bool(self._live(subject))
                if (deleted_only and not live) or (not deleted_only and (live or deleted)):
                    names.append(subject)
            return names

    def versions(self, subject: str, deleted: bool) -> list[int]:
        with self.state.lock:
            found = [sv.version for sv in self._live(subject, deleted)]
        if not found:
            raise errors.subject_not_found(subject)
        return found

    def version(self, subject: str, version: str, deleted: bool) -> dict[str, Any]:
        number = parse_version(version)
        with self.state.lock:
            return self._describe(self._find(subject, number, deleted))

    def lookup(self, subject: str, body: dict[str, Any], deleted: bool) -> dict[str, Any]:
        with self.state.lock:
            versions = self._live(subject, deleted)
            if not versions:
                raise errors.subject_not_found(subject)
        parsed = self._parsed_body(body)
        with self.state.lock:
            for sv in reversed(versions):
                if self.state.schemas[sv.schema_id].identity == parsed.identity:
                    return self._describe(sv)
        raise errors.schema_not_found()

    def _existing(self, subject: str, parsed: avro_schema.ParsedSchema, wanted_id: int | None) -> int | None:
        """The id under which this schema is already a live version of the subject, if any."""
        for sv in self._live(subject):
            if self.state.schemas[sv.schema_id].identity == parsed.identity and wanted_id in (None, sv.schema_id):
                return sv.schema_id
        return None

    def register(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        parsed = self._parsed_body(body)
        wanted_id = _optional_number(body, "id")
        wanted_version = _optional_number(body, "version")
        deadline = time.monotonic() + self.check_timeout_s
        while True:
            with self.state.lock:
                known = self._existing(subject, parsed, wanted_id)
                basis, previous = self._basis(subject), self._previous(subject)
            if known is not None:
                return {"id": known}  # already there: no write, so any instance can answer
            self._require_leader()  # a follower forwards at once: the leader checks
            if basis.mode in READ_ONLY_MODES:
                raise errors.operation_not_permitted(f"Subject {subject} is in read-only mode")
            if (wanted_id or wanted_version) and basis.mode != "IMPORT":
                raise errors.operation_not_permitted(
                    "Overwriting a schema id or version is only permitted in IMPORT mode"
                )
            if basis.mode != "IMPORT":
                found = self._checked(subject, partial(problems, parsed, previous, basis.level), deadline)
                if found:
                    raise errors.incompatible(subject, found)
            try:
                return self._write(partial(self._registration, subject, parsed, wanted_id,
                                           wanted_version, basis))
            except _BasisMoved:
                if time.monotonic() > deadline:
                    raise errors.RegistryError(
                        errors.HTTP_CONFLICT, errors.HTTP_CONFLICT,
                        f'Subject "{subject}" kept changing while the schema was checked; retry',
                    ) from None

    def _registration(self, subject: str, parsed: avro_schema.ParsedSchema, wanted_id: int | None,
                      wanted_version: int | None, basis: _Basis) -> tuple[list[Record], dict[str, Any]]:
        """The records of a registration checked against ``basis``, if the log has not moved
        it since (then the schema is not registered yet either: ``_BasisMoved``)."""
        if self._basis(subject) != basis:
            raise _BasisMoved()
        for reference in parsed.references:  # not deleted since it was resolved
            self._pinned(reference)
        records: list[Record] = []
        if wanted_id is not None:
            schema_id = wanted_id
            existing = self.state.schemas.get(schema_id)
            if existing is not None and existing.identity != parsed.identity:
                raise errors.operation_not_permitted(f"Overwrite new schema with id {schema_id} is not permitted.")
        else:
            schema_id = self.state.by_identity.get(parsed.identity, 0) or self.state.max_id + 1
        if schema_id not in self.state.schemas:
            records.append(schema_id_record(schema_id, parsed.text, parsed.references))
        all_versions = self._live(subject, include_deleted=True)
        if wanted_version is not None:
            version = wanted_version
            if any(sv.version == version for sv in all_versions):
                raise errors.operation_not_permitted(f"Version {version} of subject {subject} already exists.")
        else:
            version = max((sv.version for sv in all_versions), default=0) + 1
        records.append(version_record(subject, version, schema_id))
        return records, {"id": schema_id}

    def delete_subject(self, subject: str, permanent: bool) -> list[int]:
        def compute() -> tuple[list[Record], list[int]]:
            every = self._live(subject, include_deleted=True)
            if not every:
                raise errors.subject_not_found(subject)
            self._writable(subject)
            live = [sv for sv in every if not sv.deleted]
            self._unreferenced(subject, every if permanent else live)
            if permanent:
                if live:
                    raise errors.subject_not_soft_deleted(subject)
                return [version_record(subject, sv.version, None) for sv in every], [sv.version for sv in every]
            if not live:
                raise errors.subject_soft_deleted(subject)
            return ([version_record(subject, sv.version, sv.schema_id, deleted=True) for sv in live],
                    [sv.version for sv in live])

        return self._write(compute)

    def delete_version(self, subject: str, version: str, permanent: bool) -> int:
        number = parse_version(version)

        def compute() -> tuple[list[Record], int]:
            every = self._live(subject, include_deleted=True)
            if not every:
                raise errors.subject_not_found(subject)
            self._writable(subject)
            if number == LATEST:
                candidates = every if permanent else [sv for sv in every if not sv.deleted]
                if not candidates:
                    raise errors.version_not_found(version)
                sv = candidates[-1]
            else:
                matches = [sv for sv in every if sv.version == number]
                if not matches:
                    raise errors.version_not_found(number)
                sv = matches[0]
            self._unreferenced(subject, [sv])
            if permanent:
                if not sv.deleted:
                    raise errors.version_not_soft_deleted(subject, sv.version)
                return [version_record(subject, sv.version, None)], sv.version
            if sv.deleted:
                raise errors.version_soft_deleted(subject, sv.version)
            return [version_record(subject, sv.version, sv.schema_id, deleted=True)], sv.version

        return self._write(compute)

    # -- schemas by id ------------------------------------------------------------------------

    def schema(self, raw_id: str, subject: str | None) -> dict[str, Any]:
        """``subject`` only selects the schema *context* in Confluent's registry; there is one
        context here, so an id is found whichever subject the reader names. Deserializers
        send their topic's subject, and a record written under another subject (another
        naming strategy, a copied event) must still be readable."""
        del subject
        schema_id = parse_schema_id(raw_id)
        with self.state.lock:
            stored = self.state.schemas.get(schema_id)
            usages = self.state.usages(schema_id, include_deleted=True)
            if stored is None or not usages:
                raise errors.schema_not_found(schema_id)
            return self._schema_fields(stored)

    def referenced_by(self, subject: str, version: str) -> list[int]:
        """The ids of the live schemas that reference this version."""
        number = parse_version(version)
        with self.state.lock:
            sv = self._find(subject, number)
            return self.state.referrers(subject, sv.version)

    def schema_subjects(self, raw_id: str, deleted: bool, subject: str | None) -> list[str]:
        return sorted({sv["subject"] for sv in self.schema_versions(raw_id, deleted, subject)})

    def schema_versions(self, raw_id: str, deleted: bool, subject: str | None) -> list[dict[str, Any]]:
        schema_id = parse_schema_id(raw_id)
        with self.state.lock:
            usages = self.state.usages(schema_id, include_deleted=deleted)
            if not usages and not self.state.usages(schema_id, include_deleted=True):
                raise errors.schema_not_found(schema_id)
        return [{"subject": sv.subject, "version": sv.version} for sv in usages
                if subject is None or sv.subject == subject]

    # -- compatibility ------------------------------------------------------------------------

    def check(self, subject: str, version: str | None, body: dict[str, Any], verbose: bool) -> dict[str, Any]:
        number = None if version is None else parse_version(version)
        parsed = self._parsed_body(body)
        with self.state.lock:
            level = self._level(subject)
            previous = self._previous(subject)
            old = None
            if number is not None and (previous or number != LATEST):
                old = self.state.parsed(self._find(subject, number).schema_id)
        deadline = time.monotonic() + self.check_timeout_s
        if number is None:
            found = self._checked(subject, partial(problems, parsed, previous, level), deadline)
        elif old is None:
            found = []
        else:
            found = self._checked(subject, partial(_both_ways, parsed, old, level), deadline)
        answer: dict[str, Any] = {"is_compatible": not found}
        if verbose:
            answer["messages"] = found
        return answer

    # -- config and mode ----------------------------------------------------------------------

    def get_config(self, subject: str | None, default_to_global: bool) -> dict[str, Any]:
        with self.state.lock:
            config = self.state.configs.get(subject)
            if config is None and subject is not None and not default_to_global:
                raise errors.compatibility_not_configured(subject)
            if config is None:
                config = self.state.configs.get(None) or {}
            return {**config, "compatibilityLevel": self._level(subject)}

    def set_config(self, subject: str | None, body: dict[str, Any]) -> dict[str, Any]:
        raw_level = body.get("compatibility", body.get("compatibilityLevel"))
        extras = {k: body[k] for k, kind in CONFIG_EXTRAS.items() if isinstance(body.get(k), kind)}
        if raw_level is None and not extras:
            raise errors.invalid_compatibility_level()

        def compute() -> tuple[list[Record], dict[str, Any]]:
            current = dict(self.state.configs.get(subject) or {})
            level = Level.parse(raw_level) if raw_level is not None else Level.parse(
                current.get("compatibilityLevel", self._level(subject).value))
            config = {**current, **extras, "compatibilityLevel": level.value}
            answer = {k: v for k, v in config.items() if k != "compatibilityLevel"}
            return [config_record(subject, config)], {**answer, "compatibility": level.value}

        return self._write(compute)

    def delete_config(self, subject: str | None) -> dict[str, Any]:
        def compute() -> tuple[list[Record], dict[str, Any]]:
            previous = self.state.configs.get(subject)
            if previous is None:
                if subject is not None:
                    raise errors.subject_not_found(subject)
                return [], {"compatibilityLevel": DEFAULT_LEVEL.value}
            return [config_record(subject, None)], dict(previous)

        return self._write(compute)

    def get_mode(self, subject: str | None, default_to_global: bool) -> dict[str, Any]:
        with self.state.lock:
            if subject is not None and subject not in self.state.modes and not default_to_global:
                raise errors.mode_not_configured(subject)
            return {"mode": self._mode(subject)}

    def set_mode(self, subject: str | None, body: dict[str, Any], force: bool) -> dict[str, Any]:
        raw = body.get("mode")
        if not isinstance(raw, str) or raw.strip().upper() not in MODES:
            raise errors.invalid_mode()
        mode = raw.strip().upper()

        def compute() -> tuple[list[Record], dict[str, Any]]:
            if mode == "IMPORT" and not force:
                in_use = self._live(subject) if subject is not None else [
                    sv for s in self.state.subjects for sv in self._live(s)]
                if in_use:
                    raise errors.operation_not_permitted("Cannot import since found existing subjects")
            return [mode_record(subject, mode)], {"mode": mode}

        return self._write(compute)

    def delete_mode(self, subject: str) -> dict[str, Any]:
        def compute() -> tuple[list[Record], dict[str, Any]]:
            previous = self.state.modes.get(subject)
            if previous is None:
                raise errors.subject_not_found(subject)
            return [mode_record(subject, None)], {"mode": previous}

        return self._write(compute)

    def metadata(self, subject: str, filters: dict[str, str], deleted: bool) -> dict[str, Any]:
        """No schema here carries metadata: only an empty filter can match (the latest version)."""
        with self.state.lock:
            sv = self._find(subject, LATEST, deleted)
            if filters:
                raise errors.version_not_found("with the requested metadata")
            return self._describe(sv)
