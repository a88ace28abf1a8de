"""The worker side: the Celery task a job compiles to, and where each delivery goes.

A delivery that carries questpie's ledger header, or one of a job whose queue
policy is not `standard`, runs through the execution fence (`worker/fence.py`). Any
other delivery (a plain `delay`, `send_task`, Canvas or beat call of a standard
job, or an unkeyed standard publish) runs unfenced, with Celery's own retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from billiard.einfo import ExceptionWithTraceback  # type: ignore[import-untyped]
from celery import Celery, Task
from celery.app.task import Context
from celery.exceptions import Reject, TimeLimitExceeded, WorkerLostError
from celery.signals import task_revoked
from celery.worker.request import Request

from .._runtime import telemetry
from ..errors import HandlerAbortedError, PermanentFailure
from ..intake.recorded_policy import PolicyBook
from ..jobs.context import AppContext
from ..jobs.definition import JobContext, JobDefinition
from ..jobs.ids import unstorable_id
from ..jobs.options import resolve_options
from ..send.broker import HARD_TIME_LIMIT_GRACE_SECONDS, MessageHeader
from .admission import Admission
from .delivery_wait import DeliveryWait
from .fence import Fence, mark_started
from .outcomes import Unrun

log = logging.getLogger(__name__)


#: How long a finished delivery waits for the sends of what its handler published.
HANDLER_SENDS_FLUSH_SECONDS = 30.0

#: Ended without running, as the worker's main process sees it: the pool process was lost
#: (killed, out of memory, its hard time limit) or the message rejected. Any other end
#: came from the handler's process, which recorded it in the ledger itself.
_LOST = (WorkerLostError, TimeLimitExceeded, Reject, SystemExit, KeyboardInterrupt)


class DeliveryRequest(Request):  # type: ignore[misc]  # celery ships no type information
    """A delivery of a job in the worker's main process, where Celery acknowledges a
    message whose pool process was lost: it tells the job's `Runner`, which passes it
    on to the relay (see `Runner.ended_unrun`)."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        try:
            return super().on_failure(
                exc_info, send_failed_event=send_failed_event, return_ok=return_ok
            )
        finally:
            exc = exc_info.exception
            if isinstance(exc, ExceptionWithTraceback):  # as the pool process sent it
                exc = exc.exc
            if isinstance(exc, _LOST):
                self.task.questpie_runner.ended_unrun(self.task, Context(self.request_dict))

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:  # the pool kills the process
            self.task.questpie_runner.ended_unrun(self.task, Context(self.request_dict))


class JobTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Base class of the Celery task each job compiles to."""

    #: Retry limits are ours (per dispatch, in the message header), not Celery's.
    max_retries = None
    #: STARTED is stored by the fence once a run is let through (see fence.mark_started).
    track_started = False
    Request = DeliveryRequest
    questpie_definition: JobDefinition[Any]
    questpie_runner: Runner


class Runner:
    """Runs deliveries of every job registered with one `Questpie`."""

    def __init__(
        self,
        fence: Fence,
        admission: Admission,
        waits: DeliveryWait,
        policies: PolicyBook,
        context: AppContext,
        unrun: Callable[[Unrun], None],
        sent: Callable[[float], object],
    ) -> None:
        self._sent = sent
        self._fence = fence
        self._admission = admission
        self._waits = waits
        self._policies = policies
        self._context = context
        self._unrun = unrun

    def register(self, app: Celery, definition: JobDefinition[Any]) -> Any:
        """Create the Celery task named after the job on `app`."""
        runner = self

        def run(task: JobTask, payload: Any = None) -> Any:
            return runner.execute(task, payload)

        run.__name__ = definition.attribute_name
        run.__doc__ = definition.handler.__doc__
        # A message of ours carries the time limits of its expire_in_seconds; a plain
        # Celery call of the job runs under its declared one, just the same.
        expire = resolve_options(definition.options, {}).run.expire_in_seconds
        return app.task(
            name=definition.name,
            bind=True,
            base=JobTask,
            shared=False,
            serializer="json",
            soft_time_limit=expire,
            time_limit=expire + HARD_TIME_LIMIT_GRACE_SECONDS,
            questpie_definition=definition,
            questpie_runner=runner,
        )(run)

    def ended_unrun(
        self, task: Any, request: Any, why: Literal["lost", "revoked", "expired"] = "lost"
    ) -> None:
        """In the worker's main process: a delivery of one of our jobs ended without a
        run. Passed on as an `Unrun` (the relay handles it off this event loop); never
        raises, since Celery is in the middle of its own handling here."""
        try:
            if unstorable_id(request.id) is not None:
                return  # no ledger row can have this id (a plain call's): nothing to move on
            header = MessageHeader.from_request(request)
            ledgered = header is not None and header.ledgered
            self._unrun(
                Unrun(
                    dispatch_id=str(request.id),
                    job_name=task.questpie_definition.name,
                    # A plain delivery claims (after taking it into the ledger) attempt 1.
                    attempt=header.attempt if header is not None and ledgered else 1,
                    why=why,
                )
            )
        except Exception:
            log.exception("could not note delivery %s that ended without a run", request.id)

    def execute(self, task: JobTask, payload: Any) -> Any:
        task.request.questpie_started = time.monotonic()  # the soft time limit runs from here
        definition = task.questpie_definition
        with (
            telemetry.continued_from(task.request.headers),
            telemetry.span(
                "questpie.deliver", consumer=True, job=definition.name, dispatch_id=task.request.id
            ),
        ):
            try:
                return self._execute(task, definition, payload)
            finally:
                # What the handler published is sent before the delivery is done: a pool
                # process may be recycled or stopped next, and its exit runs no atexit
                # (whatever the time leaves over is the relay's, as after a kill).
                self._sent(HANDLER_SENDS_FLUSH_SECONDS)

    def _execute(self, task: JobTask, definition: JobDefinition[Any], payload: Any) -> Any:
        header = self._fence.header_of(task, definition)
        if header is not None and header.ledgered:
            return self._fence.run(
                task, definition, header, payload, lambda: self._policies.in_force(definition)
            )
        # A policy this process never read, with the ledger down, is waited for like a
        # claim: guessing `standard` could run a policy job unfenced.
        policy = self._waits.unledgered(
            task, lambda: self._policies.in_force(definition), header, definition
        )
        if policy.ledgered or definition.limits.active:
            # Its policy, or its limits, hold however it was sent: it goes through the fence.
            body, back = self._admission.plain(task, definition, policy, header, payload)
            return self._fence.run_admitted(task, definition, body, back)
        return self._run_plain(task, definition, header, payload)

    def _run_plain(
        self,
        task: JobTask,
        definition: JobDefinition[Any],
        header: MessageHeader | None,
        payload: Any,
    ) -> Any:
        """A delivery with no ledger row: validated, run, retried by Celery."""
        run = header.run if header is not None else resolve_options(definition.options, {}).run
        attempt = int(task.request.retries or 0) + 1
        model = definition.validate(payload)
        mark_started(task)
        ctx = JobContext(
            dispatch_id=task.request.id,
            job_name=definition.name,
            idempotency_key=None,
            attempt=attempt,
            retry_limit=run.retry_limit,
        )
        failure: BaseException | None = None
        telemetry.current().set(attempt=attempt, policy="standard")
        try:
            with telemetry.span("questpie.run", attempt=attempt):
                result = self._context.call(definition, model, ctx, secret=False)
        except (PermanentFailure, KeyboardInterrupt, SystemExit):
            telemetry.current().set(outcome="failed")
            raise
        except BaseException as exc:  # retried below, as Celery would
            failure = exc
        else:
            telemetry.current().set(outcome="completed")
            return result
        seen = (
            failure
            if isinstance(failure, Exception)
            else HandlerAbortedError(f"the handler raised {type(failure).__name__}")
        )
        if attempt > run.retry_limit:
            telemetry.current().set(outcome="failed")
            raise seen
        telemetry.current().set(outcome="retrying")
        raise task.retry(exc=seen, countdown=run.delay_before_retry(attempt)) from None


def _revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """In the worker's main process: Celery dropped a revoked (or expired) message of one
    of our jobs, acknowledged and never run."""
    runner = getattr(sender, "questpie_runner", None)
    if isinstance(runner, Runner) and request is not None:
        runner.ended_unrun(sender, request, "expired" if expired else "revoked")


task_revoked.connect(_revoked, weak=False)  # once, for every Runner: the task names its own
