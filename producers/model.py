"""The delivery request as clients send it, and its one translation into ``DeliveryRequested``.

The ranges of the event contract (``schemas.models``) are reused, not restated: the request
model subclasses the event's ``Location``. What is added here is what only an untrusted
edge needs: strict JSON types (no ``"52.5"`` for a number), no NaN or infinity, no control
or bidi characters in free text, a deadline that is in the future and not absurdly far, a
reply topic that is a legal Kafka name under the configured reply prefix (one prefixed
ACL; so it cannot feed the pipeline's own topics, a feedback loop), and an owner id that is safe to use in a Redis key.
"""

from __future__ import annotations

import re
import unicodedata
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from choreo.outcomes import refusal
from schemas.models import DeliveryRequested, Location, PackageSize

MAX_DEADLINE_AHEAD = timedelta(days=30)
OWNER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
TOPIC_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# Free-text categories refused: control, format (bidi overrides, zero-width), surrogates.
_HOSTILE_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
# Prefixes a reply topic may not take: the pipeline's own and Kafka's internal topics.
RESERVED_TOPIC_PREFIXES = (
    "_", "delivery.", "package.", "drone.", "retry.", "recovery", "compensation.",
)


def _contract_bound(field: str, bound: str) -> float:
    """A bound of the event contract's field, so the edge never drifts from the contract."""
    for item in DeliveryRequested.model_fields[field].metadata:
        if getattr(item, bound, None) is not None:
            return float(getattr(item, bound))
    raise LookupError(f"DeliveryRequested.{field} has no {bound} bound")


def _check_text(value: str) -> str:
    for ch in value:
        if unicodedata.category(ch) in _HOSTILE_CATEGORIES:
            raise ValueError(f"contains a control or formatting character (U+{ord(ch):04X})")
    if not value.strip():
        raise ValueError("must not be blank")
    return value


class LocationIn(Location):
    """A location from outside: the contract's ranges, strict numbers, clean address text."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("address")
    @classmethod
    def _clean_address(cls, value: str) -> str:
        return _check_text(value)

    def to_location(self) -> Location:
        return Location(lat=self.lat, lon=self.lon, address=self.address)


class DeliveryRequestIn(BaseModel):
    """``POST /deliveries``: what a client may send. Unknown fields are refused, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    owner_id: str = Field(pattern=OWNER_ID_PATTERN, description="The account that owns the delivery")
    pickup: LocationIn
    dropoff: LocationIn
    package_size: PackageSize
    weight_kg: float = Field(gt=0, le=_contract_bound("weight_kg", "le"))
    # strict=False: ISO-8601 strings are welcome from Python dicts too, not only from JSON
    deadline: AwareDatetime | None = Field(None, strict=False,
                                           description="Timezone-aware; future, at most 30 days ahead")
    reply_topic: str | None = Field(None, description="A Kafka topic to copy the outcome to: "
                                    "under the reply prefix (CHOREO_REPLY_TOPIC_PREFIX, `replies.`)")

    @field_validator("deadline")
    @classmethod
    def _sane_deadline(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        now = datetime.now(UTC)
        if value <= now:
            raise ValueError("must be in the future")
        if value > now + MAX_DEADLINE_AHEAD:
            raise ValueError(f"must be at most {MAX_DEADLINE_AHEAD.days} days ahead")
        return value

    @field_validator("reply_topic")
    @classmethod
    def _legal_topic(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not TOPIC_PATTERN.fullmatch(value) or value in (".", ".."):
            raise ValueError("must be a Kafka topic name: 1-249 of [A-Za-z0-9._-]")
        if value.startswith(RESERVED_TOPIC_PREFIXES):
            raise ValueError("must not be one of the pipeline's own or internal topics")
        why = refusal(value)
        if why is not None:
            raise ValueError(f"must be a reply topic: {why}")
        return value

    def to_event(self, delivery_id: str, requested_at: datetime) -> DeliveryRequested:
        return DeliveryRequested(
            delivery_id=delivery_id, owner_id=self.owner_id,
            pickup=self.pickup.to_location(), dropoff=self.dropoff.to_location(),
            package_size=self.package_size, weight_kg=self.weight_kg,
            deadline=self.deadline, reply_topic=self.reply_topic, requested_at=requested_at,
        )

    def fingerprint(self) -> str:
        """A canonical form of the request: equal for the same request however it was written."""
        return self.model_dump_json()

    @property
    def deadline_ms(self) -> int:
        return int(self.deadline.timestamp() * 1000) if self.deadline else 0


MAX_FIELD_ERRORS = 20  # of a refused request's errors, told
MAX_FIELD_CHARS = 100  # of a field's path in one


class InvalidRequest(ValueError):
    """The request cannot become a delivery; ``errors`` says which fields and why."""

    def __init__(self, errors: list[dict[str, Any]], malformed: bool = False, total: int | None = None) -> None:
        self.errors = errors
        self.total = len(errors) if total is None else total  # ``errors`` may be the first of them
        self.malformed = malformed  # not JSON at all (or nested too deep), as opposed to invalid
        self.accepted: list[str] = []  # what a batch submit had confirmed before it
        summary = "; ".join(f"{e['field'] or '(body)'}: {e['message']}" for e in errors[:5])
        super().__init__(summary)


def _field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """pydantic's first ``MAX_FIELD_ERRORS`` errors without the offending input (which may be
    customer data), each field's path cut: a 64 KiB body of unknown keys is thousands of
    errors, an answer ten times its size, and a key is the client's own text."""
    return [
        {"field": ".".join(str(p) for p in e["loc"])[:MAX_FIELD_CHARS], "message": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_input=False, include_context=False)[:MAX_FIELD_ERRORS]
    ]


def parse_request(data: DeliveryRequestIn | dict[str, Any] | bytes | str) -> DeliveryRequestIn:
    """Validate a request from any entry point; JSON text is parsed strictly, without a
    detour through ``json.loads`` (pydantic's parser bounds nesting depth itself)."""
    if isinstance(data, DeliveryRequestIn):
        return data
    try:
        if isinstance(data, (bytes, str)):
            return DeliveryRequestIn.model_validate_json(data)
        return DeliveryRequestIn.model_validate(data)
    except ValidationError as exc:
        errors = _field_errors(exc)
        raise InvalidRequest(errors, malformed=any(e["type"] == "json_invalid" for e in errors),
                             total=exc.error_count()) from None
