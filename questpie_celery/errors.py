"""The error hierarchy. Every error this package raises derives from `QuestpieError`.

    QuestpieError
    ├── ConfigurationError (ValueError)    the Questpie(...) configuration
    │   └── JobDefinitionError             a @job's definition
    ├── InvalidInputError (ValueError)     bad input; nothing was written or sent
    │   ├── PayloadValidationError         a payload its schema refuses
    │   ├── PublishOptionsError            a publishing call's options
    │   ├── DispatchIdError                a delivery's task id no ledger row can have
    │   └── MalformedHeaderError           a delivery's header questpie did not write
    ├── UnknownJobError (KeyError)         no job of that name
    ├── UnknownDispatchError (KeyError)    no dispatch of that id (or none could have it)
    ├── LedgerError                        the ledger's database failed a statement
    │   ├── LedgerUnavailableError         out of reach: try again
    │   ├── LedgerBusyError                a row held by another transaction
    │   └── LedgerSchemaError              not migrated: run `questpie-celery migrate`
    ├── BrokerError                        the broker did not accept the message
    ├── PermanentFailure                   raised by a handler: failed for good
    ├── SecretDecryptionError              a secret payload that could not be opened
    ├── SecretJobError                     a secret run's failure, its class name only
    ├── HandlerAbortedError                a handler raised a BaseException
    ├── ClaimLostError                     a run lost its claim before it ended
    ├── ResultNotStorableError             a return value the ledger cannot hold
    └── CanvasError (TypeError)            a chord or batch that cannot be made durable

Bad input additionally derives from `ValueError`, and a missing name from `KeyError`,
so callers that already catch those around argument handling keep working. The class
docstring is the default message.
"""

from __future__ import annotations


class QuestpieError(Exception):
    """questpie_celery failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message if message is not None else _first_line(type(self).__doc__))


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().splitlines()[0] if doc else ""


class ConfigurationError(QuestpieError, ValueError):
    """The Questpie configuration is invalid."""


class JobDefinitionError(ConfigurationError):
    """The job definition is invalid or collides with another one."""


class InvalidInputError(QuestpieError, ValueError):
    """A call received invalid input; nothing was written."""


class PayloadValidationError(InvalidInputError):
    """The payload does not match the job's schema."""


class PublishOptionsError(InvalidInputError):
    """A dispatch option is invalid."""


class DispatchIdError(InvalidInputError):
    """The delivery's task id cannot be a dispatch id in the ledger; it was not run."""


class MalformedHeaderError(InvalidInputError):
    """A delivery's `questpie` header is not one questpie writes; it was not run."""


class UnknownJobError(QuestpieError, KeyError):
    """No job of that name is registered."""

    def __str__(self) -> str:
        # KeyError.__str__ quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class UnknownDispatchError(QuestpieError, KeyError):
    """The ledger holds no dispatch of that id: it never had a row (an unkeyed
    dispatch of a standard job without limits is a plain Celery message), or retention
    removed it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LedgerError(QuestpieError):
    """The dispatch ledger database failed."""


class LedgerUnavailableError(LedgerError):
    """The dispatch ledger database cannot be reached."""


class LedgerBusyError(LedgerError):
    """A ledger row is held by another open transaction; try again once it ends."""


class LedgerSchemaError(LedgerError):
    """The dispatch ledger tables are missing or out of date; run `questpie-celery migrate`."""


class BrokerError(QuestpieError):
    """The broker did not accept the message."""


class PermanentFailure(QuestpieError):
    """Raised by a handler to fail the run for good, without retries."""


class SecretDecryptionError(QuestpieError):
    """A secret payload could not be decrypted; the handler was not run."""

    def __init__(self, message: str | None = None, *, retryable: bool = False) -> None:
        super().__init__(message)
        #: True when another worker (one holding the right secret) could succeed.
        self.retryable = retryable


class SecretJobError(QuestpieError):
    """A secret dispatch's run failed; only the exception's class name is kept.

    Raised `from None` in place of the real exception, so no message, argument or
    cause that might hold the plaintext reaches Celery's logs, events or results.
    """


class HandlerAbortedError(QuestpieError):
    """The handler raised a BaseException that is not an Exception (such as
    `asyncio.CancelledError`); Celery sees this in its place, the ledger its class name."""


class ClaimLostError(QuestpieError):
    """A run lost its claim before it ended: it ran past its time cap, or the ledger was
    out of reach for longer than a lease. Its context is closed with this error (so a
    context that commits on close rolls back instead), and its outcome is left to the
    relay, which retries or fails the dispatch."""


class ResultNotStorableError(QuestpieError):
    """A run's return value could not be kept in the ledger: its serializer refused it,
    or it is larger than `MAX_RESULT_BYTES`. It is never truncated: a chord's or batch's
    member fails with this error (its callback needs the value), any other run completes
    without a stored result."""


class CanvasError(QuestpieError, TypeError):
    """A chord or batch that cannot be made durable as given (a member, body or callback
    that is not a `LedgerTask`, a nested group); nothing was written or sent."""
