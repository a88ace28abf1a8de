"""The flow-control limits' statements: the rate limit's permits, a run set back to wait
for its window, the next waiting run of a group sent on, and each group's counts.

The concurrency limit itself is the claim's seat (`claims.py`, `statements.free_seat`)
and the seat index (`schema.py`); a run it turns away is parked (`worker/slots.py`) with
`waiting_for` "concurrency".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    ColumnElement,
    Delete,
    Integer,
    Select,
    Update,
    and_,
    bindparam,
    case,
    delete,
    func,
    or_,
    select,
    tuple_,
    type_coerce,
    update,
)

from .errors import SlotTaken
from .executor import Part
from .rows import DispatchRow
from .schema import LIMIT_WAITING, RUNNING, UTCDateTime, dispatch_table, rate_permit_table
from .statements import add_preamble, by_id, db_time, group_written, insert_or_nothing, seconds

#: A permit never used: its window has long passed.
_NEVER = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class GroupCounts:
    """What one group of a limited job holds and waits for, as the operator sees it."""

    job_name: str
    group_key: str  # "" for the job as a whole
    running: int  # runs holding a concurrency seat
    waiting_for_concurrency: int
    waiting_for_rate: int
    #: Runs sent on to their seat (or their window) and not yet claimed.
    on_their_way: int


def priority_first() -> list[ColumnElement[Any]]:
    """Waiting runs in the order they go: higher priority first (unset counts as 0),
    then first come, first served."""
    t = dispatch_table.c
    priority = type_coerce(t.options, JSON)["priority"].as_integer()
    return [func.coalesce(priority, 0).desc(), t.created_at, t.id]


class LimitStatements:
    """The limits' statements for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        p = rate_permit_table.c
        now = db_time()
        permits = and_(
            p.job_name == bindparam("job"),
            p.group_key == bindparam("group"),
            p.seat < bindparam("count"),
        )
        window_passed = p.started_at <= db_time(-seconds("window"))
        oldest_free = (
            select(p.seat).where(permits, window_passed).order_by(p.started_at, p.seat).limit(1)
        )
        if dialect == "postgresql":
            # Concurrent starters each take a different permit instead of queueing on one.
            oldest_free = oldest_free.with_for_update(skip_locked=True)
        # Conditional on the window again: two starters that chose the same permit cannot
        # both take it (the second finds it just started, and takes nothing).
        self.take_permit: Update = (
            update(rate_permit_table)
            .where(permits, window_passed, p.seat == oldest_free.scalar_subquery())
            .values(started_at=now)
            .returning(p.seat)
        )
        self.add_permits = insert_or_nothing(dialect, rate_permit_table).values(
            job_name=bindparam("job"),
            group_key=bindparam("group"),
            seat=bindparam("seat"),
            started_at=bindparam("never", type_=UTCDateTime),
        )
        self.permits: Select[Any] = select(p.started_at, now.label("now")).where(permits)
        # Rows that hold a seat or wait for a limit have their group written (see
        # `statements.group_written`): found by the plain column, through the limit indexes.
        in_group = and_(t.job_name == bindparam("job"), t.group_key == bindparam("group"))
        waiting = t.status.in_(LIMIT_WAITING)
        # Runs of the group already waiting for their window that go before this one.
        priority = func.coalesce(type_coerce(t.options, JSON)["priority"].as_integer(), 0)
        # Only those that go before it (higher priority, or the same and older): a run
        # refused again at its time keeps its place ahead of those that came after it.
        mine = bindparam("priority", type_=Integer)
        created = bindparam("created_at", type_=UTCDateTime)
        self.rate_ahead: Select[Any] = select(func.count()).where(
            in_group,
            t.waiting_for == "rate",
            waiting,
            or_(
                priority > mine,
                and_(
                    priority == mine,
                    or_(
                        t.created_at < created,
                        and_(t.created_at == created, t.id < bindparam("dispatch_id")),
                    ),
                ),
            ),
        )
        # A claimed run the rate limit turns away, before its handler: as it was before
        # the claim (not an attempt), due when its window comes. A first attempt waits as
        # queued; one that the policy's waiting slot now refuses (another run took it
        # meanwhile), or a retry, waits as a retry does, keeping its running slot.
        held = and_(by_id(), t.claim_token == bindparam("token"), t.status == "active")
        back: dict[str, Any] = {
            "attempt": t.attempt - 1,
            "claim_token": None,
            "lease_expires_at": None,
            "started_at": case((t.attempt == 1, None), else_=t.started_at),
            "waiting_for": "rate",
            **group_written(),
            "run_after": db_time(seconds("retry_in")),
            "next_send_at": db_time(seconds("relay_in")),
        }
        # A run cancelled after its claim never goes back to waiting: its claimer ends it.
        not_cancelled = t.cancel_requested_at.is_(None)
        self.wait_queued: Update = (
            update(dispatch_table)
            .where(held, not_cancelled, t.attempt == 1)
            .values(status="queued", seat=None, **back)
            .returning(*dispatch_table.c)
        )
        self.wait_retry: Update = (
            update(dispatch_table)
            .where(held, not_cancelled)
            .values(status="retry", **back)
            .returning(*dispatch_table.c)
        )
        # The concurrency limit's hand-on: the group's first waiting run goes (and keeps
        # `waiting_for` until its claim, so it counts as on its way).
        first_parked = (
            select(t.id)
            .where(in_group, t.status == "parked", t.waiting_for == "concurrency")
            .order_by(*priority_first())
            .limit(1)
            .scalar_subquery()
        )
        self.unpark_first: Update = (
            update(dispatch_table)
            .where(t.id == first_parked, t.status == "parked")
            .values(status="queued", next_send_at=db_time(seconds("redeliver_in")))
            .returning(*dispatch_table.c)
        )
        seated = and_(t.seat.is_not(None), t.status.in_(RUNNING))
        on_way = and_(t.status == "queued", t.waiting_for == "concurrency")
        self.taken: Any = select(
            func.count().filter(seated).label("running"),
            func.count().filter(on_way).label("on_way"),
        ).where(in_group, or_(seated, on_way))
        group = t.group_key.label("group_key")
        waiting_row = and_(t.waiting_for.is_not(None), waiting)
        parked_conc = and_(t.status == "parked", t.waiting_for == "concurrency")
        self.groups: Select[Any] = (
            select(
                t.job_name,
                group,
                func.count().filter(seated).label("running"),
                func.count().filter(parked_conc).label("waiting_for_concurrency"),
                func.count().filter(t.waiting_for == "rate").label("waiting_for_rate"),
                func.count().filter(on_way).label("on_their_way"),
            )
            .where(or_(seated, waiting_row))
            .group_by(t.job_name, group)
            .order_by(t.job_name, group)
            .limit(bindparam("limit"))
        )
        parked_here = and_(t.status == "parked", t.waiting_for == "concurrency")
        # Among the jobs the asking process runs: others' (another app's on the same
        # ledger, a job gone from the code) are never in the way.
        self.waiting_jobs: Select[Any] = (
            select(t.job_name)
            .where(parked_here, t.job_name.in_(bindparam("jobs", expanding=True)))
            .distinct()
        )
        # The relay's safety net: the groups of one job with runs parked for a seat and
        # room under its limit, the longest waiting first (full groups are not listed, so
        # however many there are, a group with room is reached).
        other = dispatch_table.alias("other")
        taken_in_group = (
            select(func.count())
            .where(
                other.c.job_name == t.job_name,
                other.c.group_key == t.group_key,
                or_(
                    and_(other.c.seat.is_not(None), or_(*(other.c.status == s for s in RUNNING))),
                    and_(other.c.status == "queued", other.c.waiting_for == "concurrency"),
                ),
            )
            .correlate(dispatch_table)
            .scalar_subquery()
        )
        self.groups_with_room: Select[Any] = (
            select(t.group_key)
            .where(t.job_name == bindparam("job"), parked_here)
            .group_by(t.job_name, t.group_key)
            .having(taken_in_group < bindparam("limit_"))
            .order_by(func.min(t.created_at))
            .limit(bindparam("limit"))
        )
        spent = (
            select(p.job_name, p.group_key, p.seat)
            .where(p.started_at < db_time(-seconds("older_than")))
            .limit(bindparam("limit"))
        )
        self.prune_permits: Delete = delete(rate_permit_table).where(
            tuple_(p.job_name, p.group_key, p.seat).in_(spent)
        )
        add_preamble(
            self,
            preamble,
            ("take_permit", "wait_queued", "wait_retry", "unpark_first", "prune_permits"),
        )


