"""An operator's view of the ledger: what waits, what is stuck, what failed and why, the
chords and batches, and sending a failed dispatch again. `questpie.operator` in Python,
`questpie-celery dispatches ...` (and `canvases ...`) on the command line; the two have
the same reach.

Nothing here returns the payload or the ciphertext of a secret dispatch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from ..errors import LedgerSchemaError, PublishOptionsError
from ..ledger import GroupCounts, Ledger
from ..publish.schedules import ScheduleInfo, schedule_infos
from ..send.outbox import DEFAULT_REDELIVER_AFTER_SECONDS, PENDING_GRACE_SECONDS
from ..worker.cancels import Cancellation
from .receipts import CanvasDetail, CanvasMember, DispatchDetail, canvas_members, member_counts

log = logging.getLogger(__name__)

#: The most rows one call lists.
MAX_PAGE = 1000


@dataclass(frozen=True)
class JobCount:
    job_name: str
    status: str
    count: int
    oldest_age_seconds: float  # of the oldest dispatch of the job in that status
    #: Since when the longest-waiting one that is due to run became due (None: none is
    #: due yet); a dispatch with a far-off start does not count before its start.
    oldest_due_seconds: float | None = None


@dataclass(frozen=True)
class StuckCount:
    reason: str  # as `Operator.stuck` names it
    job_name: str
    count: int


@dataclass(frozen=True)
class ParkedSlot:
    job_name: str
    slot: str  # the singleton key, or "" for the job as a whole
    count: int
    oldest_age_seconds: float


@dataclass(frozen=True)
class Overview:
    """The state of the ledger at a glance: what the status page shows."""

    counts: list[JobCount]
    stuck: list[tuple[str, DispatchDetail]]
    failed: list[DispatchDetail]
    parked: list[ParkedSlot]
    #: (sampled_at, dispatches due for the relay) over the last hour, oldest first.
    backlog: list[tuple[datetime, int]]
    schedules: list[ScheduleInfo]
    #: On the database's clock, like every time in the view.
    taken_at: datetime
    #: What this ledger cannot show yet (its schema is older), in a person's words.
    missing: list[str] = field(default_factory=list)
    #: The groups of limited jobs that hold seats or have runs waiting for a limit.
    groups: list[GroupCounts] = field(default_factory=list)
    #: The newest chords and batches, with their members by status.
    canvases: list[CanvasDetail] = field(default_factory=list)


class Operator:
    """See and steer one ledger."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        grace: float = PENDING_GRACE_SECONDS,
        redeliver_after: float = DEFAULT_REDELIVER_AFTER_SECONDS,
        cancellation: Cancellation | None = None,
    ) -> None:
        self._ledger = ledger
        self._grace = grace
        self._redeliver_after = redeliver_after
        self._cancellation = cancellation or Cancellation(ledger, None)

    @property
    def ledger_label(self) -> str:
        """Which ledger this is, for a person: dialect, host, port and database; never a
        user's password, nor a query string (which may hold one)."""
        url = self._ledger.engine.url.set(password=None, query={})
        return url.render_as_string(hide_password=True)

    def dispatches(
        self,
        *,
        job: str | None = None,
        status: str | None = None,
        key: str | None = None,
        older_than: float | None = None,
        after: DispatchDetail | None = None,
        limit: int = 50,
    ) -> list[DispatchDetail]:
        """Dispatches newest first, filtered by job, status, key and age (seconds); pass
        the last one of a page as `after` for the next page."""
        if not 1 <= limit <= MAX_PAGE:
            raise PublishOptionsError(f"limit must be 1 to {MAX_PAGE}")
        rows = self._ledger.views.list_dispatches(
            job=job,
            status=status,
            key=key,
            older_than=older_than,
            before=(after.created_at, after.dispatch_id) if after is not None else None,
            limit=limit,
        )
        return [DispatchDetail.of(row) for row in rows]

    def show(self, dispatch_id: str) -> DispatchDetail | None:
        row = self._ledger.get(dispatch_id)
        return DispatchDetail.of(row) if row is not None else None

    def stuck(self, limit: int = 100) -> list[tuple[str, DispatchDetail]]:
        """(reason, dispatch) for what should have moved on and did not: never sent long
        past its time, a lease that lapsed, accepted but unclaimed past `redeliver_after`,
        parked while its slot is free. The relay repairs each of these within its bounds;
        what stays here longer points at a relay that is not running."""
        found = self._ledger.views.stuck(
            grace=self._grace, redeliver_after=self._redeliver_after, limit=limit
        )
        return [(reason, DispatchDetail.of(row)) for reason, row in found]

    def stuck_counts(self) -> list[StuckCount]:
        """How many dispatches of each job are stuck, by the reasons of `stuck`, without
        listing them: what a monitoring system watches."""
        found = self._ledger.views.stuck_counts(
            grace=self._grace, redeliver_after=self._redeliver_after
        )
        return [StuckCount(reason, job, count) for reason, job, count in found]

    def failed(self, limit: int = 50, job: str | None = None) -> list[DispatchDetail]:
        return self.dispatches(status="failed", job=job, limit=limit)

    def counts(self) -> list[JobCount]:
        now = self._ledger.now()
        return [
            JobCount(
                job,
                status,
                count,
                _age(now, oldest) or 0.0,
                _age(now, oldest_due),
            )
            for job, status, count, oldest, oldest_due in self._ledger.views.counts()
        ]

    def parked(self, limit: int = 50) -> list[ParkedSlot]:
        """Parked runs per queue-policy slot, the fullest slots first."""
        now = self._ledger.now()
        return [
            ParkedSlot(job, slot, count, max((now - oldest).total_seconds(), 0.0))
            for job, slot, count, oldest in self._ledger.views.parked_slots(limit)
        ]

    def groups(self, limit: int = 500) -> list[GroupCounts]:
        """Each group of a job with a concurrency or rate limit that holds seats or has
        runs waiting: its running count, its runs waiting for a seat or for their rate
        window, and those sent on to a seat not yet claimed."""
        return self._ledger.limits.group_counts(min(limit, MAX_PAGE))

    def backlog(self, seconds: float = 3600.0) -> list[tuple[datetime, int]]:
        """How many dispatches were due for the relay to send, as running relays sampled
        it (about twice a minute) over the last `seconds`, oldest first."""
        return self._ledger.relay.backlog_history(seconds)

    def canvases(
        self, limit: int = 50, *, status: str | None = None, kind: str | None = None
    ) -> list[CanvasDetail]:
        """The newest chords and batches (of one status and kind, if given), each with its
        members counted by status and its callback's dispatch status."""
        if not 1 <= limit <= MAX_PAGE:
            raise PublishOptionsError(f"limit must be 1 to {MAX_PAGE}")
        canvases = self._ledger.canvases
        rows = canvases.filtered(status=status, kind=kind, limit=limit)
        callbacks = canvases.member_states([row.callback_id for row in rows])
        return [
            CanvasDetail.of(
                row,
                member_counts(canvases, row.members),
                callbacks.get(row.callback_id) if row.callback_id is not None else None,
            )
            for row in rows
        ]

    def canvas(self, canvas_id: str) -> CanvasDetail | None:
        """One chord or batch, by its id or by its callback's dispatch id; None when the
        ledger has neither."""
        canvases = self._ledger.canvases
        row = canvases.get(canvas_id) or canvases.by_callback(canvas_id)
        if row is None:
            return None
        callback = (
            canvases.member_states([row.callback_id]).get(row.callback_id)
            if row.callback_id is not None
            else None
        )
        return CanvasDetail.of(row, member_counts(canvases, row.members), callback)

    def canvas_members(self, canvas_id: str) -> list[CanvasMember] | None:
        """Each member of a chord or batch in order: its dispatch id, job, status and
        error class (never its result); None when the ledger has no such canvas."""
        canvases = self._ledger.canvases
        row = canvases.get(canvas_id) or canvases.by_callback(canvas_id)
        return canvas_members(canvases, row) if row is not None else None

    def schedules(self) -> list[ScheduleInfo]:
        """Every schedule: job, cron, zone, next and last fire, and the last fire's status."""
        return schedule_infos(self._ledger)

    def unschedule(self, job_name: str) -> int:
        """Remove every schedule of a job, also of one no process registers any more;
        returns how many there were. Logged, like a requeue."""
        removed = self._ledger.schedules.delete(job_name)
        log.warning(
            "%d schedule(s) of job %s removed by an operator",
            removed,
            job_name,
            extra={"job_name": job_name, "audit": "unschedule"},
        )
        return removed

    def overview(self, limit: int = 20) -> Overview:
        """Counts, stuck, failed, parked slots, the relay's backlog, the schedules and the
        newest chords and batches in one call."""
        missing: list[str] = []
        try:  # tables a schema older than version 3 lacks: the rest of the view still works
            backlog, schedules = self.backlog(), self.schedules()
        except LedgerSchemaError:
            backlog, schedules = [], []
            missing.append(
                f"the relay's backlog and the schedules (run {self._ledger.migrate_command})"
            )
        try:  # the canvas table a schema older than version 9 lacks
            canvases = self.canvases(limit=limit)
        except LedgerSchemaError:
            canvases = []
            missing.append(f"the chords and batches (run {self._ledger.migrate_command})")
        return Overview(
            counts=self.counts(),
            stuck=self.stuck(limit=limit),
            failed=self.failed(limit=limit),
            parked=self.parked(limit=limit),
            backlog=backlog,
            schedules=schedules,
            taken_at=self._ledger.now(),
            missing=missing,
            groups=self.groups(limit=limit),
            canvases=canvases,
        )

    def cancel(self, dispatch_id: str) -> tuple[bool, DispatchDetail]:
        """Cancel a dispatch (see `questpie.queue.cancel`): whether it will not run again
        (False: it had ended already), and where it stands now. Every cancel is logged."""
        cancelled = self._cancellation.cancel(dispatch_id)
        detail = self.show(dispatch_id)
        assert detail is not None
        log.warning(
            "dispatch %s of job %s %s by an operator",
            dispatch_id,
            detail.job_name,
            "cancelled" if cancelled else "not cancelled (it had ended)",
            extra={"dispatch_id": dispatch_id, "job_name": detail.job_name, "audit": "cancel"},
        )
        return cancelled, detail

    def requeue(self, dispatch_id: str) -> DispatchDetail:
        """Send a failed dispatch again: a new attempt under the same id and key.

        Refused (with `PublishOptionsError`) for a dispatch that is not failed, for a
        failed secret one, whose key was erased when it failed, and for one retention
        pruned: publish those again under a new key. Every requeue is logged.
        """
        row = self._ledger.get(dispatch_id)
        if row is None:
            raise PublishOptionsError(f"no ledgered dispatch has the id {dispatch_id!r}")
        if row.status != "failed":
            raise PublishOptionsError(f"dispatch {dispatch_id} is {row.status}, not failed")
        if row.secret:
            raise PublishOptionsError(
                f"dispatch {dispatch_id} is secret and its key was erased when it failed; "
                "publish it again under a new idempotency key"
            )
        if row.pruned:
            raise PublishOptionsError(
                f"dispatch {dispatch_id} ended long enough ago that retention dropped its "
                "payload and options; publish it again under a new idempotency key"
            )
        if not self._ledger.views.requeue(dispatch_id):
            raise PublishOptionsError(f"dispatch {dispatch_id} changed meanwhile; look again")
        log.warning(
            "dispatch %s of job %s requeued by an operator after %d attempt(s) (last error %s)",
            row.id,
            row.job_name,
            row.attempt,
            row.last_error,
            extra={"dispatch_id": row.id, "job_name": row.job_name, "audit": "requeue"},
        )
        detail = self.show(dispatch_id)
        assert detail is not None
        return detail


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max((now - then).total_seconds(), 0.0)
