"""The execution fence's claims, and how a claimed (or never claimed) attempt ends.

A claim is one conditional update of the row: it succeeds for the delivery of exactly
the next attempt of a due, claimable row of its job, and hands the claimer a fencing
token. Only the holder of that token may renew the lease or end the attempt; the
relay ends a lapsed lease. A delivery that ended without a run touches only a row
still waiting for that very claim.

On PostgreSQL a claim can carry another run's completion (`CarriedEnd`): the two
writes go in one statement and one commit, so a busy process pays one commit per run
where it paid two. The completion is the same conditional write as `finish`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Select,
    Update,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.sql import Executable

from .errors import SlotTaken
from .executor import Part
from .rows import Claim, DispatchRow
from .schema import CLAIMABLE, LEASE_EXPIRED, TERMINAL, Status, dispatch_table
from .statements import (
    add_preamble,
    by_id,
    cancelled_values,
    claimable,
    db_time,
    deliverable,
    delivered,
    free_seat,
    group_written,
    seats_held,
    seconds,
    terminal_values,
)

#: How often one claim picks a seat again after another run took the one it picked.
SEAT_TRIES = 5


@dataclass(frozen=True)
class CarriedEnd:
    """A run's completion, recorded with the next claim its process makes (see the
    module's text): the claim holder's token and the run's encoded result."""

    dispatch_id: str
    token: str
    result: dict[str, Any] | None


@dataclass(frozen=True)
class Renewal:
    """A renewed lease, and whether a cancel reached the run."""

    cancel_requested: bool


