"""The relay's operations and their statements: taking what is due to send, in batches,
with its backoff; giving back what it did not send; sending again soon after a refused
send; giving up; waking the relays; and the backlog samples the status page plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Insert,
    Select,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    insert,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import TextClause

from .errors import translate_errors
from .executor import Part
from .rows import DispatchRow
from .schema import RELAY_GAVE_UP, RESENDABLE, backlog_table, dispatch_table
from .statements import (
    RELAY_WAKE_CHANNEL,
    add_preamble,
    by_id,
    db_time,
    larger,
    seconds,
    smaller,
    terminal_values,
)
from .wakeups import SendWakeups

#: The most due rows one backlog sample counts; past it the plot shows the cap.
BACKLOG_CAP = 100_000


class RelayStatements:
    """The relay's statements for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        now = db_time()
        terminal = terminal_values()
        due = and_(t.status.in_(RESENDABLE), t.next_send_at <= now)
        max_sends: Any = bindparam("max_sends")
        # Rows the relay ran out of sends for: recorded failed, one by one (rare).
        self.due_out_of_sends: Select[Any] = (
            select(dispatch_table)
            .where(due, t.send_count >= max_sends)
            .order_by(t.next_send_at)
            .limit(bindparam("limit"))
        )
        # The relay takes due rows a batch per statement: each row's send counted and its
        # next send pushed out by the relay's backoff, so it is not due again meanwhile.
        # SKIP LOCKED lets several relays take disjoint batches at once on PostgreSQL; a row
        # another relay just took fails `due` when re-checked under its lock. SQLite has no
        # row locks and needs none: one statement holds the database's write lock, so two
        # relays' takes run one after the other and the second sees the first's backoff.
        batch = (
            select(t.id)
            .where(due, t.send_count < max_sends)
            .order_by(t.next_send_at)
            .limit(bindparam("limit"))
            .with_for_update(skip_locked=True)
        )
        self.take_due: Update = (
            update(dispatch_table)
            .where(t.id.in_(batch.scalar_subquery()))
            .values(send_count=t.send_count + 1, next_send_at=db_time(relay_backoff()))
            .returning(*dispatch_table.c)
        )
        # The relay's backlog: what is due for it to send. Counted through a capped
        # subquery, so a huge backlog costs a bounded index scan, not a count of it all.
        due_rows = (
            select(literal(1))
            .where(t.status.in_(RESENDABLE), t.next_send_at <= now)
            .limit(BACKLOG_CAP)
            .subquery()
        )
        b = backlog_table.c
        # One sample per `gap` seconds however many relays run: each inserts only when no
        # recent sample exists (two racing relays may both insert; the plot shrugs).
        self.sample_backlog: Insert = insert(backlog_table).from_select(
            ["sampled_at", "backlog"],
            select(now, select(func.count()).select_from(due_rows).scalar_subquery()).where(
                # A sample "from the future" (the clock stepped back) must not stop sampling.
                ~exists().where(b.sampled_at > db_time(seconds("gap")), b.sampled_at <= now)
            ),
        )
        self.prune_backlog = delete(backlog_table).where(b.sampled_at < db_time(seconds("keep")))
        self.backlog_since: Select[Any] = (
            select(b.sampled_at, b.backlog)
            .where(b.sampled_at >= db_time(seconds("since")))
            .order_by(b.sampled_at)
        )

        # Giving up is conditional on the exact next_send_at we read, so of several relays
        # exactly one records it.
        seen = and_(
            by_id(), t.status == bindparam("seen_status"), t.next_send_at == bindparam("seen_next")
        )
        # A taken row the relay did not send (the broker refused an earlier one of its
        # batch): its send uncounted, due again soon. Conditional on the take as it left the
        # row, so a row another relay has taken since keeps that relay's count.
        self.give_back: Update = (
            update(dispatch_table)
            .where(seen, t.send_count == bindparam("seen_count"))
            .values(send_count=t.send_count - 1, next_send_at=db_time(seconds("send_in")))
        )
        self.give_up: Update = (
            update(dispatch_table)
            .where(seen)
            .values(status="failed", claim_token=None, **{**terminal, "last_error": RELAY_GAVE_UP})
        )
        # After a send the broker refused: let the relay try again soon, not at the far-off
        # safety-net time the row was given in the hope that the send would succeed.
        self.send_soon: Update = (
            update(dispatch_table)
            .where(
                t.id.in_(bindparam("dispatch_ids", expanding=True)),
                t.status.in_(RESENDABLE),
                t.attempt == bindparam("seen_attempt"),
            )
            .values(next_send_at=db_time(seconds("send_in")))
        )

        # Wakes every listening relay once the caller's transaction commits (PostgreSQL
        # delivers notifications at commit, and drops them on rollback); SQLite has none.
        self.wake_relays: TextClause | None = (
            text(f"NOTIFY {RELAY_WAKE_CHANNEL}") if dialect == "postgresql" else None
        )
        add_preamble(self, preamble, ("take_due", "give_back", "give_up", "send_soon"))


