"""questpie_celery: schema-checked jobs, idempotency keys and a dispatch ledger for Celery."""

from .app import Questpie
from .errors import (
    BrokerError,
    ConfigurationError,
    InvalidInputError,
    JobDefinitionError,
    LedgerError,
    LedgerSchemaError,
    LedgerUnavailableError,
    PayloadValidationError,
    PermanentFailure,
    PublishOptionsError,
    QuestpieError,
    UnknownJobError,
)
from .ids import derive_dispatch_id
from .jobs import JobContext, JobDefinition, job
from .ledger import metadata
from .options import JobOptions, QueuePolicy
from .receipts import Receipt

__all__ = [
    "BrokerError",
    "ConfigurationError",
    "InvalidInputError",
    "JobContext",
    "JobDefinition",
    "JobDefinitionError",
    "JobOptions",
    "LedgerError",
    "LedgerSchemaError",
    "LedgerUnavailableError",
    "PayloadValidationError",
    "PermanentFailure",
    "PublishOptionsError",
    "Questpie",
    "QuestpieError",
    "QueuePolicy",
    "Receipt",
    "UnknownJobError",
    "derive_dispatch_id",
    "job",
    "metadata",
]
