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
queue policy is not `standard` is taken into the ledger first (`worker/admission.py`), as
a row under the message's id, so its policy holds however it was sent. Every step
before the run waits for an unreachable ledger, or goes back to the broker, as
`worker/delivery_wait.py` says.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery import Task
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Retry
from celery.states import STARTED

from .._runtime import telemetry
from ..canvas import results
from ..errors import (
    HandlerAbortedError,
    MalformedHeaderError,
    PayloadValidationError,
    PermanentFailure,
    ResultNotStorableError,
    SecretDecryptionError,
    SecretJobError,
)
from ..jobs.context import AppContext, RetryIn
from ..jobs.crypto import Keyring, Sealed
from ..jobs.definition import JobContext, JobDefinition
from ..jobs.ids import shown_id, unstorable_id
from ..jobs.limits import NO_LIMITS, Limits, group_of
from ..jobs.policies import QueuePolicy
from ..ledger import Claim, DispatchRow, Ledger
from ..send.broker import MessageHeader, carry_for_retry
from .admission import Admission
from .delivery_wait import DeliveryWait, time_before_soft_limit
from .leases import LeaseKeeper, renewal_cap
from .outcomes import Outcomes
from .slots import Slots

# Named as before the package had parts: projects configure this logger by name.
log = logging.getLogger("questpie_celery.fence")

T = TypeVar("T")

#: A delivery at most this early for its row (by the database's clock) waits until the
#: row is due and then claims; one earlier still is dropped, and the relay sends the row
#: when it is due. Covers the hosts' clocks disagreeing with the database's by a little.
EARLY_WAIT_SECONDS = 5.0
#: Slept past the due time, so the claim after the wait finds the row due.
EARLY_MARGIN_SECONDS = 0.05
#: How often one delivery waits for its row to be due (the row may move meanwhile).
EARLY_TRIES = 3


@dataclass
class _Ending:
    """How the handler call ended, with nothing in it that could hold a secret's
    plaintext: a secret dispatch's exception is not kept at all."""

    result: Any = None
    error: str | None = None  # the exception's class name
    for_good: bool = False
    exit: BaseException | None = None  # a fresh SystemExit or KeyboardInterrupt to re-raise
    visible: Exception | None = None  # what Celery may see of it
    retry_in: float | None = None  # the run asked to be retried this much later (`RetryIn`)


@dataclass
class Delivery:
    """One delivery on its way through the fence's stages: what its message said, and
    what the stages learn of it."""

    task: Task
    dispatch_id: str
    definition: JobDefinition[Any]
    attempt: int
    payload: Any
    back: MessageHeader
    token: str
    span: telemetry.Span  # the delivery's own, which its outcome is set on
    eager: bool
    limits: Limits
    policy: Callable[[], QueuePolicy] | None  # read only when a relaxed ledger lost the row
    claim: Claim = field(default_factory=lambda: Claim("unknown"))  # until it is claimed
    # When the latest claim statement was sent: the lease it takes runs from no earlier,
    # which is what a stall of this process is measured against.
    claimed_at: float = field(default_factory=time.monotonic)

    @property
    def claimed_row(self) -> DispatchRow | None:
        """The row, once this delivery holds its claim."""
        return self.claim.row if self.claim.outcome == "claimed" else None


