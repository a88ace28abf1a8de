"""How an attempt ends: the one routine the worker and the relay both call.

Every end goes through here: the conditional write that records it (only the
claim holder's token, or the relay's view of a lapsed lease, can move the row),
the key erasure that is part of every terminal write, handing a freed slot on,
and for a retry whether its message is sent now (with a countdown) or left in
the ledger for the relay (a delay beyond the ETA horizon).

A claim holder whose write meets an unreachable ledger (or a row held by another
transaction) keeps trying for `OUTCOME_PATIENCE_SECONDS`: the write is
conditional on its fencing token, so trying long is safe, and a database restart
under a running handler then costs no second run. (The relay gives a lapsed
lease a grace period after an outage for the same reason; see worker/relay.py.)
Handing a slot on is best effort: if it fails, the relay hands the slot on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from celery.exceptions import SoftTimeLimitExceeded

from ..ledger import (
    EXPIRED,
    LEASE_EXPIRED,
    RELAY_GAVE_UP,
    REVOKED,
    CarriedEnd,
    DispatchRow,
    Ledger,
)
from ..send.outbox import Outbox
from .carried import Carried
from .slots import Slots
from .waiting import LedgerWait

log = logging.getLogger(__name__)

#: How long a claim holder keeps trying to record its outcome while the ledger is down.
OUTCOME_PATIENCE_SECONDS = 300.0
#: Longest pause between two tries of a write while the ledger is unreachable.
MAX_WRITE_PAUSE_SECONDS = 2.0

Ending = Literal["failed", "retrying", "cancelled", "lost"]
#: Told of every dispatch that ended for good: its status and error (a chord or batch
#: it is a member of may be complete now; see `canvas/completion.py`).
MemberEnded = Callable[[DispatchRow, str, "str | None"], None]


@dataclass(frozen=True)
class Unrun:
    """A delivery that the worker's main process saw end without running its handler
    and whose message Celery acknowledged: its pool process was lost (killed, out of
    memory, past its hard time limit) or its message was rejected (`lost`), or the worker
    revoked it or dropped it as expired (`revoked`, `expired`). It may have claimed before
    it ended: whatever is done about it is conditional on the row still waiting for that
    delivery's claim."""

    dispatch_id: str
    job_name: str
    attempt: int  # the claim the delivery was meant to take
    why: Literal["lost", "revoked", "expired"]


