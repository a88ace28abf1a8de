"""The worker side: the Celery task a job compiles to, and where each delivery goes.

A delivery that carries questpie's ledger header, or one of a job whose queue
policy is not `standard`, runs through the execution fence (`fence.py`). Any
other delivery (a plain `delay`, `send_task`, Canvas or beat call of a standard
job, or an unkeyed standard publish) runs unfenced, with Celery's own retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, Task

from . import telemetry
from .broker import MessageHeader
from .context import AppContext
from .errors import HandlerAbortedError, PermanentFailure
from .fence import Fence, mark_started
from .jobs import JobContext, JobDefinition
from .options import resolve_options
from .recorded_policy import PolicyBook

log = logging.getLogger(__name__)


class JobTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Base class of the Celery task each job compiles to."""

    #: Retry limits are ours (per dispatch, in the message header), not Celery's.
    max_retries = None
    #: STARTED is stored by the fence once a run is let through (see fence.mark_started).
    track_started = False
    questpie_definition: JobDefinition[Any]


class Runner:
    """Runs deliveries of every job registered with one `Questpie`."""

    def __init__(self, fence: Fence, policies: PolicyBook, context: AppContext) -> None:
        self._fence = fence
        self._policies = policies
        self._context = context

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
        task.request.questpie_started = time.monotonic()  # the soft time limit runs from here
        definition = task.questpie_definition
        with (
            telemetry.continued_from(task.request.headers),
            telemetry.span(
                "questpie.deliver", consumer=True, job=definition.name, dispatch_id=task.request.id
            ),
        ):
            return self._execute(task, definition, payload)

    def _execute(self, task: JobTask, definition: JobDefinition[Any], payload: Any) -> Any:
        header = self._fence.header_of(task, definition)
        if header is not None and header.ledgered:
            return self._fence.run(
                task, definition, header, payload, lambda: self._policies.in_force(definition)
            )
        # A policy this process never read, with the ledger down, is waited for like a
        # claim: guessing `standard` could run a policy job unfenced.
        policy = self._fence.patiently(
            task, lambda: self._policies.in_force(definition), header, definition
        )
        if policy.ledgered:
            return self._fence.adopt_and_run(task, definition, policy, header, payload)
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