class Fence:
    def __init__(
        self,
        ledger: Ledger,
        leases: LeaseKeeper,
        slots: Slots,
        outcomes: Outcomes,
        keyring: Keyring | None,
        *,
        context: AppContext,
        waits: DeliveryWait,
        admission: Admission,
    ) -> None:
        # A relaxed ledger may lose a row a delivery names: `_claim` takes it back.
        self._relaxed = ledger.relaxed
        self._claims = ledger.claims
        self._limits = ledger.limits
        self._leases = leases
        self._slots = slots
        self._outcomes = outcomes
        self._keyring = keyring
        self._context = context
        self._waits = waits
        self._admission = admission

    def header_of(self, task: Task, definition: JobDefinition[Any]) -> MessageHeader | None:
        """The delivery's `questpie` header (None for a plain call). One questpie could
        not have written is refused before anything reads the ledger: logged, and the
        delivery acknowledged without running. A row under its id stays as it was, so
        the row's own message (or the relay, when it is due) still runs it."""
        try:
            return MessageHeader.from_request(task.request)
        except MalformedHeaderError as exc:
            log.warning(
                "dispatch %s of job %s: its questpie header is malformed (%s); refused, "
                "nothing ran and its ledger row, if any, is untouched",
                shown_id(task.request.id),
                definition.name,
                exc,
                extra={"job_name": definition.name},
            )
            telemetry.current().set(outcome="skipped: malformed header")
            raise Ignore() from None

    def run_admitted(
        self, task: Task, definition: JobDefinition[Any], payload: Any, back: MessageHeader
    ) -> Any:
        """Run a plain delivery that `Admission.plain` took into the ledger: its first
        attempt, claimed like any other."""
        return self._run(task, definition, attempt=1, payload=payload, back=back)

    def run(
        self,
        task: Task,
        definition: JobDefinition[Any],
        header: MessageHeader,
        payload: Any,
        policy: Callable[[], QueuePolicy] | None = None,
    ) -> Any:
        """Claim the delivery, run the handler under a renewed lease, record the end.

        `policy` reads the job's policy in force, asked only when a relaxed ledger lost
        the delivery's row.
        """
        refused = unstorable_id(task.request.id)
        if refused is not None:
            # No ledger row can have this id: not a message questpie sent.
            log.warning(
                "a delivery of job %s has task id %s, which cannot be a dispatch id (%s); skipped",
                definition.name,
                shown_id(task.request.id),
                refused,
                extra={"job_name": definition.name},
            )
            raise Ignore()
        # One token for every try of this delivery, also across a trip back to the broker
        # while the ledger was unreachable: a try whose reply was lost is recognised.
        back = MessageHeader(
            ledgered=True,
            attempt=header.attempt,
            run=header.run,
            token=header.token or str(uuid.uuid4()),
            sent_at=header.sent_at,
        )
        return self._run(
            task, definition, attempt=header.attempt, payload=payload, back=back, policy=policy
        )

    def _run(
        self,
        task: Task,
        definition: JobDefinition[Any],
        *,
        attempt: int,
        payload: Any,
        back: MessageHeader,
        policy: Callable[[], QueuePolicy] | None = None,
    ) -> Any:
        """The delivery through the fence's stages, in order. Each stage returns (the
        delivery moves on) or raises what Celery sees: `Ignore`, `Retry` or the run's
        recorded failure."""
        # Eager mode runs each call at once, in the caller, as Celery's does: no limit can
        # make it wait.
        eager = bool(task.request.is_eager)
        d = Delivery(
            task=task,
            dispatch_id=task.request.id,
            definition=definition,
            attempt=attempt,
            payload=payload,
            back=back,
            token=back.token or "",
            span=telemetry.current(),
            eager=eager,
            limits=NO_LIMITS if eager else definition.limits,
            policy=policy,
        )
        d.span.set(attempt=attempt)
        self._claim(d)
        self._park_if_blocked(d)
        self._end_if_cancelled(d)
        self._take_start(d)
        self._drop_if_early(d)
        row = self._skip_unclaimed(d)
        # A completion the claim could not carry (the ledger was away) is recorded first.
        self._outcomes.settle_carried()
        ending = self._lease_and_call(d, row)
        return self._end(d, row, ending)

    def _wait(self, d: Delivery, step: Callable[[], T]) -> T:
        """One ledger step of the delivery, through `DeliveryWait.run`."""
        return self._waits.run(d.task, step, d.back)

    def _claim(self, d: Delivery) -> None:
        """Take the delivery's execution claim: once the row is due, for a delivery a
        little early; again after a relaxed ledger's lost row was taken back."""
        with telemetry.span("questpie.claim", attempt=d.attempt) as claiming:
            d.claim = self._when_due(d, self._wait(d, lambda: self._claim_once(d)))
            read_policy = d.policy
            if (
                d.claim.outcome == "unknown"
                and self._relaxed
                and read_policy is not None
                and self._wait(
                    d,
                    lambda: self._admission.take_back(
                        d.task, d.definition, d.attempt, d.payload, d.back, read_policy
                    ),
                )
            ):
                d.claim = self._wait(d, lambda: self._claim_once(d))
            claiming.set(outcome=d.claim.outcome)

    def _claim_once(self, d: Delivery) -> Claim:
        """One claim statement, noting when it was sent; it carries a completion this
        process holds (`worker/carried.py`) when it can."""
        carried = (
            self._outcomes.take_carried(d.dispatch_id)
            if d.limits.concurrency is None and not d.eager
            else None
        )
        d.claimed_at = time.monotonic()
        try:
            claim = self._claims.claim(
                d.dispatch_id,
                d.definition.name,
                d.attempt,
                self._leases.lease_seconds,
                d.token,
                any_time=d.eager,
                concurrency=d.limits.concurrency,
                carried=carried[1] if carried is not None else None,
            )
        except BaseException:
            if carried is not None:
                self._outcomes.carried_back(carried)
            raise
        if carried is not None:
            self._outcomes.carried_ended(carried[0], bool(claim.carried))
        return claim

    def _when_due(self, d: Delivery, claim: Claim) -> Claim:
        """Claim again once the row is due, for a delivery a little early: a retry's
        countdown or an ETA that a clock ahead of the database's judged. Never past the
        run's soft time limit."""
        for _ in range(EARLY_TRIES):
            if claim.outcome != "early" or claim.due_in > min(
                EARLY_WAIT_SECONDS, time_before_soft_limit(d.task)
            ):
                return claim
            time.sleep(claim.due_in + EARLY_MARGIN_SECONDS)
            claim = self._wait(d, lambda: self._claim_once(d))
        return claim

    def _park_if_blocked(self, d: Delivery) -> None:
        """Another run holds the slot (or every seat): set this one aside, acknowledged
        and uncounted."""
        if d.claim.outcome != "blocked":
            return
        for_seat = d.claim.blocked_by == "concurrency"
        self._wait(
            d,
            lambda: self._slots.park(
                d.dispatch_id, d.definition.name, d.attempt, for_seat=for_seat
            ),
        )
        d.span.set(outcome="parked")
        raise Ignore()

    def _end_if_cancelled(self, d: Delivery) -> None:
        """Cancelled between its claim and this look (a claim whose reply was lost and
        read back, or a delivery sent back while the ledger was away): its handler has
        not begun, so it never does."""
        claimed = d.claimed_row
        if claimed is None or claimed.cancel_requested_at is None:
            return
        self._wait(d, lambda: self._slots.end_unrun(claimed, d.token))
        d.span.set(outcome="cancelled")
        raise Ignore()

    def _take_start(self, d: Delivery) -> None:
        """Take a start of the job's rate limit for the claimed run, before anything of
        its handler runs; with none free, set the run back to wait for its window
        (acknowledged, not an attempt) and end the delivery."""
        row, rate = d.claimed_row, d.limits.rate
        if row is None or rate is None:
            return
        group = group_of(row.group_key)
        wait = self._wait(
            d, lambda: self._limits.take_permit(row.job_name, group, rate.count, rate.per_seconds)
        )
        if wait is None:
            return
        self._wait(d, lambda: self._slots.wait_for_rate(row, d.token, rate))
        d.span.set(outcome="waiting: rate")
        raise Ignore()

    def _drop_if_early(self, d: Delivery) -> None:
        """A delivery far too early for its row (a forged or stale copy; or the row's own
        message, judged by a clock far ahead): acknowledged without running, and the row
        due for the relay at its start, so it runs then even if this was its message."""
        if d.claim.outcome != "early":
            return
        self._wait(
            d, lambda: self._claims.send_when_due(d.dispatch_id, d.definition.name, d.attempt)
        )
        log.warning(
            "dispatch %s of job %s: delivery for attempt %d came %.1f s before the row is "
            "due; dropped, and the relay sends the row when it is due",
            d.dispatch_id,
            d.definition.name,
            d.attempt,
            d.claim.due_in,
            extra={"dispatch_id": d.dispatch_id, "job_name": d.definition.name},
        )

    def _skip_unclaimed(self, d: Delivery) -> DispatchRow:
        """The claimed row, for the stages that run it; a delivery without one (finished,
        stale, claimed elsewhere, another job's id, or dropped as early) ends here."""
        row = d.claimed_row
        if row is not None:
            return row
        d.span.set(outcome=f"skipped: {d.claim.outcome}")
        log.info(
            "dispatch %s of job %s: delivery for attempt %d skipped (%s)",
            d.dispatch_id,
            d.definition.name,
            d.attempt,
            d.claim.outcome,
            extra={"dispatch_id": d.dispatch_id, "job_name": d.definition.name},
        )
        raise Ignore()

    def _lease_and_call(self, d: Delivery, row: DispatchRow) -> _Ending:
        """Run the handler while its claim is renewed, up to the cap its expiry and the
        hard time limit put on the renewal."""
        d.span.set(policy=str(row.policy or "standard"))
        cap = renewal_cap(row.options.run.expire_in_seconds, _hard_limit_left(d.task))
        with self._leases.hold(
            d.dispatch_id,
            d.token,
            cap.seconds,
            claimed_at=d.claimed_at,
            ends_process=cap.ends_process,
        ) as lease:
            # Inside the hold: a result backend that stalls must not let the lease lapse.
            mark_started(d.task)
            with telemetry.span("questpie.run", attempt=row.attempt) as running:
                ending = self._call(
                    d.definition, row, d.payload, lease.still_held, lambda: lease.cancel_requested
                )
                running.set(outcome="returned" if ending.error is None else ending.error)
        return ending

    def _end(self, d: Delivery, row: DispatchRow, ending: _Ending) -> Any:
        """Record how the run ended, then let Celery see it: the result of a recorded
        completion, the failure of a failed run, a `Retry` for a retried one, and
        `Ignore` for an end this delivery did not record (its claim was lost)."""
        stored, ending = _stored_result(d.definition, row, ending)
        with telemetry.span("questpie.end", attempt=row.attempt) as ending_span:
            if ending.error is None:
                recorded = self._outcomes.completed(
                    row, d.token, stored, hold_for=self._hold_for(d)
                )
                result = "completed" if recorded else "lost"
            else:
                result = self._outcomes.attempt_failed(
                    row,
                    d.token,
                    ending.error,
                    for_good=ending.for_good,
                    retry_in=ending.retry_in,
                    carry=carry_for_retry(row.options.carry, d.task.request),
                )
            ending_span.set(outcome=result)
            d.span.set(outcome=result)
        if ending.error is None:
            if result != "completed":
                raise Ignore()
            return ending.result
        if ending.exit is not None:
            raise ending.exit  # recorded; now let the process stop as it was asked to
        if result == "failed":
            raise ending.visible or HandlerAbortedError()
        if result == "retrying":
            when = ending.retry_in
            if when is None:
                when = row.options.run.delay_before_retry(row.attempt)
            raise Retry(exc=ending.visible, when=when)
        raise Ignore()

    def _hold_for(self, d: Delivery) -> float:
        """How long the run's completion may wait for the next claim to carry it: 0 when
        something outside the ledger sees the end at once, else a sixth of the lease
        (renewed every third, so at least two thirds of it are left)."""
        if d.eager or not _result_unseen(d.task):
            return 0.0
        return self._leases.lease_seconds / 6

    def _call(
        self,
        definition: JobDefinition[Any],
        row: DispatchRow,
        payload: Any,
        held: Callable[[], bool],
        cancelled: Callable[[], bool],
    ) -> _Ending:
        """Run the handler. The payload, the context and the handler's exception live only
        in this frame, which is gone once it returns: what the caller raises for a secret
        dispatch carries none of them, in its message, its cause or its traceback's frames.

        The application's context is built here, after the claim and the payload: a
        delivery the fence turned away, or a payload that does not validate, builds
        nothing, and its set-up or close failing is this attempt failing."""
        try:
            model = self._payload_of(definition, row, payload)
            ctx = JobContext(
                dispatch_id=row.id,
                job_name=definition.name,
                idempotency_key=row.idempotency_key,
                attempt=row.attempt,
                retry_limit=row.options.run.retry_limit,
                singleton_key=row.singleton_key,
                fencing_token=row.claim_generation or 0,
                _cancelled=cancelled,
            )
            result = self._context.call(definition, model, ctx, secret=row.secret, held=held)
        except (PayloadValidationError, SecretDecryptionError, PermanentFailure) as exc:
            # A bad payload or ciphertext is not mended by retrying; a worker missing the
            # right secret might be, by a better-configured one.
            return _ending_of(row, exc, for_good=not getattr(exc, "retryable", False))
        except RetryIn as asked:  # the next attempt, when the run asked for it
            ending = _ending_of(row, asked.cause or asked, for_good=False)
            return dataclasses.replace(ending, retry_in=asked.seconds)
        except BaseException as exc:  # every end is recorded; see Fence.run
            return _ending_of(row, exc, for_good=not definition.retries_failures)
        # A secret dispatch's return value is never stored: it may echo the payload.
        return _Ending(result=None if row.secret else result)

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


