"""The registry's error vocabulary, mirroring Confluent Schema Registry's codes and messages.

Clients (confluent-kafka, Karapace tooling, curl scripts) branch on ``error_code`` and on the
HTTP status, so both must be exactly what the real registry sends; the messages follow the
real ones closely so that people searching for them find the usual explanations.
"""

from __future__ import annotations

from typing import Any

HTTP_BAD_REQUEST = 400
HTTP_NOT_FOUND = 404
HTTP_METHOD_NOT_ALLOWED = 405
HTTP_CONFLICT = 409
HTTP_TOO_LARGE = 413
HTTP_UNSUPPORTED_MEDIA = 415
HTTP_UNPROCESSABLE = 422
HTTP_INTERNAL = 500

SUBJECT_NOT_FOUND = 40401
VERSION_NOT_FOUND = 40402
SCHEMA_NOT_FOUND = 40403
SUBJECT_SOFT_DELETED = 40404
SUBJECT_NOT_SOFT_DELETED = 40405
SCHEMAVERSION_SOFT_DELETED = 40406
SCHEMAVERSION_NOT_SOFT_DELETED = 40407
SUBJECT_COMPATIBILITY_NOT_CONFIGURED = 40408
SUBJECT_MODE_NOT_CONFIGURED = 40409
INCOMPATIBLE_SCHEMA = 409
INVALID_SCHEMA = 42201
INVALID_VERSION = 42202
INVALID_COMPATIBILITY_LEVEL = 42203
INVALID_MODE = 42204
OPERATION_NOT_PERMITTED = 42205
REFERENCE_EXISTS = 42206
INVALID_SUBJECT = 42208
STORE_ERROR = 50001
OPERATION_TIMEOUT = 50002
REQUEST_FORWARDING_FAILED = 50003


class RegistryError(Exception):
    """An answer to the client that is not a success: carries the HTTP status and error code."""

    def __init__(self, status: int, error_code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error_code": self.error_code, "message": self.message}


class NotLeaderError(RegistryError):
    """This instance may not write; ``leader_url`` is where the write should go (None: nobody leads)."""

    def __init__(self, leader_url: str | None) -> None:
        super().__init__(
            HTTP_INTERNAL,
            REQUEST_FORWARDING_FAILED,
            "Error while forwarding the request to the leader: "
            + (f"leader at {leader_url} did not answer" if leader_url else "no leader is elected"),
        )
        self.leader_url = leader_url


def http_error(status: int, reason: str) -> RegistryError:
    """The plain JAX-RS answers (unknown path, wrong method...) the real registry gives, e.g. 404/404."""
    return RegistryError(status, status, f"HTTP {status} {reason}")


def subject_not_found(subject: str) -> RegistryError:
    return RegistryError(HTTP_NOT_FOUND, SUBJECT_NOT_FOUND, f"Subject '{subject}' not found.")


def version_not_found(version: int | str) -> RegistryError:
    return RegistryError(HTTP_NOT_FOUND, VERSION_NOT_FOUND, f"Version {version} not found.")


def schema_not_found(schema_id: int | str | None = None) -> RegistryError:
    text = "Schema not found" if schema_id is None else f"Schema {schema_id} not found"
    return RegistryError(HTTP_NOT_FOUND, SCHEMA_NOT_FOUND, text)


def subject_soft_deleted(subject: str) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SUBJECT_SOFT_DELETED,
        f"Subject '{subject}' was soft deleted. Set permanent=true to delete permanently",
    )


def subject_not_soft_deleted(subject: str) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SUBJECT_NOT_SOFT_DELETED,
        f"Subject '{subject}' was not deleted first before being permanently deleted",
    )


def version_soft_deleted(subject: str, version: int) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SCHEMAVERSION_SOFT_DELETED,
        f"Subject '{subject}' Version {version} was soft deleted. Set permanent=true to delete permanently",
    )


def version_not_soft_deleted(subject: str, version: int) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SCHEMAVERSION_NOT_SOFT_DELETED,
        f"Subject '{subject}' Version {version} was not deleted first before being permanently deleted",
    )


def compatibility_not_configured(subject: str) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SUBJECT_COMPATIBILITY_NOT_CONFIGURED,
        f"Subject '{subject}' does not have subject-level compatibility configured",
    )


def mode_not_configured(subject: str) -> RegistryError:
    return RegistryError(
        HTTP_NOT_FOUND, SUBJECT_MODE_NOT_CONFIGURED,
        f"Subject '{subject}' does not have subject-level mode configured",
    )


def invalid_schema(detail: str) -> RegistryError:
    return RegistryError(HTTP_UNPROCESSABLE, INVALID_SCHEMA, f"Invalid schema: {detail}")


def invalid_version(version: str) -> RegistryError:
    return RegistryError(
        HTTP_UNPROCESSABLE, INVALID_VERSION,
        f"The specified version '{version}' is not a valid version id. "
        'Allowed values are between [1, 2^31-1] and the string "latest"',
    )


def invalid_compatibility_level() -> RegistryError:
    return RegistryError(
        HTTP_UNPROCESSABLE, INVALID_COMPATIBILITY_LEVEL,
        "Invalid compatibility level. Valid values are none, backward, forward, full, "
        "backward_transitive, forward_transitive, and full_transitive",
    )


def invalid_mode() -> RegistryError:
    return RegistryError(
        HTTP_UNPROCESSABLE, INVALID_MODE,
        "Invalid mode. Valid values are READWRITE, READONLY, READONLY_OVERRIDE, IMPORT",
    )


def operation_not_permitted(message: str) -> RegistryError:
    return RegistryError(HTTP_UNPROCESSABLE, OPERATION_NOT_PERMITTED, message)


def reference_not_found(subject: str, version: int) -> RegistryError:
    """Confluent refuses a reference to nothing as an invalid schema, with this wording."""
    return invalid_schema(f'No schema reference found for subject "{subject}" and version {version}')


def reference_exists(subject: str, version: int) -> RegistryError:
    return RegistryError(HTTP_UNPROCESSABLE, REFERENCE_EXISTS,
                         f"One or more references exist to the schema {{subject={subject}, version={version}}}")


def invalid_subject(shown: str) -> RegistryError:
    return RegistryError(HTTP_UNPROCESSABLE, INVALID_SUBJECT, f"Invalid subject {shown}")


def incompatible(subject: str, details: list[str]) -> RegistryError:
    return RegistryError(
        HTTP_CONFLICT, INCOMPATIBLE_SCHEMA,
        f'Schema being registered is incompatible with an earlier schema for subject "{subject}", '
        f"details: [{', '.join(details)}]",
    )


def store_error(detail: str) -> RegistryError:
    return RegistryError(HTTP_INTERNAL, STORE_ERROR, f"Error while registering schema: {detail}")


def operation_timeout(detail: str) -> RegistryError:
    return RegistryError(HTTP_INTERNAL, OPERATION_TIMEOUT, f"Operation timed out: {detail}")