class ClaimStatements:
    """The fence's statements for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        now = db_time()
        held = and_(by_id(), t.claim_token == bindparam("token"), t.status == "active")
        # Never before the row is due: a message that carries the id of a dispatch that
        # waits for its start or its retry (a forged one, a stale copy) runs nothing early.
        # Eager mode runs everything at once, as Celery's does (`any_time`).
        started = or_(bindparam("any_time", type_=Boolean), t.run_after <= now)
        claimed: dict[str, Any] = {
            "status": "active",
            "attempt": t.attempt + 1,
            "send_count": 0,  # the relay's budget counts sends per attempt
            "claim_token": bindparam("new_token"),
            # The fencing token: one more than any claim before, whatever became of it.
            "claim_generation": func.coalesce(t.claim_generation, 0) + 1,
            "lease_expires_at": db_time(seconds("lease")),
            "started_at": now,
            "queued_at": delivered(),
            # Nothing is due for the relay while a claim holds: it watches the lease.
            "next_send_at": None,
            "waiting_for": None,
            # A claimed debounced run has left its burst: a publish now starts a new one.
            "debounce_key": None,
        }
        # A retry keeps the seat it holds (it is in the seat index already, and stays
        # there), also when a worker whose code has no limit (yet) claims it; any other
        # row claimed without a limit takes no seat along, whatever one it held before.
        self.claim: Update = (
            update(dispatch_table)
            .where(deliverable(), started)
            .values(**claimed, seat=case((t.status == "retry", t.seat), else_=None))
            .returning(*dispatch_table.c)
        )
        # A run of a job with a concurrency limit also takes a seat of its group: the one
        # it kept while awaiting its retry, else the lowest free one, while fewer seats
        # are held than the limit (runs left on seats above a lowered limit count too).
        # Otherwise nothing is claimed; two claims that pick the same seat at once meet
        # the seat index, and the loser picks again (`Claims.claim`).
        free = free_seat()
        keeps_seat = and_(t.status == "retry", t.seat.is_not(None))
        self.claim_seated: Update = (
            update(dispatch_table)
            .where(
                deliverable(),
                started,
                # Fewer seats held than the limit: then the lowest free seat is below it
                # (at most the count), so the search runs once, in the SET.
                or_(keeps_seat, seats_held() < bindparam("limit")),
            )
            .values(**claimed, **group_written(), seat=case((keeps_seat, t.seat), else_=free))
            .returning(*dispatch_table.c)
        )
        # The renewal carries a cancel back to the run (`ctx.cancel_requested`).
        self.renew: Update = (
            update(dispatch_table)
            .where(held)
            .values(lease_expires_at=db_time(seconds("lease")))
            .returning(t.cancel_requested_at)
        )
        # Why a claim took nothing, and how long before the row is due, on one clock.
        self.get_and_now: Select[Any] = select(dispatch_table, now.label("now")).where(by_id())
        # An early delivery dropped: the relay sends the row when it is due, whatever time
        # it was to look at the row next (a retry sent at once looks only after
        # `redeliver_after`, trusting the message the early delivery may have been).
        # (The acceptance mark of a publish that comes later leaves it so; see
        # `dispatches._made_due_at_start`.)
        self.send_when_due: Update = (
            update(dispatch_table)
            .where(
                by_id(),
                t.job_name == bindparam("job"),
                claimable(),
                t.attempt == bindparam("previous"),
                or_(t.next_send_at.is_(None), t.next_send_at > t.run_after),
            )
            # A delivery reached a worker: the relay's budget of sends that found no
            # worker starts again (a debounced burst's start, pushed back by a stream of
            # publishes, can drop many early deliveries before it runs).
            .values(next_send_at=t.run_after, send_count=0)
        )
        terminal = terminal_values()
        retrying: dict[str, Any] = {
            "lease_expires_at": None,
            "last_error": bindparam("error"),
            "status": "retry",
            "run_after": db_time(seconds("retry_in")),
            "next_send_at": db_time(seconds("relay_in")),
        }
        # A run cancelled while it ran ends as `cancelled`, however its handler ended,
        # and is never retried: the retry's write does not match it (see `Claims.retry`).
        ends_as = case(
            (t.cancel_requested_at.is_not(None), "cancelled"), else_=bindparam("new_status")
        )
        not_cancelled = t.cancel_requested_at.is_(None)
        self.finish: Update = (
            update(dispatch_table)
            .where(held)
            .values(status=ends_as, result=bindparam("result", type_=t.result.type), **terminal)
        )
        # A claimed run found cancelled before its handler began (the cancel came between
        # the claim and the fence's look at it, or before its rate set-back): ended as
        # `cancelled`, unrun. Its claim is undone in the record: the attempt it took is
        # given back, a first attempt's start cleared, a retry's error kept.
        self.end_unrun: Update = (
            update(dispatch_table)
            .where(held, t.cancel_requested_at.is_not(None))
            .values(
                attempt=t.attempt - 1,
                started_at=case((t.attempt == 1, None), else_=t.started_at),
                **cancelled_values(),
            )
            .returning(*dispatch_table.c)
        )
        self.retry: Update = update(dispatch_table).where(held, not_cancelled).values(**retrying)
        # Ending a lapsed lease is the relay's doing, not the holder's: it clears the token,
        # so a holder reading back after a failed write knows its own write did not land.
        lapsed = and_(held, t.lease_expires_at < now)
        self.lapse_retry: Update = (
            update(dispatch_table).where(lapsed, not_cancelled).values(claim_token=None, **retrying)
        )
        self.lapse_fail: Update = (
            update(dispatch_table)
            .where(lapsed)
            .values(
                status=case((not_cancelled, "failed"), else_="cancelled"),
                claim_token=None,
                **terminal,
            )
        )
        self.expired: Select[Any] = (
            select(dispatch_table)
            .where(t.status == "active", t.lease_expires_at < now)
            .order_by(t.lease_expires_at)
            .limit(bindparam("limit"))
        )

        # A delivery that ended without a run (its pool process died before the claim, or
        # the worker revoked its message): only a row still waiting for that very claim
        # is touched, so a run that did claim, or a later attempt, is never disturbed.
        # Due now, unless its start is further off than the outbox's ETA horizon (the
        # lost delivery was an early copy): then its own next send stands, or the relay
        # would hand the broker an ETA far in the future.
        self.send_unclaimed_now: Update = (
            update(dispatch_table)
            .where(deliverable())
            .values(
                next_send_at=case(
                    (t.run_after > db_time(seconds("horizon")), t.next_send_at), else_=now
                )
            )
        )
        self.end_unclaimed: Update = (
            update(dispatch_table)
            .where(deliverable())
            .values(status="failed", claim_token=None, queued_at=delivered(), **terminal)
            .returning(*dispatch_table.c)
        )
        add_preamble(self, preamble, _CARRY_PREAMBLE)
        self.claim_carrying = (
            _claim_carrying(self.claim, ends_as, terminal, preamble)
            if dialect == "postgresql"
            else None
        )


def _claim_carrying(
    claim: Update,
    ends_as: ColumnElement[Any],
    terminal: dict[str, Any],
    preamble: ColumnElement[bool] | None,
) -> Select[Any]:
    """`claim` and another run's `finish` in one statement: both updates as data-modifying
    CTEs of one snapshot (they address different rows: `Claims.claim` sees to it), and
    one row out whatever matched: the claimed row's columns (all NULL when nothing was
    claimed) and how many rows the completion moved (0 or 1)."""
    t = dispatch_table.c
    held = and_(
        t.id == bindparam("carried_id"),
        t.claim_token == bindparam("token"),
        t.status == "active",
    )
    if preamble is not None:
        held = and_(held, preamble)
    ended = (
        update(dispatch_table)
        .where(held)
        # Its result under a name no column has: a parameter named as a column would
        # also be written to that column of the claimed row where SQLAlchemy compiles the
        # statement (a rerun, an engine whose statements are watched), and failed there.
        .values(status=ends_as, result=bindparam("carried_result", type_=t.result.type), **terminal)
        .returning(t.id)
        .cte("carried")
    )
    # The claimed row is taken only if no other transaction holds it: the completion
    # must not wait with it (an uncommitted publish or cancel of that row could hold it
    # past the completed run's lease, which would lapse, and the run would run again).
    # A held row is claimed nothing here; `Claims.claim` then claims it alone, waiting
    # for it as any claim does.
    free = dispatch_table.alias("free")
    unheld = (
        select(free.c.id)
        .where(free.c.id == bindparam("dispatch_id"))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    claimed = claim.where(t.id == unheld).cte("claimed")
    one = select(literal_column("1").label("one")).subquery("one")
    landed = select(func.count()).select_from(ended).scalar_subquery()
    return select(*claimed.c, landed.label(CARRIED_LANDED)).select_from(
        one.outerjoin(claimed, true())
    )


#: The combined statement's column that counts the carried completion's row.
CARRIED_LANDED = "questpie_carried"

#: The writes that carry a pooled ledger's settings (see `statements.add_preamble`).
_CARRY_PREAMBLE = (
    "claim", "claim_seated", "renew", "finish", "retry", "lapse_retry", "lapse_fail",
    "send_when_due", "send_unclaimed_now", "end_unclaimed", "end_unrun",
)  # fmt: skip


class Claims(Part):
    """The fence's operations: claiming a delivery, renewing its lease, ending it."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = ClaimStatements(dialect, preamble)
        # Every fenced run makes a claim and an outcome (a retry's, when it failed); the
        # lease thread renews.
        self._db._run_on_driver(
            self._sql.claim,
            self._sql.claim_seated,
            self._sql.finish,
            self._sql.retry,
            self._sql.renew,
        )
        if self._sql.claim_carrying is not None:
            self._db._run_on_driver(self._sql.claim_carrying)

    @property
    def carries(self) -> bool:
        """Whether a claim here can carry another run's completion (PostgreSQL)."""
        return self._sql.claim_carrying is not None

    def claim(
        self,
        dispatch_id: str,
        job_name: str,
        attempt: int,
        lease_seconds: float,
        token: str | None = None,
        *,
        any_time: bool = False,
        concurrency: int | None = None,
        carried: CarriedEnd | None = None,
    ) -> Claim:
        """Take the execution claim for delivery `attempt` of a dispatch of `job_name`.

        Succeeds only when the row belongs to the job, is claimable, has made exactly
        `attempt - 1` claims and is due (its `run_after` has come; `any_time` skips
        that, for eager mode): a delivery of an attempt the row has moved past is
        `stale`, one of a finished dispatch `done`, one that meets a live claim `busy`,
        one for a row of another job or none at all `unknown`, one whose policy slot is
        taken `blocked`, and one before the row is due `early` (with how early).
        `token` is the delivery's fencing token (a fresh one when None); pass the same
        on every try of one delivery, so a try whose reply was lost is ours.

        `carried`, another dispatch's completion, is recorded in the same statement
        (only where the ledger `carries`, and by an unlimited claim); the answer's
        `carried` says whether it landed.
        """
        assert carried is None or (
            self.carries and carried.dispatch_id != dispatch_id and concurrency is None
        )
        token = token or str(uuid.uuid4())
        params: dict[str, Any] = {
            "dispatch_id": dispatch_id,
            "job": job_name,
            "previous": attempt - 1,
            "new_token": token,
            "lease": lease_seconds,
            "any_time": any_time,
        }
        stmt = self._sql.claim
        if concurrency is not None:
            stmt, params["limit"] = self._sql.claim_seated, concurrency
        landed: bool | None = None
        found: DispatchRow | None = None
        for look in range(2):
            began = time.monotonic()
            taken: DispatchRow | Claim | None
            if carried is not None:
                taken, landed = self._take_carrying(params, carried)
                carried = None  # recorded, or never to be by this claim: it looks alone next
            else:
                taken = self._take(stmt, params)
            if isinstance(taken, Claim):
                return dataclasses.replace(taken, carried=landed)
            if taken is not None:
                return Claim("claimed", taken, token, carried=landed)
            # Not claimed: read the row to say why (the answer may be a moment old).
            read = self._db._first(self._sql.get_and_now, {"dispatch_id": dispatch_id})
            found = DispatchRow.from_mapping(read) if read is not None else None
            why: Claim | None = None
            if read is None or found is None or found.job_name != job_name:
                why = Claim("unknown")
            elif found.claim_token == token and found.status == "active":
                why = Claim("claimed", found, token)  # our first try landed; its reply was lost
            elif found.status in TERMINAL:
                why = Claim("done", found)
            elif found.status == "active" and found.attempt == attempt:
                why = Claim("busy", found)
            elif found.status not in CLAIMABLE or found.attempt != attempt - 1:
                why = Claim("stale", found)
            else:
                due_in = (found.run_after - read["now"]).total_seconds()
                if due_in > 0 and not any_time:
                    why = Claim("early", found, due_in=due_in)
                elif look == 0 and due_in > began - time.monotonic():
                    # Due by the read, but maybe not yet by the claim a moment before it
                    # (it came due within the time the two took): a delivery a hair
                    # early, as a debounced burst's is (its countdown is the publisher's,
                    # its start the database's). Claim again, now that it is.
                    continue
                elif concurrency is not None:
                    # Due, and this very attempt's: every seat of its group is held.
                    why = Claim("blocked", found, blocked_by="concurrency")
            if why is not None:
                return dataclasses.replace(why, carried=landed)
        return Claim("stale", found, carried=landed)

    def _take_carrying(
        self, params: dict[str, Any], carried: CarriedEnd
    ) -> tuple[DispatchRow | None, bool]:
        """The claim statement carrying `carried`: the row claimed (or None) and whether
        the completion landed."""
        assert self._sql.claim_carrying is not None  # only where the ledger carries
        both = {
            **params,
            "carried_id": carried.dispatch_id,
            "token": carried.token,
            "new_status": "completed",
            "error": None,
            "carried_result": carried.result,
        }
        rows, reran = self._db._run(self._sql.claim_carrying, both)
        first = rows[0]
        taken = DispatchRow.from_mapping(first) if first["id"] is not None else None
        landed = bool(first[CARRIED_LANDED])
        if not landed and reran:
            # Run twice over a dropped connection: the first may have landed unseen.
            landed = self._landed(carried.dispatch_id, carried.token, "completed")
        return taken, landed

    def _take(self, stmt: Update, params: dict[str, Any]) -> DispatchRow | Claim | None:
        """One claim statement: the row claimed, None when nothing was, or a `blocked`
        claim when the job's policy slot is taken."""
        for _ in range(SEAT_TRIES):
            try:
                return self._db._row(stmt, params)
            except SlotTaken as taken:
                if taken.seat:
                    continue  # another run took the same seat this instant: pick again
                return Claim("blocked")
        return None

    def send_when_due(self, dispatch_id: str, job_name: str, attempt: int) -> bool:
        """Make the relay send delivery `attempt` of the row at its `run_after` at the
        latest (an early delivery of it was dropped); False when the row has moved on,
        or is due for the relay by then anyway."""
        params = {"dispatch_id": dispatch_id, "job": job_name, "previous": attempt - 1}
        return bool(self._db._execute(self._sql.send_when_due, params))

    def renew(self, dispatch_id: str, token: str, lease_seconds: float) -> bool:
        """Extend a live claim; False when the claim is no longer ours."""
        return self.renew_lease(dispatch_id, token, lease_seconds) is not None

    def renew_lease(self, dispatch_id: str, token: str, lease_seconds: float) -> Renewal | None:
        """Extend a live claim, and say whether the run was cancelled meanwhile; None
        when the claim is no longer ours."""
        params = {"dispatch_id": dispatch_id, "token": token, "lease": lease_seconds}
        rows = self._db._execute(self._sql.renew, params)
        if not rows:
            return None
        return Renewal(cancel_requested=rows[0]["cancel_requested_at"] is not None)

    def finish(
        self,
        dispatch_id: str,
        token: str,
        status: Status,
        error: str | None,
        result: dict[str, Any] | None = None,
    ) -> bool:
        """Record `completed` or `failed` (erasing a secret's key) with the run's encoded
        `result`; only the holder can. A run cancelled while it ran is recorded as
        `cancelled` instead.

        False when the claim was lost (the relay ended the lapsed lease).
        """
        params = {
            "dispatch_id": dispatch_id,
            "token": token,
            "new_status": status,
            "error": error,
            "result": result,
        }
        return self._held_write(self._sql.finish, params, dispatch_id, token, status)

    def end_unrun(self, dispatch_id: str, token: str) -> DispatchRow | None:
        """End a claimed run whose cancel came before its handler began as `cancelled`,
        its claim undone in the record; the row ended, or None when the claim was lost
        or the run was not cancelled."""
        params = {"dispatch_id": dispatch_id, "token": token}
        rows, reran = self._db._run(self._sql.end_unrun, params)
        if rows:
            return DispatchRow.from_mapping(rows[0])
        if not reran:
            return None
        # Ambiguous: our first run may have landed, and cleared the token we would know
        # it by; a cancelled row that ran nothing past its finish is ours to report.
        now = self._db.get(dispatch_id)
        return now if now is not None and now.status == "cancelled" else None

    def retry(
        self, dispatch_id: str, token: str, *, retry_in: float, relay_in: float, error: str
    ) -> bool:
        """End the claim as a failed attempt, due again in `retry_in` s.

        `relay_in` is when the relay sends the retry if no message claims it first.
        False when the claim was lost, or the run was cancelled while it ran (then
        `finish` ends it as `cancelled`).
        """
        params = {
            "dispatch_id": dispatch_id,
            "token": token,
            "retry_in": retry_in,
            "relay_in": relay_in,
            "error": error,
        }
        return self._held_write(self._sql.retry, params, dispatch_id, token, "retry")

    def _held_write(
        self, stmt: Executable, params: dict[str, Any], dispatch_id: str, token: str, to: Status
    ) -> bool:
        if self._db._execute(stmt, params):
            return True
        # Nothing matched. If a dropped connection made us run it twice, the first run
        # may have landed.
        return self._landed(dispatch_id, token, to)

    def _landed(self, dispatch_id: str, token: str, to: Status) -> bool:
        """Whether the holder's write moving the row to `to` is in the row: then it
        carries our token in the state we wrote."""
        row = self._db.get(dispatch_id)
        if row is None or row.claim_token != token:
            return False
        return row.status == to or (row.status == "cancelled" and to != "retry")

    def expired(self, limit: int = 100) -> list[DispatchRow]:
        """Active rows whose lease has lapsed: their holder died or overran."""
        rows = self._db._execute(self._sql.expired, {"limit": limit})
        return [DispatchRow.from_mapping(row) for row in rows]

    def lapse(self, row: DispatchRow, *, retry_in: float | None, relay_in: float) -> bool:
        """End a lapsed claim as a failed attempt: due again in `retry_in` s, or failed."""
        params: dict[str, Any] = {
            "dispatch_id": row.id,
            "token": row.claim_token,
            "error": LEASE_EXPIRED,
        }
        stmt = self._sql.lapse_fail
        if retry_in is not None:
            stmt = self._sql.lapse_retry
            params.update(retry_in=retry_in, relay_in=relay_in)
        count, retried = self._db._run(stmt, params)
        if count or not retried:
            return bool(count)
        now = self._db.get(row.id)  # ambiguous: did our first run land?
        return (
            now is not None
            and now.attempt == row.attempt
            and now.claim_token is None
            and now.last_error == LEASE_EXPIRED
        )

    def send_unclaimed_now(
        self, dispatch_id: str, job_name: str, attempt: int, *, horizon: float
    ) -> bool:
        """Make the row due for the relay now, if delivery `attempt` never claimed it (the
        delivery ended without a run) and its start is at most `horizon` seconds away;
        False when the row has moved on, or is not there. A row that starts later keeps
        its own next send."""
        params = {
            "dispatch_id": dispatch_id,
            "job": job_name,
            "previous": attempt - 1,
            "horizon": horizon,
        }
        count, retried = self._db._run(self._sql.send_unclaimed_now, params)
        return bool(count) or retried  # run twice: the first run may have landed; harmless

    def end_unclaimed(
        self, dispatch_id: str, job_name: str, attempt: int, error: str
    ) -> DispatchRow | None:
        """Record `failed` with `error` (erasing a secret's key) for a dispatch whose
        delivery `attempt` was called off before it claimed (a revoke); the row ended, or
        None when the row has moved on (it ran, or a later attempt is under way)."""
        params = {
            "dispatch_id": dispatch_id,
            "job": job_name,
            "previous": attempt - 1,
            "error": error,
        }
        rows, retried = self._db._run(self._sql.end_unclaimed, params)
        if rows:
            return DispatchRow.from_mapping(rows[0])
        if not retried:
            return None
        now = self._db.get(dispatch_id)  # ambiguous: did our first run land?
        landed = (
            now is not None
            and now.status == "failed"
            and now.last_error == error
            and now.attempt == attempt - 1
        )
        return now if landed else None