def _stored_result(
    definition: JobDefinition[Any], row: DispatchRow, ending: _Ending
) -> tuple[dict[str, Any] | None, _Ending]:
    """The run's return value as the ledger keeps it, and the ending to record. A value
    the ledger cannot keep whole fails a chord's or batch's member for good (its
    callback needs it); any other run completes without it, as it would in Celery."""
    if ending.error is not None or ending.result is None:
        return None, ending
    try:
        return results.encode(ending.result, definition.result_serializer), ending
    except ResultNotStorableError as exc:
        if row.canvas_id is not None:
            return None, _ending_of(row, exc, for_good=True)
        log.info(
            "dispatch %s of job %s: its result is not kept in the ledger (%s)",
            row.id,
            row.job_name,
            exc,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        return None, ending


def _result_unseen(task: Task) -> bool:
    """Celery keeps nothing of the run's end: the task (or this call) ignores its result,
    or the app has no result backend. Then only the ledger tells that it ended."""
    return bool(
        task.ignore_result
        or getattr(task.request, "ignore_result", False)
        or isinstance(task.backend, DisabledBackend)
    )


def _ending_of(row: DispatchRow, exc: BaseException, *, for_good: bool) -> _Ending:
    """What survives of a handler's exception once its frame is gone.

    For a secret dispatch, only the class name: Celery sees a `SecretJobError` created
    fresh here, with no __cause__, no __context__ and no frame that held plaintext.
    """
    exit_kind: BaseException | None = None
    if isinstance(exc, KeyboardInterrupt):
        exit_kind = KeyboardInterrupt()
    elif isinstance(exc, SystemExit):
        # Its exit code, when it is one; any other argument might hold plaintext.
        code = exc.code if isinstance(exc.code, int) else 1 if exc.code is not None else None
        exit_kind = SystemExit(code)
    visible: Exception
    if row.secret:
        visible = SecretJobError(type(exc).__name__)
        visible.__suppress_context__ = True
    elif isinstance(exc, Exception):
        visible = exc
    else:
        visible = HandlerAbortedError(f"the handler raised {type(exc).__name__}")
    return _Ending(error=type(exc).__name__, for_good=for_good, exit=exit_kind, visible=visible)


def _hard_limit_left(task: Task) -> float | None:
    """Seconds from now to the run's hard time limit, at which the prefork pool kills its
    process (from when the run began; the pool counts from a moment earlier, when it
    took the job); None when it has none."""
    limits = task.request.timelimit or (None, None)
    hard = (limits[0] if limits else None) or task.time_limit or task.app.conf.task_time_limit
    if not hard:
        return None
    started = getattr(task.request, "questpie_started", None) or time.monotonic()
    return float(hard) - (time.monotonic() - started)


def mark_started(task: Task) -> None:
    """Celery's STARTED state, stored only once the fence let the run through.

    Questpie's tasks turn Celery's own `track_started` off: Celery would store STARTED
    before the fence, over the stored result of a finished dispatch. A result backend
    that fails here does not stop the run (the state is informational).
    """
    request = task.request
    if not task.app.conf.task_track_started or request.is_eager or task.ignore_result:
        return
    try:
        task.backend.store_result(
            request.id, {"pid": os.getpid(), "hostname": request.hostname}, STARTED, request=request
        )
    except Exception as exc:
        log.warning(
            "dispatch %s: could not store its STARTED state (%s)",
            request.id,
            type(exc).__name__,
            extra={"dispatch_id": request.id},
        )
