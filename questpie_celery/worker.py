"""The worker side: the Celery task a job compiles to, and the execution fence.

For a ledgered dispatch every delivery first takes the execution claim in the
ledger. A delivery that cannot (the dispatch is finished, the delivery is stale,
or another worker holds a live claim) ends with `Ignore`, so Celery neither runs
the handler nor stores a result over the real one. Only the claim holder records
the outcome. Plain Celery calls (`delay`, `send_task`, Canvas) carry no ledger
row and run unfenced, with Celery's own retries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore

from .broker import HEADER, MessageHeader
from .crypto import Keyring, Sealed
from .dispatch import relay_time_for_retry
from .errors import (
    PayloadValidationError,
    PermanentFailure,
    SecretDecryptionError,
    SecretJobError,
)
from .jobs import JobContext, JobDefinition
from .leases import LeaseKeeper
from .ledger import DispatchRow, Ledger
from .options import RunOptions, resolve_options
from .slots import SlotKeeper

log = logging.getLogger(__name__)


class JobTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Base class of the Celery task each job compiles to."""

    #: Retry limits are ours (per dispatch, in the message header), not Celery's.
    max_retries = None
    questpie_definition: JobDefinition[Any]


class Runner:
    """Runs deliveries of every job registered with one `Questpie`."""

    def __init__(
        self,
        ledger: Ledger,
        leases: LeaseKeeper,
        slots: SlotKeeper,
        keyring: Keyring | None,
    ) -> None:
        self.ledger = ledger
        self.leases = leases
        self.slots = slots
        self.keyring = keyring

    def register(self, app: Celery, definition: JobDefinition[Any]) -> Any:
        """Create the Celery task named after the job on `app`."""
        runner = self

        def run(task: JobTask, payload: Any = None) -> Any:
            return runner.execute(task, payload)

        run.__name__ = definition.attribute_name
        run.__doc__ = definition.handler.__doc__
        return app.task(
            name=definition.name,
            bind=True,
            base=JobTask,
            shared=False,
            serializer="json",
            questpie_definition=definition,
        )(run)

    def execute(self, task: JobTask, payload: Any) -> Any:
        definition = task.questpie_definition
        header = MessageHeader.from_request(task.request)
        if header is not None and header.ledgered:
            return self._run_fenced(task, definition, header, payload)
        return self._run_plain(task, definition, header, payload)

    # plain Celery calls and unkeyed standard dispatches: no ledger row

    def _run_plain(
        self,
        task: JobTask,
        definition: JobDefinition[Any],
        header: MessageHeader | None,
        payload: Any,
    ) -> Any:
        run = header.run if header is not None else resolve_options(definition.options, {}).run
        attempt = int(task.request.retries or 0) + 1
        model = definition.validate(payload)
        ctx = JobContext(
            dispatch_id=task.request.id,
            job_name=definition.name,
            idempotency_key=None,
            attempt=attempt,
            retry_limit=run.retry_limit,
        )
        try:
            return _call(definition, model, ctx)
        except PermanentFailure:
            raise
        except Exception as exc:
            if attempt > run.retry_limit:
                raise
            raise task.retry(exc=exc, countdown=run.delay_before_retry(attempt)) from None

    # ledgered dispatches: claim, run, record

    def _run_fenced(
        self,
        task: JobTask,
        definition: JobDefinition[Any],
        header: MessageHeader,
        payload: Any,
    ) -> Any:
        dispatch_id: str = task.request.id
        claim = self.ledger.claim(dispatch_id, header.attempt, self.leases.lease_seconds)
        if claim.outcome == "blocked":
            # Another run holds the slot: set this one aside, acknowledged and uncounted.
            self.slots.park(dispatch_id, header.attempt)
            raise Ignore()
        if claim.outcome != "claimed" or claim.row is None or claim.token is None:
            log.info(
                "dispatch %s of job %s: delivery for attempt %d skipped (%s)",
                dispatch_id,
                definition.name,
                header.attempt,
                claim.outcome,
                extra={"dispatch_id": dispatch_id, "job_name": definition.name},
            )
            raise Ignore()
        row, token = claim.row, claim.token
        run = RunOptions.from_dict(row.options.get("run"))
        # Exceptions are handled after their `except` block has closed, so that what we
        # raise for a secret dispatch carries no __context__ that could hold plaintext.
        failure: Exception | None = None
        for_good = False
        result: Any = None
        try:
            model = self._payload_of(definition, row, payload)
            ctx = JobContext(
                dispatch_id=dispatch_id,
                job_name=definition.name,
                idempotency_key=row.idempotency_key,
                attempt=row.attempt,
                retry_limit=run.retry_limit,
                singleton_key=row.singleton_key,
            )
            with self.leases.hold(dispatch_id, token, run.expire_in_seconds):
                result = _call(definition, model, ctx)
        except (PayloadValidationError, SecretDecryptionError, PermanentFailure) as exc:
            failure = exc
            # A bad payload or ciphertext is not mended by retrying; a worker missing the
            # right secret might be, by a better-configured one.
            for_good = not getattr(exc, "retryable", False)
        except Exception as exc:
            failure = exc
        if failure is not None:
            if for_good or row.attempt > run.retry_limit:
                self._record_failure(row, token, failure)
                raise _sanitized(row, failure)
            self._retry(
                task,
                definition=definition,
                dispatch_id=dispatch_id,
                token=token,
                attempt=row.attempt,
                run=run,
                exc=_sanitized(row, failure),
            )
        if not self.ledger.complete(dispatch_id, token):
            # Our lease lapsed and the dispatch moved on; its new holder records it.
            log.warning(
                "dispatch %s finished after losing its claim; outcome not recorded",
                dispatch_id,
                extra={"dispatch_id": dispatch_id},
            )
            raise Ignore()
        self.slots.hand_on(row)
        # A secret dispatch's return value is never stored: it may echo the payload.
        return None if row.secret else result

    def _payload_of(
        self, definition: JobDefinition[Any], row: DispatchRow, message_payload: Any
    ) -> Any:
        """The validated payload: decrypted for a secret dispatch, else the first accepted."""
        if not row.secret:
            return definition.validate(row.payload if row.payload is not None else message_payload)
        if self.keyring is None:
            raise SecretDecryptionError("this worker has no secret configured", retryable=True)
        if row.secret_ciphertext is None or row.secret_wrapped_key is None:
            raise SecretDecryptionError("the secret payload's key was erased")
        plaintext = self.keyring.open(
            Sealed(row.secret_ciphertext, row.secret_wrapped_key, row.secret_key_id or ""),
            job_name=row.job_name,
            dispatch_id=row.id,
        )
        return definition.validate(plaintext)

    def _record_failure(self, row: DispatchRow, token: str, exc: BaseException) -> None:
        if not self.ledger.fail(row.id, token, type(exc).__name__):
            log.warning(
                "dispatch %s failed after losing its claim; outcome not recorded",
                row.id,
                extra={"dispatch_id": row.id},
            )
            raise Ignore()
        self.slots.hand_on(row)

    def _retry(
        self,
        task: JobTask,
        *,
        definition: JobDefinition[Any],
        dispatch_id: str,
        token: str,
        attempt: int,
        run: RunOptions,
        exc: Exception,
    ) -> None:
        delay = run.delay_before_retry(attempt)
        relay_at = relay_time_for_retry(delay)
        if relay_at is not None:
            # A long wait stays in the ledger, not in a worker's memory as an ETA.
            if self.ledger.schedule_retry(
                dispatch_id, token, delay, type(exc).__name__, relay_at=relay_at
            ):
                log.info(
                    "dispatch %s: attempt %d failed (%s); the relay sends retry in %.0fs",
                    dispatch_id,
                    attempt,
                    type(exc).__name__,
                    delay,
                    extra={"dispatch_id": dispatch_id, "job_name": definition.name},
                )
            raise Ignore()
        if not self.ledger.schedule_retry(
            dispatch_id, token, delay, type(exc).__name__, relay_at=None
        ):
            raise Ignore()
        header = MessageHeader(ledgered=True, attempt=attempt + 1, run=run)
        try:
            retry = task.retry(
                exc=exc, countdown=delay, headers={HEADER: header.to_dict()}, throw=False
            )
        except Exception as send_error:
            # The retry is recorded in the ledger; the relay sends it when it is due.
            log.warning(
                "dispatch %s: could not send retry %d (%s); it stays in the ledger",
                dispatch_id,
                attempt,
                type(send_error).__name__,
                extra={"dispatch_id": dispatch_id, "job_name": definition.name},
            )
            raise Ignore() from None
        raise retry from None


def _sanitized(row: DispatchRow, exc: Exception) -> Exception:
    """For a secret dispatch, the exception Celery may see: its class name, nothing else.

    It is created fresh outside any `except` block: no __cause__, no __context__.
    """
    if not row.secret:
        return exc
    error = SecretJobError(type(exc).__name__)
    error.__suppress_context__ = True
    return error


def _call(definition: JobDefinition[Any], model: Any, ctx: JobContext) -> Any:
    if definition.is_async:
        return asyncio.run(definition.handler(model, ctx))
    return definition.handler(model, ctx)
