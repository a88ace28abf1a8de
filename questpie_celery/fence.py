"""The execution fence: every delivery of a ledgered dispatch runs through it.

Celery brokers do not deduplicate task ids, so before a handler runs, the
delivery takes the dispatch's execution claim in the ledger: a conditional
update bound to the dispatch id, the job and the attempt the message is for.
A delivery that cannot (the dispatch is finished, the delivery is stale, another
worker holds a live claim, or the id belongs to another job) ends with `Ignore`,
so Celery neither runs the handler nor stores a result over the real one. A
delivery whose policy slot is busy is parked. Only the claim holder records the
outcome, through `Outcomes`.

A plain Celery call (`delay`, `send_task`, Canvas, a beat entry) of a job whose
queue policy is not `standard` is taken into the ledger here first, as a row
under the message's id, so its policy holds however it was sent.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Retry
from celery.states import STARTED

from .broker import carry_from_request
from .crypto import Keyring, Sealed
from .errors import (
    HandlerAbortedError,
    LedgerUnavailableError,
    PayloadValidationError,
    PermanentFailure,
    SecretDecryptionError,
    SecretJobError,
)
from .jobs import JobContext, JobDefinition, call_handler
from .leases import LeaseKeeper
from .ledger import Claim, DispatchRow, Ledger, NewDispatch
from .options import StoredOptions, resolve_options
from .outcomes import Outcomes
from .policies import QueuePolicy
from .signals import publish_suppressed
from .slots import Slots

log = logging.getLogger(__name__)

#: How long a delivery waits for an unreachable ledger before going back to the broker.
CLAIM_PATIENCE_SECONDS = 30.0
#: The countdown of a delivery sent back to the broker while the ledger is unreachable.
REQUEUE_DELAY_SECONDS = 5.0


class Fence:
    def __init__(
        self,
        ledger: Ledger,
        leases: LeaseKeeper,
        slots: Slots,
        outcomes: Outcomes,
        keyring: Keyring | None,
        *,
        redeliver_after: Callable[[], float],
    ) -> None:
        self._ledger = ledger
        self._leases = leases
        self._slots = slots
        self._outcomes = outcomes
        self._keyring = keyring
        self._redeliver_after = redeliver_after

    def adopt_and_run(
        self, task: Task, definition: JobDefinition[Any], policy: QueuePolicy, payload: Any
    ) -> Any:
        """Take an unledgered delivery of a policy-limited job into the ledger, then run it."""
        body = definition.to_json(payload)  # a malformed payload fails the message
        options = resolve_options(definition.options, {})
        delivery = task.request.delivery_info or {}
        new = NewDispatch(
            id=task.request.id,
            job_name=definition.name,
            payload=body,
            options=StoredOptions(
                run=options.run,
                priority=options.priority,
                queue=delivery.get("routing_key") or options.queue,
                carry=carry_from_request(task.request),
            ),
            singleton_key=options.singleton_key,
            policy=policy,
            status="queued",  # the broker has it already: this is its delivery
            send_in=self._redeliver_after(),
        )

        def adopt() -> bool:
            return self._ledger.insert(new) or self._ledger.exists(new.id)

        if not self._patiently(task, adopt):
            log.info(
                "delivery %s of job %s suppressed by its %s queue policy (slot %r is taken)",
                new.id,
                new.job_name,
                policy,
                new.slot,
                extra={"dispatch_id": new.id, "job_name": new.job_name},
            )
            publish_suppressed.send(
                sender=new.job_name,
                job_name=new.job_name,
                singleton_key=new.singleton_key,
                policy=str(policy),
            )
            raise Ignore()
        return self.run(task, definition, attempt=1, payload=body)

    def run(self, task: Task, definition: JobDefinition[Any], *, attempt: int, payload: Any) -> Any:
        """Claim delivery `attempt`, run the handler under a renewed lease, record the end."""
        dispatch_id: str = task.request.id
        claim: Claim = self._patiently(
            task,
            lambda: self._ledger.claim(
                dispatch_id, definition.name, attempt, self._leases.lease_seconds
            ),
        )
        if claim.outcome == "blocked":
            # Another run holds the slot: set this one aside, acknowledged and uncounted.
            self._slots.park(dispatch_id, definition.name, attempt)
            raise Ignore()
        if claim.outcome != "claimed" or claim.row is None or claim.token is None:
            log.info(
                "dispatch %s of job %s: delivery for attempt %d skipped (%s)",
                dispatch_id,
                definition.name,
                attempt,
                claim.outcome,
                extra={"dispatch_id": dispatch_id, "job_name": definition.name},
            )
            raise Ignore()
        row, token = claim.row, claim.token
        mark_started(task)
        run = row.options.run
        # Exceptions are handled after their `except` block has closed, so that what we
        # raise for a secret dispatch carries no __context__ that could hold plaintext.
        failure: BaseException | None = None
        for_good = False
        result: Any = None
        with self._leases.hold(dispatch_id, token, run.expire_in_seconds) as lease:
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
                result = call_handler(definition, model, ctx)
            except (PayloadValidationError, SecretDecryptionError, PermanentFailure) as exc:
                failure = exc
                # A bad payload or ciphertext is not mended by retrying; a worker missing
                # the right secret might be, by a better-configured one.
                for_good = not getattr(exc, "retryable", False)
            except BaseException as exc:  # every end is recorded, see below
                failure = exc
        until = lease.expires
        if failure is None:
            if not self._outcomes.completed(row, token, until=until):
                raise Ignore()
            # A secret dispatch's return value is never stored: it may echo the payload.
            return None if row.secret else result
        ending = self._outcomes.attempt_failed(
            row,
            token,
            type(failure).__name__,
            for_good=for_good,
            carry=carry_from_request(task.request),
            until=until,
        )
        if isinstance(failure, KeyboardInterrupt | SystemExit):
            # Recorded; now let the process stop as it was asked to.
            raise (type(failure)() if row.secret else failure) from None
        seen = _as_celery_sees_it(row, failure)
        if ending == "failed":
            raise seen
        if ending == "retrying":
            delay = run.delay_before_retry(row.attempt)
            raise Retry(exc=seen, when=delay) from None
        raise Ignore()

    def _patiently(self, task: Task, step: Any) -> Any:
        """Run a fence step, waiting out a short ledger outage; past the patience, send
        the delivery back to the broker rather than acknowledge it and lose the run."""
        deadline = time.monotonic() + CLAIM_PATIENCE_SECONDS
        pause = 0.2
        while True:
            try:
                return step()
            except LedgerUnavailableError as exc:
                if task.request.is_eager:
                    raise  # publish() is waiting on this run inline: tell it
                if time.monotonic() + pause >= deadline:
                    self._requeue(task, exc)
                log.warning(
                    "dispatch %s: the ledger is unreachable (%s); waiting to claim it",
                    task.request.id,
                    exc,
                    extra={"dispatch_id": task.request.id},
                )
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _requeue(self, task: Task, exc: Exception) -> NoReturn:
        log.warning(
            "dispatch %s: the ledger stayed unreachable (%s); the delivery goes back to the "
            "broker and runs when the ledger is back",
            task.request.id,
            exc,
            extra={"dispatch_id": task.request.id},
        )
        # The same message again (id, headers, payload, route): its next delivery claims.
        task.signature_from_request(task.request).apply_async(countdown=REQUEUE_DELAY_SECONDS)
        raise Ignore()

    def _payload_of(
        self, definition: JobDefinition[Any], row: DispatchRow, message_payload: Any
    ) -> Any:
        """The validated payload: decrypted for a secret dispatch, else the first accepted."""
        if not row.secret:
            return definition.validate(row.payload if row.payload is not None else message_payload)
        if self._keyring is None:
            raise SecretDecryptionError("this worker has no secret configured", retryable=True)
        if row.secret_ciphertext is None or row.secret_wrapped_key is None:
            raise SecretDecryptionError("the secret payload's key was erased")
        plaintext = self._keyring.open(
            Sealed(row.secret_ciphertext, row.secret_wrapped_key, row.secret_key_id or ""),
            job_name=row.job_name,
            dispatch_id=row.id,
        )
        return definition.validate(plaintext)


def mark_started(task: Task) -> None:
    """Celery's STARTED state, stored only once the fence let the run through.

    Questpie's tasks turn Celery's own `track_started` off: Celery would store STARTED
    before the fence, over the stored result of a finished dispatch.
    """
    request = task.request
    if not task.app.conf.task_track_started or request.is_eager or task.ignore_result:
        return
    task.backend.store_result(
        request.id, {"pid": os.getpid(), "hostname": request.hostname}, STARTED, request=request
    )


def _as_celery_sees_it(row: DispatchRow, exc: BaseException) -> Exception:
    """The exception Celery may log, send in events and store as the result.

    For a secret dispatch, only the class name: created fresh outside any `except`
    block, it has no __cause__ and no __context__ that could hold plaintext.
    """
    if row.secret:
        error: Exception = SecretJobError(type(exc).__name__)
        error.__suppress_context__ = True
        return error
    if isinstance(exc, Exception):
        return exc
    return HandlerAbortedError(f"the handler raised {type(exc).__name__}")
