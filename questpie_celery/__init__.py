"""questpie_celery: schema-checked jobs, idempotency keys and a dispatch ledger for Celery.

The package in parts, from the bottom (docs/design.md draws them): `jobs/` (what a job
is), `ledger/` (the only code that talks SQL), `send/` (after the row, the message),
`canvas/` (chords and batches ended once), `intake/` (how a dispatch enters the ledger),
`publish/`, `worker/`, `ops/`, `config/`; `app.py`'s `Questpie` holds them, and `cli/`,
`beat.py`, `chords.py`, `web.py` and `testing/` are the entry points above it.
"""

from .adopted import LedgerRefused, LedgerTask
from .app import Questpie
from .chords import chord
from .errors import (
    BrokerError,
    CanvasError,
    ConfigurationError,
    HandlerAbortedError,
    InvalidInputError,
    JobDefinitionError,
    LedgerBusyError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    PayloadValidationError,
    PermanentFailure,
    PublishOptionsError,
    QuestpieError,
    ResultNotStorableError,
    SecretDecryptionError,
    SecretJobError,
    UnknownDispatchError,
    UnknownJobError,
)
from .jobs.definition import JobContext, JobDefinition, job
from .jobs.ids import derive_dispatch_id
from .jobs.keywords import JobOptions
from .jobs.policies import QueuePolicy, QueuePolicyName
from .ledger import metadata
from .ops.receipts import CanvasStatus, DispatchStatus, Receipt

__all__ = [
    "BrokerError",
    "CanvasError",
    "CanvasStatus",
    "ConfigurationError",
    "DispatchStatus",
    "HandlerAbortedError",
    "InvalidInputError",
    "JobContext",
    "JobDefinition",
    "JobDefinitionError",
    "JobOptions",
    "LedgerBusyError",
    "LedgerError",
    "LedgerRefused",
    "LedgerSchemaError",
    "LedgerTask",
    "LedgerUnavailableError",
    "PayloadValidationError",
    "PermanentFailure",
    "PublishOptionsError",
    "Questpie",
    "QuestpieError",
    "QueuePolicy",
    "QueuePolicyName",
    "Receipt",
    "ResultNotStorableError",
    "SecretDecryptionError",
    "SecretJobError",
    "UnknownDispatchError",
    "UnknownJobError",
    "chord",
    "derive_dispatch_id",
    "job",
    "metadata",
]