class Outcomes:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        slots: Slots,
        member_ended: MemberEnded = lambda row, status, error: None,
    ) -> None:
        self._claims = ledger.claims
        self._member_ended = member_ended
        self._relay = ledger.relay
        self._outbox = outbox
        self._slots = slots
        self._wait = LedgerWait(
            ledger,
            patience=OUTCOME_PATIENCE_SECONDS,
            first_pause=0.1,
            max_pause=MAX_WRITE_PAUSE_SECONDS,
        )
        self._carried = Carried(self._record_carried, ledger.idle) if self._claims.carries else None

    # --- the claim holder (a worker) ------------------------------------------------------

    def completed(
        self,
        row: DispatchRow,
        token: str,
        result: dict[str, Any] | None = None,
        *,
        hold_for: float = 0.0,
    ) -> bool:
        """Record completion with the run's encoded `result` (erasing a secret's key);
        False if the claim was lost.

        `hold_for` > 0: nothing outside the ledger waits for this end (see
        `worker/carried.py`). Then a dispatch whose end hands nothing on is held for
        the next claim of this process to record (`hold_for` seconds at most) while the
        process is busy, and this returns True at once."""
        if (
            hold_for > 0
            and self._carried is not None
            and _hands_nothing_on(row)
            and self._carried.hold(row, CarriedEnd(row.id, token, result), hold_for)
        ):
            return True
        if not self._patiently(
            lambda: self._claims.finish(row.id, token, "completed", None, result), row
        ):
            _lost(row, "finished")
            return False
        self._ended(row, "completed", None)
        return True

    def take_carried(self, not_for: str) -> tuple[DispatchRow, CarriedEnd] | None:
        """A held completion for a claim of another dispatch to carry, if one waits."""
        return self._carried.take(not_for) if self._carried is not None else None

    def settle_carried(self) -> None:
        """Every completion this process holds recorded (see `Carried.settle`)."""
        if self._carried is not None:
            self._carried.settle()

    def carried_back(self, held: tuple[DispatchRow, CarriedEnd]) -> None:
        """The claim that carried `held` failed before it committed: recorded alone."""
        assert self._carried is not None  # only what it handed out comes back
        self._carried.give_back(held)

    def carried_ended(self, row: DispatchRow, landed: bool) -> None:
        """What follows a carried completion's statement."""
        if not landed:
            _lost(row, "finished")
            return
        self._ended(row, "completed", None)

    def _record_carried(self, row: DispatchRow, end: CarriedEnd) -> None:
        """A held completion no claim carried in time, recorded alone."""
        self.carried_ended(
            row,
            self._patiently(
                lambda: self._claims.finish(row.id, end.token, "completed", None, end.result),
                row,
            ),
        )

    def _ended(self, row: DispatchRow, status: str, error: str | None) -> None:
        """What follows a dispatch's end for good: its slot or seat handed on, its chord
        or batch looked at."""
        self._slots.hand_on_or_leave(row)
        self._member_ended(row, status, error)

    def attempt_failed(
        self,
        row: DispatchRow,
        token: str,
        error: str,
        *,
        for_good: bool,
        carry: Mapping[str, Any] | None = None,
        retry_in: float | None = None,
    ) -> Ending:
        """Record a failed attempt: a retry while the dispatch has retries left and the
        failure may mend, else `failed` for good (erasing a secret's key). `retry_in`:
        the run asked for its retry this much later, else the dispatch's delay applies."""
        run = row.options.run
        if for_good or row.attempt > run.retry_limit:
            if not self._patiently(
                lambda: self._claims.finish(row.id, token, "failed", error), row
            ):
                _lost(row, "failed")
                return "lost"
            self._ended(row, "failed", error)
            return "failed"
        delay = run.delay_before_retry(row.attempt) if retry_in is None else retry_in
        plan = self._outbox.plan_retry(delay)
        if not self._patiently(
            lambda: self._claims.retry(
                row.id, token, retry_in=plan.retry_in, relay_in=plan.relay_in, error=error
            ),
            row,
        ):
            # Not retried: the claim was lost, or the run was cancelled while it ran,
            # which the end below records as `cancelled` (only while the claim holds).
            if not self._patiently(
                lambda: self._claims.finish(row.id, token, "failed", error), row
            ):
                _lost(row, "failed")
                return "lost"
            log.info(
                "dispatch %s: attempt %d failed (%s) after it was cancelled; not retried",
                row.id,
                row.attempt,
                error,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            self._ended(row, "cancelled", error)
            return "cancelled"
        if plan.send_now:
            self._outbox.send(row, attempt=row.attempt + 1, countdown=plan.retry_in, carry=carry)
        else:
            log.info(
                "dispatch %s: attempt %d failed (%s); the relay sends its retry in %.0fs",
                row.id,
                row.attempt,
                error,
                plan.retry_in,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
        return "retrying"

    def _patiently(self, write: Callable[[], bool], row: DispatchRow) -> bool:
        def tell(level: int, exc: Exception) -> None:
            log.log(
                level,
                "dispatch %s: could not record its outcome yet (%s); trying again",
                row.id,
                exc,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )

        def soft_limit(_: SoftTimeLimitExceeded) -> None:
            # The run's soft limit fell while its outcome was being recorded (in the
            # write, the log or the pause): the handler is done, so keep trying. The
            # hard limit still bounds the wait.
            log.warning(
                "dispatch %s: soft time limit reached while recording its outcome; still trying",
                row.id,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )

        # Past the patience, the write's error is raised.
        return self._wait.run(write, tell=tell, soft_limit=soft_limit)

    # --- the relay ------------------------------------------------------------------------

    def unrun(self, delivery: Unrun) -> bool:
        """A delivery that ended without a run: a lost one is sent again at once; a revoked
        or expired one ends its dispatch as `failed` (a revoke means "do not run it", and
        sending it again would only meet the revoke again). True when the row changed."""
        if delivery.why == "lost":
            return self._outbox.resend_unclaimed(
                delivery.dispatch_id, delivery.job_name, delivery.attempt
            )
        error = REVOKED if delivery.why == "revoked" else EXPIRED
        row = self._claims.end_unclaimed(
            delivery.dispatch_id, delivery.job_name, delivery.attempt, error
        )
        if row is None:
            return False
        log.warning(
            "dispatch %s of job %s: its message was %s before it ran; failed (%s)",
            row.id,
            row.job_name,
            delivery.why,
            error,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        self._ended(row, row.status, row.last_error)
        return True

    def lapsed(self, row: DispatchRow) -> bool:
        """End a claim whose lease lapsed (its worker died or overran) as a failed
        attempt: retried as the dispatch's options say, or failed for good."""
        run = row.options.run
        # A run cancelled while it ran is not retried: its lapse ends it as `cancelled`.
        if row.attempt <= run.retry_limit and row.cancel_requested_at is None:
            plan = self._outbox.plan_retry(run.delay_before_retry(row.attempt))
            if not self._claims.lapse(row, retry_in=plan.retry_in, relay_in=plan.relay_in):
                return False  # renewed or recovered by someone else meanwhile
            log.warning(
                "dispatch %s of job %s: lease expired on attempt %d; retrying",
                row.id,
                row.job_name,
                row.attempt,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )
            if plan.send_now:
                self._outbox.send(row, attempt=row.attempt + 1, countdown=plan.retry_in)
            return True
        if not self._claims.lapse(row, retry_in=None, relay_in=0.0):
            return False
        log.warning(
            "dispatch %s of job %s: lease expired on its last attempt; %s",
            row.id,
            row.job_name,
            "failed" if row.cancel_requested_at is None else "cancelled (while it ran)",
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        status = "failed" if row.cancel_requested_at is None else "cancelled"
        self._ended(row, status, LEASE_EXPIRED)
        return True

    def gave_up(self, row: DispatchRow) -> bool:
        """Record `failed` for a dispatch no worker took within the relay's sends."""
        if not self._relay.give_up(row):
            return False
        log.warning(
            "dispatch %s of job %s: no worker took it after %d sends; failed",
            row.id,
            row.job_name,
            row.send_count,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        self._ended(row, "failed", RELAY_GAVE_UP)
        return True


def _hands_nothing_on(row: DispatchRow) -> bool:
    """Its end frees no policy slot or seat and ends no chord or batch member: nothing
    else waits for it to be recorded."""
    return row.limited_slot is None and row.seat is None and row.canvas_id is None


def _lost(row: DispatchRow, what: str) -> None:
    log.warning(
        "dispatch %s %s after losing its claim; the outcome is not recorded here (the "
        "relay ended the lapsed lease, and its retry records the outcome)",
        row.id,
        what,
        extra={"dispatch_id": row.id, "job_name": row.job_name},
    )
