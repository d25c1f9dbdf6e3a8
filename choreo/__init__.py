"""The choreography runtime: services are business rules; Kafka, Avro and Redis plumbing lives here once.

This is the runtime's public API, what a service module imports (``from choreo import ...``):
the handler API, the state a service declares (records, pools, joins), typed effects'
answers, the errors a rule raises and the ids it derives. Everything else is the runtime's
own and may change.
"""

from choreo.envelope import derived_id
from choreo.errors import Rejected, Retryable
from choreo.events import Event
from choreo.join import Joined, JoinFailed, Part
from choreo.pool import Pool, Reservation
from choreo.record import Record
from choreo.runtime_events import UndoRequested
from choreo.service import Context, Effects, Service
from choreo.workflow import Workflow

__all__ = [
    "Context", "Effects", "Event", "JoinFailed", "Joined", "Part", "Pool", "Record", "Rejected",
    "Reservation", "Retryable", "Service", "UndoRequested", "Workflow", "derived_id",
]
