"""questpie_celery: schema-checked jobs, idempotency keys and a dispatch ledger for Celery.

The names below are imported on first use, not with the package: `questpie_celery.testing`
is a pytest plugin that every pytest run in an environment with this package loads, and
it must not cost those runs Celery, SQLAlchemy and pydantic (see docs/testing.md).
"""

import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing

if _typing.TYPE_CHECKING:
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
        UnknownDispatchError,
        UnknownJobError,
    )
    from .jobs.definition import JobContext, JobDefinition, job
    from .jobs.ids import derive_dispatch_id
    from .jobs.options import JobOptions
    from .jobs.policies import QueuePolicy, QueuePolicyName
    from .ledger import metadata
    from .ops.receipts import DispatchStatus, Receipt

#: Each exported name and the module it comes from.
_FROM = {
    "Questpie": ".app",
    **dict.fromkeys(
        (
            "BrokerError",
            "ConfigurationError",
            "HandlerAbortedError",
            "InvalidInputError",
            "JobDefinitionError",
            "LedgerBusyError",
            "LedgerError",
            "LedgerSchemaError",
            "LedgerUnavailableError",
            "PayloadValidationError",
            "PermanentFailure",
            "PublishOptionsError",
            "QuestpieError",
            "SecretDecryptionError",
            "SecretJobError",
            "UnknownDispatchError",
            "UnknownJobError",
        ),
        ".errors",
    ),
    "derive_dispatch_id": ".jobs.ids",
    "JobContext": ".jobs.definition",
    "JobDefinition": ".jobs.definition",
    "job": ".jobs.definition",
    "metadata": ".ledger",
    "JobOptions": ".jobs.options",
    "QueuePolicy": ".jobs.policies",
    "QueuePolicyName": ".jobs.policies",
    "DispatchStatus": ".ops.receipts",
    "Receipt": ".ops.receipts",
}

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
    "UnknownDispatchError",
    "UnknownJobError",
    "derive_dispatch_id",
    "job",
    "metadata",
]


def __getattr__(name: str) -> object:
    module = _FROM.get(name)
    if module is None:
        # `questpie_celery.errors` and the like: a submodule, imported on first use too.
        if not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}"):
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    # Not the names pytest's assertion rewriting adds to a module (`@py_builtins`): it
    # rewrites every module of a distribution that has a pytest plugin, as this one does.
    return sorted(name for name in set(globals()) | set(__all__) if name.isidentifier())
