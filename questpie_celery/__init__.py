"""questpie_celery: schema-checked jobs, idempotency keys and a dispatch ledger for Celery."""

from .app import Questpie
from .errors import (
    BrokerError,
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
    SecretDecryptionError,
    SecretJobError,
    UnknownJobError,
)
from .ids import derive_dispatch_id
from .jobs import JobContext, JobDefinition, job
from .ledger import metadata
from .options import JobOptions
from .policies import QueuePolicy, QueuePolicyName
from .receipts import DispatchStatus, Receipt

__all__ = [
    "BrokerError",
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
    "LedgerSchemaError",
    "LedgerUnavailableError",
    "PayloadValidationError",
    "PermanentFailure",
    "PublishOptionsError",
    "Questpie",
    "QuestpieError",
    "QueuePolicy",
    "QueuePolicyName",
    "Receipt",
    "SecretDecryptionError",
    "SecretJobError",
    "UnknownJobError",
    "derive_dispatch_id",
    "job",
    "metadata",
]
