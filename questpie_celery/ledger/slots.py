"""Queue policy slots: parking a delivered run whose slot is busy, and handing a freed
slot on to its oldest parked run.

The slot indexes (`schema.py`) refuse a second run in a slot; these statements decide
when a parked run may go again and make sure exactly one process sends it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, Update, and_, bindparam, select, update

from .executor import Part
from .rows import DispatchRow
from .schema import RUNNING, dispatch_table
from .statements import (
    add_preamble,
    by_id,
    db_time,
    deliverable,
    delivered,
    group_written,
    seconds,
    slot_busy,
)


class SlotStatements:
    """The slots' statements for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        in_slot = and_(t.job_name == bindparam("job"), t.slot == bindparam("slot_key"))
        # Parked, a run waits for its slot, not for the relay: unparking makes it due again.
        # `waiting_for` says which: NULL for its policy slot, or one of its job's limits.
        self.park: Update = (
            update(dispatch_table)
            .where(deliverable())
            .values(
                status="parked",
                queued_at=delivered(),
                next_send_at=None,
                waiting_for=bindparam("waiting_for"),
                **group_written(),
            )
        )
        parked_for_slot = and_(t.status == "parked", t.waiting_for.is_(None))
        self.oldest_parked: Select[Any] = (
            select(t.id).where(in_slot, parked_for_slot).order_by(t.created_at, t.id).limit(1)
        )
        self.unpark: Update = (
            update(dispatch_table)
            .where(by_id(), t.status == "parked")
            .values(status="queued", next_send_at=db_time(seconds("redeliver_in")))
            .returning(*dispatch_table.c)
        )
        self.slot_running: Select[Any] = (
            select(t.id).where(in_slot, t.status.in_(RUNNING), t.policy.is_not(None)).limit(1)
        )
        self.free_parked_slots: Select[Any] = _free_parked_slots()
        add_preamble(self, preamble, ("park", "unpark"))


def _free_parked_slots() -> Select[Any]:
    """(job, slot) pairs holding parked runs while nothing runs in the slot."""
    t = dispatch_table.c
    return (
        select(t.job_name, t.slot)
        .where(
            t.status == "parked",
            t.waiting_for.is_(None),
            t.slot.is_not(None),
            ~slot_busy(t.job_name, t.slot),
        )
        .distinct()
        .limit(bindparam("limit"))
    )


class Slots(Part):
    """Parking runs and handing slots on."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = SlotStatements(dialect, preamble)

    def park(
        self, dispatch_id: str, job_name: str, attempt: int, waiting_for: str | None = None
    ) -> bool:
        """Set a delivered run aside until its slot frees (or, `waiting_for`
        "concurrency", a seat of its group); not an attempt."""
        params = {
            "dispatch_id": dispatch_id,
            "job": job_name,
            "previous": attempt - 1,
            "waiting_for": waiting_for,
        }
        count, retried = self._db._run(self._sql.park, params)
        if count or not retried:
            return bool(count)
        now = self._db.get(dispatch_id)  # ambiguous: parking twice is harmless, missing it is not
        return now is not None and now.status == "parked" and now.attempt == attempt - 1

    def slot_running(self, job_name: str, slot: str) -> bool:
        """Whether a run holds the slot's running place (active, or awaiting its retry)."""
        return (
            self._db._first(self._sql.slot_running, {"job": job_name, "slot_key": slot}) is not None
        )

    def unpark_next(self, job_name: str, slot: str, redeliver_in: float) -> DispatchRow | None:
        """Move the oldest parked run of a slot back to `queued`; the caller sends it.

        A conditional update, so of several processes handing the same slot on, one
        wins each parked row and exactly one message is sent for it.
        """
        for _ in range(5):
            oldest = self._db._first(self._sql.oldest_parked, {"job": job_name, "slot_key": slot})
            if oldest is None:
                return None
            params = {"dispatch_id": oldest["id"], "redeliver_in": redeliver_in}
            rows, retried = self._db._run(self._sql.unpark, params)
            if rows:
                return DispatchRow.from_mapping(rows[0])
            if retried:
                # Ours or another's: a second send is harmless, no send at all is not.
                now = self._db.get(oldest["id"])
                if now is not None and now.status == "queued":
                    return now
        return None

    def free_parked_slots(self, limit: int = 100) -> list[tuple[str, str]]:
        """(job, slot) pairs holding parked runs while nothing runs in the slot."""
        rows = self._db._execute(self._sql.free_parked_slots, {"limit": limit})
        return [(row["job_name"], row["slot"]) for row in rows]
