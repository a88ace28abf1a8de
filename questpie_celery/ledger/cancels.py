"""Cancelling a dispatch: a write every worker sees, because every delivery claims.

A row that has not started (pending, queued, parked, awaiting its retry) is ended as
`cancelled` with a conditional update bound to the status and attempt it was read in:
the terminal write that erases a secret's key, frees its policy slot (a slot index
counts only waiting and running rows) and its seat. Any delivery that comes later, on
any worker, finds the row ended and runs nothing. A row found `active` is only marked
(`cancel_requested_at`): the run goes on, its lease renewals carry the news to its
handler, and whatever end it reaches is written as `cancelled` (see `claims.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, Select, Update, and_, bindparam, func, select, update

from ..errors import LedgerBusyError
from ..jobs.ids import unstorable_id
from .executor import Part
from .rows import DispatchRow
from .schema import CANCELLABLE, TERMINAL, dispatch_table
from .statements import add_preamble, by_id, cancelled_values, db_time

#: How often one cancel reads the row again after it moved between the read and the write.
CANCEL_TRIES = 10

CancelOutcome = Literal["cancelled", "requested", "ended", "unknown"]


@dataclass(frozen=True)
class Cancelled:
    """What a cancel did: `cancelled` (ended before it started; `was` the status it
    left), `requested` (found running: marked), `ended` (it had ended already: nothing
    changed), `unknown` (no such row)."""

    outcome: CancelOutcome
    row: DispatchRow | None = None
    was: str | None = None


class CancelStatements:
    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        seen = and_(by_id(), t.status == bindparam("seen"), t.attempt == bindparam("seen_attempt"))
        self.get: Select[Any] = select(dispatch_table).where(by_id())
        self.cancel: Update = (
            update(dispatch_table)
            .where(seen, t.status.in_(CANCELLABLE))
            .values(**cancelled_values())
            .returning(*dispatch_table.c)
        )
        self.request: Update = (
            update(dispatch_table)
            .where(seen, t.status == "active")
            .values(cancel_requested_at=func.coalesce(t.cancel_requested_at, db_time()))
            .returning(*dispatch_table.c)
        )
        add_preamble(self, preamble, ("cancel", "request"))


class Cancels(Part):
    """Cancelling dispatches."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = CancelStatements(dialect, preamble)

    def cancel(self, dispatch_id: str) -> Cancelled:
        """End the dispatch as `cancelled` if it has not started, mark it if it runs.
        `unknown` for an id no row can have (`ids.unstorable_id`), as for one no row has."""
        if unstorable_id(dispatch_id) is not None:
            return Cancelled("unknown")
        for _ in range(CANCEL_TRIES):
            found = self._db._row(self._sql.get, {"dispatch_id": dispatch_id})
            if found is None:
                return Cancelled("unknown")
            if found.status in TERMINAL:
                return Cancelled("ended", found)
            params = {
                "dispatch_id": dispatch_id,
                "seen": found.status,
                "seen_attempt": found.attempt,
            }
            if found.status == "active":
                stmt, outcome = self._sql.request, "requested"
            else:
                stmt, outcome = self._sql.cancel, "cancelled"
            # On disk before it returns, even on a relaxed ledger: True is a promise.
            rows, reran = self._db._run(stmt, params, durable=True)
            if rows:
                row = DispatchRow.from_mapping(rows[0])
                return Cancelled(outcome, row, was=found.status)  # type: ignore[arg-type]
            if reran:
                # Our first try may have landed unseen: then the row shows what it wrote.
                now = self._db._row(self._sql.get, {"dispatch_id": dispatch_id})
                if now is not None and now.attempt == found.attempt:
                    if outcome == "cancelled" and now.status == "cancelled":
                        return Cancelled("cancelled", now, was=found.status)
                    if outcome == "requested" and now.cancel_requested_at is not None:
                        return Cancelled("requested", now, was=found.status)
            # The row moved between the read and the write (claimed, ended, parked): again.
        raise LedgerBusyError(f"dispatch {dispatch_id} kept moving while it was cancelled")
