"""Run-side slots and limits: parking a run whose slot or seat is busy, setting one
back for its rate window, and handing a freed slot or seat on.

A delivered run that its policy keeps from starting (`singleton`, `stately`,
`exclusive`), or that finds every seat of its group taken (`concurrency_limit`), is
parked: its message is acknowledged, it is neither failed nor counted as an attempt,
and it waits in the ledger. Whoever ends a run for good sends the first parked run of
that slot (the oldest) or that group (by priority, then the oldest) at once; the relay
is the safety net for a worker that dies before it can.

A run the rate limit turns away is not parked: it waits as a delayed dispatch does,
due when a start frees for it (behind the runs of its group that waited before it),
and the outbox sends it then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..errors import QuestpieError
from ..jobs.limits import Limits, Rate, group_of
from ..ledger import DispatchRow, Ledger
from ..send.outbox import Outbox
from ..signals import run_parked

log = logging.getLogger(__name__)

#: The least a run set back for its window waits, so that runs taking permits at the
#: same instant do not trade deliveries in a loop.
MIN_RATE_WAIT_SECONDS = 0.02


class Slots:
    def __init__(
        self,
        ledger: Ledger,
        outbox: Outbox,
        limits_of: Callable[[str], Limits | None],
        jobs: Callable[[], Sequence[str]],
        member_ended: Callable[[DispatchRow, str, str | None], None] = lambda *_: None,
    ) -> None:
        """`limits_of` gives the limits of a job this process runs (None for any other),
        `jobs` the names of the jobs it runs; `member_ended` is told of a run cancelled
        before it began (its chord or batch may be complete now)."""
        self._member_ended = member_ended
        self._ledger = ledger  # `get`: the row as it is after a park
        self._slots = ledger.slots
        self._limits = ledger.limits
        self._claims = ledger.claims
        self._outbox = outbox
        self._limits_of = limits_of
        self._jobs = jobs

    def park(
        self, dispatch_id: str, job_name: str, attempt: int, *, for_seat: bool = False
    ) -> None:
        """Set delivery `attempt` aside until its slot frees (`for_seat`: until a
        concurrency seat of its group frees)."""
        waiting_for = "concurrency" if for_seat else None
        parked = self._slots.park(dispatch_id, job_name, attempt, waiting_for)
        row = self._ledger.get(dispatch_id)
        if row is None:
            return
        if not parked:
            # The row moved on meanwhile (finished, or parked by a duplicate); or this is
            # a second try of a park that landed, whose look below must still be made.
            if row.status == "parked" and row.waiting_for == waiting_for:
                self._look_again(row, for_seat=for_seat)
            return
        if for_seat:
            log.info(
                "dispatch %s of job %s parked: every seat of its group %r is taken "
                "(concurrency_limit)",
                dispatch_id,
                row.job_name,
                group_of(row.group_key),
                extra={"dispatch_id": dispatch_id, "job_name": row.job_name},
            )
        elif row.slot is None:
            return
        else:
            log.info(
                "dispatch %s of job %s parked: its %s slot %r is busy",
                dispatch_id,
                row.job_name,
                row.policy,
                row.slot,
                extra={"dispatch_id": dispatch_id, "job_name": row.job_name},
            )
        run_parked.send(
            sender=row.job_name,
            job_name=row.job_name,
            dispatch_id=dispatch_id,
            singleton_key=row.singleton_key,
        )
        self._look_again(row, for_seat=for_seat)

    def _look_again(self, row: DispatchRow, *, for_seat: bool) -> None:
        """The holder may have finished between our claim and our park, and then nobody
        would hand the slot (or the seat) on: look again."""
        if for_seat:
            self.send_waiting(row.job_name, group_of(row.group_key))
        elif row.slot is not None and not self._slots.slot_running(row.job_name, row.slot):
            self.send_next(row.job_name, row.slot)

    def hand_on(self, finished: DispatchRow) -> None:
        """After a run ended for good, start the next parked run of its slot, and the
        next run waiting for a seat of its group."""
        slot = finished.limited_slot
        if slot is not None:
            self.send_next(*slot)
        if finished.seat is not None:
            self.send_waiting(finished.job_name, group_of(finished.group_key))

    def hand_on_or_leave(self, row: DispatchRow, *, cancelled: bool = False) -> None:
        """`hand_on` (`hand_on_cancelled` for a run cancelled before it started), for a
        caller whose own write has landed and must not fail on this: a ledger that
        refuses it now leaves the slot to the relay, its safety net, and says so once."""
        try:
            if cancelled:
                self.hand_on_cancelled(row)
            else:
                self.hand_on(row)
        except QuestpieError as exc:
            log.warning(
                "dispatch %s: could not hand its slot on (%s); the relay will",
                row.id,
                exc,
                extra={"dispatch_id": row.id, "job_name": row.job_name},
            )

    def hand_on_cancelled(self, cancelled: DispatchRow) -> None:
        """After a run that had not started was cancelled: the running slot or the seat
        it held (awaiting its retry) or was on its way to take goes to the next run
        waiting for it, as when a run ends. A parked run of a slot still held waits on."""
        slot = cancelled.limited_slot
        if slot is not None and not self._slots.slot_running(*slot):
            self.send_next(*slot)
        self.send_waiting(cancelled.job_name, group_of(cancelled.group_key))

    def send_next(self, job_name: str, slot: str) -> bool:
        """Unpark the oldest parked run of a slot and send it; True if one was sent.

        A refused send leaves it queued and due for the relay.
        """
        row = self._slots.unpark_next(job_name, slot, self._outbox.redeliver_after)
        if row is None:
            return False
        return self._outbox.send(row, attempt=row.attempt + 1)

    def send_waiting(self, job_name: str, group: str) -> int:
        """Send the group's first runs parked for a seat, as many as its free seats (by
        the limit the job has in this process's code); how many were sent."""
        limits = self._limits_of(job_name)
        if limits is None:
            return 0  # a job this process does not run: its own workers hand its seats on
        limit = _limit_or_none(limits)
        sent = 0
        while self._limits.seats_taken(job_name, group) < limit:
            row = self._limits.unpark_first(job_name, group, self._outbox.redeliver_after)
            if row is None:
                break
            sent += self._outbox.send(row, attempt=row.attempt + 1)
        return sent

    def end_unrun(self, claimed: DispatchRow, token: str) -> bool:
        """End a claimed run that was cancelled before its handler began: `cancelled`,
        never run, its slot and seat handed on. False when the claim was lost meanwhile
        or no cancel marks it."""
        ended = self._claims.end_unrun(claimed.id, token)
        if ended is None:
            return False
        log.info(
            "dispatch %s of job %s: cancelled before it started; it never runs",
            claimed.id,
            claimed.job_name,
            extra={"dispatch_id": claimed.id, "job_name": claimed.job_name},
        )
        self.hand_on(claimed)
        self._member_ended(ended, "cancelled", None)
        return True

    def wait_for_rate(self, claimed: DispatchRow, token: str, rate: Rate) -> float | None:
        """Set a claimed run back, before its handler, to wait for a start of its group's
        rate limit; the seconds it waits, or None when the claim was lost meanwhile."""
        group = group_of(claimed.group_key)
        wait = self._limits.rate_wait(
            claimed.job_name, group, rate.count, rate.per_seconds, claimed
        )
        plan = self._outbox.plan_retry(max(wait, MIN_RATE_WAIT_SECONDS))
        row = self._limits.wait_for_rate(
            claimed.id, token, retry_in=plan.retry_in, relay_in=plan.relay_in
        )
        if row is None:
            # Cancelled since its claim, or the claim was lost: a cancelled run ends here,
            # unrun (a lost claim matches nothing).
            self.end_unrun(claimed, token)
            return None
        log.info(
            "dispatch %s of job %s waits %.2fs for a start of its group %r (rate_limit)",
            row.id,
            row.job_name,
            plan.retry_in,
            group,
            extra={"dispatch_id": row.id, "job_name": row.job_name},
        )
        if plan.send_now:
            self._outbox.send(row, attempt=row.attempt + 1, countdown=plan.retry_in)
        return plan.retry_in

    def send_all_waiting(self) -> int:
        """The relay's safety net: every group with runs parked for a seat and seats
        free (by the limit in this process's code) gets them sent; how many were sent."""
        sent = 0
        for job_name in self._limits.concurrency_waiting_jobs(self._jobs()):
            limits = self._limits_of(job_name)
            if limits is None:
                continue  # a job this process does not run: its own workers' relays do
            limit = _limit_or_none(limits)
            for group in self._limits.groups_with_room(job_name, limit):
                sent += self.send_waiting(job_name, group)
        return sent


def _limit_or_none(limits: Limits) -> int:
    """The concurrency limit to hand seats on by: with none (any more) in this code, every
    waiting run goes, since nothing else would ever send them on."""
    return limits.concurrency if limits.concurrency is not None else 1 << 30
