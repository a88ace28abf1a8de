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
from ..jobs.policies import QueuePolicy
from ..send.broker import HARD_TIME_LIMIT_GRACE_SECONDS, HEADER, MessageHeader
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
                self._ended_unrun()

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:  # the pool kills the process
            self._ended_unrun()

    def _ended_unrun(self) -> None:
        # An adopted task whose app no Questpie was made for has no runner.
        runner = getattr(self.task, "questpie_runner", None)
        if runner is not None:
            runner.ended_unrun(self.task, Context(self.request_dict))


class JobTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Base class of the Celery task each job compiles to."""

    #: Retry limits are ours (per dispatch, in the message header), not Celery's.
    max_retries = None
    #: STARTED is stored by the fence once a run is let through (see fence.mark_started).
    track_started = False
    Request = DeliveryRequest
    questpie_definition: JobDefinition[Any]
    questpie_runner: Runner

    def apply_async(self, args: Any = None, kwargs: Any = None, *more: Any, **options: Any) -> Any:
        """Celery's `apply_async`, refusing at once a call whose payload every delivery
        would refuse (a plain Celery call of the job; `publish()` is the ledgered one)."""
        headers = options.get("headers") or {}
        why = None if HEADER in headers else self.payload_mistake(args, kwargs)
        if why is not None:
            raise TypeError(f"{self.name}: {why}")
        return super().apply_async(args, kwargs, *more, **options)

    def payload_mistake(self, args: Any, kwargs: Any) -> str | None:
        """Why a call with these arguments cannot run the job, or None: a job's task
        takes one positional argument, its payload."""
        if kwargs:
            return (
                f"a job's task takes its payload as one positional argument, args=[{{...}}], "
                f"not keywords ({', '.join(map(str, kwargs))})"
            )
        if not args or len(args) != 1:
            return "a job's task takes one positional argument, its payload: args=[{...}]"
        return None


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
        """Run one delivery of a job's task: `payload` is its message's one argument."""
        definition = task.questpie_definition
        return self._delivering(
            task,
            definition,
            lambda: self._execute(
                task,
                definition,
                lambda _ledgered: payload,
                lambda header: self._run_plain(task, definition, header, payload),
            ),
        )

    def execute_adopted(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        as_payload: Callable[[], dict[str, Any]],
        run_sent: Callable[[Any], Any],
    ) -> Any:
        """Run one delivery of an adopted Celery task (`LedgerTask`). A message of ours
        carries the call as its one argument (`run_sent` runs an unledgered one); any
        other is the task's own call, run as Celery runs it unless its policy or limits
        hold however it was sent (then `as_payload` serializes the call, to be taken
        into the ledger)."""
        definition = task.questpie_definition
        return self._delivering(
            task,
            definition,
            lambda: self._execute(
                task,
                definition,
                lambda ledgered: (
                    (args[0] if len(args) == 1 else None) if ledgered else as_payload()
                ),
                lambda header: (
                    task.run(*args, **kwargs)
                    if header is None
                    else run_sent(args[0] if len(args) == 1 else None)
                ),
            ),
        )

    def _delivering(
        self, task: Any, definition: JobDefinition[Any], deliver: Callable[[], Any]
    ) -> Any:
        task.request.questpie_started = time.monotonic()  # the soft time limit runs from here
        with (
            telemetry.continued_from(task.request.headers),
            telemetry.span(
                "questpie.deliver", consumer=True, job=definition.name, dispatch_id=task.request.id
            ),
        ):
            try:
                return deliver()
            finally:
                # What the handler published is sent before the delivery is done: a pool
                # process may be recycled or stopped next, and its exit runs no atexit
                # (whatever the time leaves over is the relay's, as after a kill).
                self._sent(HANDLER_SENDS_FLUSH_SECONDS)

    def _execute(
        self,
        task: Any,
        definition: JobDefinition[Any],
        payload: Callable[[bool], Any],
        plain: Callable[[MessageHeader | None], Any],
    ) -> Any:
        """Where a delivery goes: the fence for a ledgered message, or for a plain one
        whose policy or limits hold however it was sent (`payload(ledgered)` is what
        the fence runs), else `plain`."""
        header = self._fence.header_of(task, definition)
        if header is not None and header.ledgered:
            return self._fence.run(
                task, definition, header, payload(True), lambda: self._policies.in_force(definition)
            )
        policy = self._policy_of_plain(task, definition, header)
        if policy.ledgered or definition.limits.active:
            body, back = self._admission.plain(task, definition, policy, header, payload(False))
            return self._fence.run_admitted(task, definition, body, back)
        return plain(header)

    def _policy_of_plain(
        self, task: Any, definition: JobDefinition[Any], header: MessageHeader | None
    ) -> QueuePolicy:
        # A policy this process never read, with the ledger down, is waited for like a
        # claim: guessing `standard` could run a policy job unfenced.
        return self._waits.unledgered(
            task, lambda: self._policies.in_force(definition), header, definition
        )

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
