"""The operator's reads of the ledger (lists, counts, what is stuck, parked slots), its
one write (`requeue`), and the Django admin's own reads (the job names, the planner's
estimate of a list's length).

The lists and counts are built per call: they are rare, and their filters vary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import (
    ColumnElement,
    Select,
    Update,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)

from ..errors import LedgerBusyError
from .errors import SlotTaken
from .executor import Part
from .rows import DispatchRow
from .schema import RUNNING, dispatch_table
from .statements import add_preamble, db_time, slot_busy

#: The most rows one reason's stuck count counts (for every job together).
STUCK_COUNT_CAP = 100_000


class ViewStatements:
    """The operator's prebuilt statement for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self.requeue: Update = requeue_statement()
        add_preamble(self, preamble, ("requeue",))


def list_dispatches_query(
    *,
    job: str | None,
    status: str | None,
    key: str | None,
    older_than: float | None,
    before: tuple[Any, str] | None,
    limit: int,
) -> Select[Any]:
    """Dispatches newest first, filtered, a page at a time (`before`: the last row's
    (created_at, id) of the previous page)."""
    t = dispatch_table.c
    stmt = select(dispatch_table)
    if job is not None:
        stmt = stmt.where(t.job_name == job)
    if status is not None:
        stmt = stmt.where(t.status == status)
    if key is not None:
        stmt = stmt.where(t.idempotency_key == key)
    if older_than is not None:
        stmt = stmt.where(t.created_at < db_time(-older_than))
    if before is not None:
        created, dispatch_id = before
        stmt = stmt.where(
            or_(t.created_at < created, and_(t.created_at == created, t.id < dispatch_id))
        )
    return stmt.order_by(t.created_at.desc(), t.id.desc()).limit(limit)


def counts_query() -> Select[Any]:
    """(job, status, count, oldest created_at, oldest due run_after) for every job and
    status."""
    t = dispatch_table.c
    return (
        select(
            t.job_name,
            t.status,
            func.count().label("count"),
            func.min(t.created_at).label("oldest"),
            # Waiting since it became due: a far-off start is not late before it comes.
            func.min(case((t.run_after <= db_time(), t.run_after))).label("oldest_due"),
        )
        .group_by(t.job_name, t.status)
        .order_by(t.job_name, t.status)
    )


def _stuck_where(*, grace: float, redeliver_after: float) -> dict[str, ColumnElement[bool]]:
    """What should have moved on and did not, by reason: the one definition the list and
    the count share."""
    t = dispatch_table.c
    return {
        # Never accepted by the broker, well past the time the relay should have sent it.
        "never sent": and_(t.status == "pending", t.next_send_at < db_time(-grace)),
        "lease lapsed": and_(t.status == "active", t.lease_expires_at < db_time()),
        "accepted, never claimed": and_(
            t.status == "queued",
            t.queued_at < db_time(-redeliver_after),
            # Set back for its rate window, it waits for its time, like a delayed start.
            or_(t.waiting_for.is_(None), t.run_after <= db_time()),
        ),
        "parked, slot free": and_(
            t.status == "parked", t.waiting_for.is_(None), ~slot_busy(t.job_name, t.slot)
        ),
        # Whatever the limit, a group with no seat held and none on its way has room.
        "parked, seats free": and_(
            t.status == "parked", t.waiting_for == "concurrency", ~_group_busy()
        ),
    }


def _group_busy() -> ColumnElement[bool]:
    """A run of the row's group holds a seat, or is on its way to one."""
    t = dispatch_table.c
    other = dispatch_table.alias("other")
    return (
        select(other.c.id)
        .where(
            other.c.job_name == t.job_name,
            other.c.group_key == t.group_key,
            or_(
                and_(other.c.seat.is_not(None), other.c.status.in_(RUNNING)),
                and_(other.c.status == "queued", other.c.waiting_for == "concurrency"),
            ),
        )
        .exists()
    )


#: The reasons a dispatch is stuck, in the order the operator lists them.
STUCK_REASONS: tuple[str, ...] = tuple(_stuck_where(grace=0.0, redeliver_after=0.0))


def stuck_queries(*, grace: float, redeliver_after: float, limit: int) -> dict[str, Select[Any]]:
    """What should have moved on and did not, by reason."""
    t = dispatch_table.c
    newest = (t.created_at.desc(), t.id.desc())
    return {
        reason: select(dispatch_table).where(where).order_by(*newest).limit(limit)
        for reason, where in _stuck_where(grace=grace, redeliver_after=redeliver_after).items()
    }


def stuck_count_queries(*, grace: float, redeliver_after: float) -> dict[str, Select[Any]]:
    """(job, count) of what is stuck, by reason. Counted through a capped subquery, like
    the backlog: a ledger stuck by the million costs a bounded scan, and reads as the cap."""
    counts: dict[str, Select[Any]] = {}
    for reason, where in _stuck_where(grace=grace, redeliver_after=redeliver_after).items():
        found = select(dispatch_table.c.job_name).where(where).limit(STUCK_COUNT_CAP).subquery()
        counts[reason] = (
            select(found.c.job_name, func.count().label("count"))
            .group_by(found.c.job_name)
            .order_by(found.c.job_name)
        )
    return counts


def parked_slots_query(limit: int) -> Select[Any]:
    """(job, slot, count, oldest created_at) of parked runs, the fullest slots first."""
    t = dispatch_table.c
    return (
        select(
            t.job_name,
            t.slot,
            func.count().label("count"),
            func.min(t.created_at).label("oldest"),
        )
        .where(t.status == "parked", t.waiting_for.is_(None))  # a limit's: `group_counts`
        .group_by(t.job_name, t.slot)
        .order_by(func.count().desc(), t.job_name, t.slot)
        .limit(limit)
    )