def relay_backoff() -> ColumnElement[Any]:
    """Seconds until the relay may send a row again after this send, per row: doubling
    from `first_backoff` with each earlier send of the attempt, capped at `max_backoff`,
    and never below `accepted_backoff` for a row the broker accepted once (it may just be
    waiting in a busy queue). The outbox chooses the numbers.

    A shift, not power(): SQLite lacks power() unless built with its math functions. The
    shift is safe because only rows with fewer than `max_sends` sends are taken.
    """
    t = dispatch_table.c
    doubling = cast(literal(1), BigInteger).op("<<", return_type=BigInteger)(t.send_count)
    backoff = cast(seconds("first_backoff") * doubling, Float)
    capped = smaller(backoff, seconds("max_backoff"))
    floored = larger(capped, seconds("accepted_backoff"))
    return case((t.status == "pending", capped), else_=floored)


class Relay(Part):
    """The relay's sends, resends and backlog."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = RelayStatements(dialect, preamble)

    def take_due(
        self,
        limit: int,
        *,
        max_sends: int,
        first_backoff: float,
        max_backoff: float,
        accepted_backoff: float,
    ) -> list[DispatchRow]:
        """Take up to `limit` rows due for a relay send, oldest due first, in one statement:
        each send counted and the row's next send pushed out by the relay's backoff (see
        `relay_backoff`). Rows with `max_sends` sends are left for `give_up`.

        No two relays take the same row. If the connection drops and the statement runs
        again, a first run that landed unseen took rows nobody sends now: they are due
        again when their backoff ends, so they are late, never lost.
        """
        params = {
            "limit": limit,
            "max_sends": max_sends,
            "first_backoff": first_backoff,
            "max_backoff": max_backoff,
            "accepted_backoff": accepted_backoff,
        }
        return [
            DispatchRow.from_mapping(row) for row in self._db._execute(self._sql.take_due, params)
        ]

    def give_back(self, rows: Sequence[DispatchRow], send_in: float) -> None:
        """Taken rows the relay did not send: their sends uncounted, due in `send_in` s.

        A row another relay took since keeps that relay's take.
        """
        if rows:
            params = [
                {
                    "dispatch_id": row.id,
                    "seen_status": row.status,
                    "seen_next": row.next_send_at,
                    "seen_count": row.send_count,
                    "send_in": send_in,
                }
                for row in rows
            ]
            self._db._execute(self._sql.give_back, params)

    def due_out_of_sends(self, max_sends: int, limit: int = 100) -> list[DispatchRow]:
        """Rows due for a relay send that already had `max_sends` sends this attempt."""
        rows = self._db._execute(
            self._sql.due_out_of_sends, {"max_sends": max_sends, "limit": limit}
        )
        return [DispatchRow.from_mapping(row) for row in rows]

    def wake_relays(self, conn: Connection) -> None:
        """In the caller's transaction: wake the listening relays once it commits
        (PostgreSQL only; on SQLite the relays find the row on their next poll)."""
        if self._sql.wake_relays is not None:
            with translate_errors(self._db.migrate_command):
                conn.execute(self._sql.wake_relays)

    def send_wakeups(self) -> SendWakeups | None:
        """A listener for `wake_relays`, or None where the ledger cannot listen (SQLite,
        a driver other than psycopg 3.2 or later, or a pooled ledger: a pooler in
        transaction mode would leave the LISTEN on a server connection other clients
        use, and deliver nothing to ours)."""
        if self._db.pooled:
            return None
        if self._db._borrowed is not None:
            listener = self._db._borrowed.listener()
            return SendWakeups.for_engine(listener) if listener is not None else None
        return SendWakeups.for_engine(self._db.engine)

    def give_up(self, row: DispatchRow) -> bool:
        """Record `failed` (erasing a secret's key) after the relay ran out of sends."""
        params = {"dispatch_id": row.id, "seen_status": row.status, "seen_next": row.next_send_at}
        count, retried = self._db._run(self._sql.give_up, params)
        if count or not retried:
            return bool(count)
        now = self._db.get(row.id)  # ambiguous: did our first run land?
        return now is not None and now.status == "failed" and now.last_error == RELAY_GAVE_UP

    def send_soon(self, dispatch_ids: Sequence[str], attempt: int, send_in: float) -> None:
        """After refused sends: let the relay send attempt `attempt + 1` of these
        dispatches in `send_in` s."""
        if dispatch_ids:
            params = {
                "dispatch_ids": list(dispatch_ids),
                "seen_attempt": attempt,
                "send_in": send_in,
            }
            self._db._execute(self._sql.send_soon, params)

    def sample_backlog(self, *, every: float, keep: float) -> None:
        """Record how many dispatches are due for the relay, unless a sample younger than
        `every` seconds exists; drop samples older than `keep` seconds."""
        self._db._execute(self._sql.sample_backlog, {"gap": -every})
        self._db._execute(self._sql.prune_backlog, {"keep": -keep})

    def backlog_history(self, seconds: float) -> list[tuple[datetime, int]]:
        """(sampled_at, backlog) of the last `seconds`, oldest first."""
        rows = self._db._execute(self._sql.backlog_since, {"since": -seconds})
        return [(r["sampled_at"], int(r["backlog"])) for r in rows]