class Limits(Part):
    """The rate limit's permits, runs set back for their window, and the groups' counts."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = LimitStatements(dialect, preamble)

    def take_permit(self, job_name: str, group: str, count: int, window: float) -> float | None:
        """Take a start of the rate limit `count` per `window` seconds for (job, group):
        None when taken, else how many seconds until the next permit frees (0 when others
        were taking them this instant)."""
        params = {"job": job_name, "group": group, "count": count, "window": window}
        for _ in range(2):
            if self._db._first(self._sql.take_permit, params) is not None:
                return None
            rows = self._db._execute(self._sql.permits, params)
            if len(rows) >= count:
                now = rows[0]["now"]
                soonest = min((r["started_at"] - now).total_seconds() for r in rows)
                # A permit taken by a transaction that began a moment after this read's
                # (its start, `now`, comes before its snapshot) looks taken in the future:
                # no permit frees later than a window from now.
                return min(window, max(0.0, float(soonest) + window))
            # The group's first start (or a raised limit): its permits are made once.
            self._db._execute(
                self._sql.add_permits,
                [
                    {"job": job_name, "group": group, "seat": seat, "never": _NEVER}
                    for seat in range(count)
                ],
            )
        return 0.0

    def rate_wait(
        self, job_name: str, group: str, count: int, window: float, row: DispatchRow
    ) -> float:
        """How long `row` waits for its window: behind the group's runs already waiting
        that go before it, one permit each, in the order the permits free."""
        params = {"job": job_name, "group": group, "count": count, "window": window}
        rows = self._db._execute(self._sql.permits, params)
        if not rows:
            return 0.0
        now = rows[0]["now"]
        frees = sorted(max(0.0, (r["started_at"] - now).total_seconds() + window) for r in rows)
        ahead = self._db._first(
            self._sql.rate_ahead,
            {
                "job": job_name,
                "group": group,
                "dispatch_id": row.id,
                "priority": row.options.priority or 0,
                "created_at": row.created_at,
            },
        )
        position = int(next(iter(ahead.values()))) if ahead is not None else 0
        return float(frees[position % len(frees)] + (position // len(frees)) * window)

    def wait_for_rate(
        self, dispatch_id: str, token: str, *, retry_in: float, relay_in: float
    ) -> DispatchRow | None:
        """Set a claimed run back to wait `retry_in` s for its rate window, unrun and not
        an attempt; `relay_in` is when the relay sends it if its message is lost. The row
        as it now is, or None when the claim is no longer ours or the run was cancelled
        since its claim (then its claimer ends it: `Claims.finish` writes `cancelled`)."""
        params = {
            "dispatch_id": dispatch_id,
            "token": token,
            "retry_in": retry_in,
            "relay_in": relay_in,
        }
        try:
            row = self._db._row(self._sql.wait_queued, params)
        except SlotTaken:
            row = None  # its policy's waiting slot is taken: it waits as a retry does
        if row is None:
            row = self._db._row(self._sql.wait_retry, params)
        return row

    def unpark_first(self, job_name: str, group: str, redeliver_in: float) -> DispatchRow | None:
        """Move the first run parked for the group's concurrency (by priority, then age)
        back to `queued`; the caller sends it. Conditional, so of several processes handing
        seats on at once each wins a different run, or none."""
        params = {"job": job_name, "group": group, "redeliver_in": redeliver_in}
        for _ in range(3):
            rows, retried = self._db._run(self._sql.unpark_first, params)
            if rows:
                return DispatchRow.from_mapping(rows[0])
            if not retried:
                return None
        return None

    def seats_taken(self, job_name: str, group: str) -> int:
        """Runs of the group holding a seat, and runs sent on to one not yet claimed."""
        row = self._db._first(self._sql.taken, {"job": job_name, "group": group})
        return 0 if row is None else int(row["running"] or 0) + int(row["on_way"] or 0)

    def concurrency_waiting_jobs(self, among: Sequence[str]) -> list[str]:
        """Which of the jobs `among` have runs parked for their concurrency limit."""
        if not among:
            return []
        rows = self._db._execute(self._sql.waiting_jobs, {"jobs": list(among)})
        return [row["job_name"] for row in rows]

    def groups_with_room(self, job_name: str, concurrency: int, limit: int = 100) -> list[str]:
        """The groups of `job_name` with runs parked for a seat and fewer than
        `concurrency` seats taken (or runs on their way to one), longest waiting first."""
        params = {"job": job_name, "limit_": concurrency, "limit": limit}
        return [row["group_key"] for row in self._db._execute(self._sql.groups_with_room, params)]

    def group_counts(self, limit: int = 500) -> list[GroupCounts]:
        """Each group that holds seats or has runs waiting for a limit, with its counts."""
        rows = self._db._execute(self._sql.groups, {"limit": limit})
        return [
            GroupCounts(
                job_name=row["job_name"],
                group_key=row["group_key"],
                running=int(row["running"]),
                waiting_for_concurrency=int(row["waiting_for_concurrency"]),
                waiting_for_rate=int(row["waiting_for_rate"]),
                on_their_way=int(row["on_their_way"]),
            )
            for row in rows
        ]

    def prune_permits(self, *, older_than: float, limit: int) -> int:
        """Delete up to `limit` rate permits last used over `older_than` seconds ago (more
        than any window): a group's next start makes them again. How many went."""
        params = {"older_than": older_than, "limit": limit}
        return int(self._db._execute(self._sql.prune_permits, params))