def requeue_statement() -> Update:
    """A failed dispatch back to `pending`, due for the relay at once: a new attempt under
    the same id and key. Only while its secret (if any) still has its key, and while
    retention has not pruned its payload and options."""
    t = dispatch_table.c
    return (
        update(dispatch_table)
        .where(
            t.id == bindparam("dispatch_id"),
            t.status == "failed",
            or_(t.secret.is_(False), t.secret_wrapped_key.is_not(None)),
            t.options.is_not(None),
        )
        .values(
            status="pending",
            send_count=0,
            claim_token=None,
            finished_at=None,
            next_send_at=db_time(),
            run_after=db_time(),
        )
    )


# --- the Django admin's reads: on Django's own cursor (`%s` placeholders on every backend) --


class Cursor(Protocol):
    """A DB-API cursor, as Django's connections hand them out."""

    def execute(self, sql: str, params: Sequence[Any]) -> Any: ...
    def fetchall(self) -> Sequence[Sequence[Any]]: ...
    def fetchone(self) -> Sequence[Any] | None: ...


#: Opens a cursor of the caller's connection, closed when the block ends
#: (`connections[alias].cursor` on Django).
OpenCursor = Callable[[], AbstractContextManager[Cursor]]


def distinct_job_names(
    open_cursor: OpenCursor, quote: Callable[[str], str], limit: int
) -> list[str]:
    """The distinct job names in the ledger, sorted: a loose index scan of the
    `(job_name, created_at)` index, one probe per job (PostgreSQL and SQLite alike), not a
    `SELECT DISTINCT` of every row. `quote` quotes a name for the cursor's database."""
    table, job = quote(dispatch_table.name), quote(dispatch_table.c.job_name.name)
    sql = (
        "WITH RECURSIVE jobs(name, n) AS ("
        f" SELECT (SELECT min({job}) FROM {table}), 1"
        " UNION ALL"
        f" SELECT (SELECT min({job}) FROM {table} WHERE {job} > jobs.name), jobs.n + 1"
        " FROM jobs WHERE jobs.name IS NOT NULL AND jobs.n < %s"
        ") SELECT name FROM jobs WHERE name IS NOT NULL ORDER BY name"
    )
    with open_cursor() as cursor:
        cursor.execute(sql, [limit])
        return [str(row[0]) for row in cursor.fetchall()]


def planned_rows(
    open_cursor: OpenCursor, dialect: str, sql: str, params: Sequence[Any]
) -> int | None:
    """How many rows PostgreSQL's planner expects the query `sql` to return (its
    statistics, not a count); None on other databases."""
    if dialect != "postgresql":
        return None
    with open_cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        row = cursor.fetchone()
    assert row is not None  # EXPLAIN always answers
    plan = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    return int(plan[0]["Plan"]["Plan Rows"])


class Views(Part):
    """The operator's view of the ledger."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = ViewStatements(dialect, preamble)

    def list_dispatches(
        self,
        *,
        job: str | None = None,
        status: str | None = None,
        key: str | None = None,
        older_than: float | None = None,
        before: tuple[datetime, str] | None = None,
        limit: int = 50,
    ) -> list[DispatchRow]:
        """Dispatches newest first; `before` continues after the last row of a page."""
        stmt = list_dispatches_query(
            job=job, status=status, key=key, older_than=older_than, before=before, limit=limit
        )
        return [DispatchRow.from_mapping(row) for row in self._db._execute(stmt, {})]

    def counts(self) -> list[tuple[str, str, int, datetime, datetime | None]]:
        """(job, status, count, oldest created_at, oldest run_after that has come) per job
        and status."""
        rows = self._db._execute(counts_query(), {})
        return [
            (r["job_name"], r["status"], int(r["count"]), r["oldest"], r["oldest_due"])
            for r in rows
        ]

    def stuck(
        self, *, grace: float, redeliver_after: float, limit: int = 100
    ) -> list[tuple[str, DispatchRow]]:
        """(reason, row) for what should have moved on and did not."""
        found: list[tuple[str, DispatchRow]] = []
        for reason, stmt in stuck_queries(
            grace=grace, redeliver_after=redeliver_after, limit=limit
        ).items():
            found += [
                (reason, DispatchRow.from_mapping(row)) for row in self._db._execute(stmt, {})
            ]
        return found

    def stuck_counts(self, *, grace: float, redeliver_after: float) -> list[tuple[str, str, int]]:
        """(reason, job, count) of what should have moved on and did not; each reason
        counts up to `STUCK_COUNT_CAP` rows."""
        found: list[tuple[str, str, int]] = []
        for reason, stmt in stuck_count_queries(
            grace=grace, redeliver_after=redeliver_after
        ).items():
            found += [(reason, r["job_name"], int(r["count"])) for r in self._db._execute(stmt, {})]
        return found

    def parked_slots(self, limit: int = 50) -> list[tuple[str, str, int, datetime]]:
        """(job, slot, count, oldest created_at) of parked runs, the fullest slots first."""
        rows = self._db._execute(parked_slots_query(limit), {})
        return [(r["job_name"], r["slot"], int(r["count"]), r["oldest"]) for r in rows]

    def requeue(self, dispatch_id: str) -> bool:
        """A failed dispatch back to pending (a new attempt under its id and key); False
        when it is not failed, or is a secret one whose key was erased."""
        try:
            return bool(self._db._execute(self._sql.requeue, {"dispatch_id": dispatch_id}))
        except SlotTaken:
            raise LedgerBusyError(
                "its queue policy slot is taken by another dispatch; requeue it once that ends"
            ) from None
