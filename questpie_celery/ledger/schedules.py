"""Schedules in the ledger: writing them, the due ones for the beat, moving a fired one
on, and the one claim per tick of a `beat_schedule` entry (see `publish/schedules.py` and
`beat.py` above, which decide what fires)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    Update,
    bindparam,
    delete,
    func,
    select,
    tuple_,
    update,
)

from .executor import Part
from .rows import ScheduleRow
from .schema import Status, UTCDateTime, beat_tick_table, dispatch_table, schedule_table
from .statements import add_preamble, db_time, insert_or_nothing, upsert


class ScheduleStatements:
    """The schedules' statements for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        now = db_time()
        sc = schedule_table.c
        # `skip`: the (job, source) pairs this beat cannot fire just now; another beat may.
        self.due_schedules: Select[Any] = (
            select(schedule_table, now.label("now"))
            .where(
                sc.next_fire_at <= now,
                tuple_(sc.job_name, sc.source).not_in(bindparam("skip", expanding=True)),
            )
            .order_by(sc.next_fire_at)
            .limit(bindparam("limit"))
        )
        self.next_schedule_due: Select[Any] = select(func.min(sc.next_fire_at).label("at")).where(
            tuple_(sc.job_name, sc.source).not_in(bindparam("skip", expanding=True))
        )
        # Moving a schedule on is conditional on the tick we read: of several beats that
        # fired the same tick (one dispatch, thanks to its key), one moves it on.
        self.advance_schedule: Update = (
            update(schedule_table)
            .where(
                sc.job_name == bindparam("job"),
                sc.source == bindparam("from_source"),
                sc.next_fire_at == bindparam("seen_next", type_=UTCDateTime),
            )
            .values(
                next_fire_at=bindparam("next_fire_at", type_=UTCDateTime),
                last_fire_at=bindparam("seen_next", type_=UTCDateTime),
                last_dispatch_id=bindparam("dispatch_id"),
            )
        )
        # RETURNING says who won: an INSERT's row count is not reported on every driver.
        self.claim_beat_tick: Insert = (
            insert_or_nothing(dialect, beat_tick_table)
            .values(
                entry=bindparam("entry"),
                tick=bindparam("tick"),
                claimer=bindparam("claimer"),
                claimed_at=now,
            )
            .returning(beat_tick_table.c.entry)
        )
        self.beat_tick_claimer: Select[Any] = select(beat_tick_table.c.claimer).where(
            beat_tick_table.c.entry == bindparam("entry"),
            beat_tick_table.c.tick == bindparam("tick"),
        )
        add_preamble(self, preamble, ("advance_schedule",))


# Built per call: rare, and their filters vary.


def list_schedules() -> Select[Any]:
    """Every schedule, with the status of the dispatch its last fire made."""
    sc, t = schedule_table.c, dispatch_table.c
    return (
        select(schedule_table, t.status.label("last_status"))
        .select_from(schedule_table.outerjoin(dispatch_table, t.id == sc.last_dispatch_id))
        .order_by(sc.job_name, sc.source)
    )


def delete_schedules_of(job_name: str, source: str | None) -> Any:
    sc = schedule_table.c
    stmt = delete(schedule_table).where(sc.job_name == job_name)
    return stmt if source is None else stmt.where(sc.source == source)


class Schedules(Part):
    """The schedules' operations."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = ScheduleStatements(dialect, preamble)

    def put(self, row: ScheduleRow) -> None:
        """Create or replace the job's schedule from `row.source`."""
        values = {
            "job_name": row.job_name,
            "source": row.source,
            "cron": row.cron,
            "tz": row.tz,
            "payload": row.payload,
            "singleton_key": row.singleton_key,
            "group_key": row.group_key,
            "options": row.options,
            "next_fire_at": row.next_fire_at,
            "last_fire_at": None,
            "last_dispatch_id": None,
            "updated_at": db_time(),
        }
        self._db._execute(
            upsert(self._db.dialect, schedule_table, ["job_name", "source"], values), {}
        )

    def delete(self, job_name: str, source: str | None = None) -> int:
        """Remove the job's schedules (from one source, or all); returns how many."""
        return int(self._db._execute(delete_schedules_of(job_name, source), {}))

    def due(
        self, limit: int = 500, skip: Sequence[tuple[str, str]] = ()
    ) -> tuple[datetime | None, list[ScheduleRow]]:
        """(the database's now, schedules whose next tick has come), oldest tick first,
        leaving out the (job, source) pairs in `skip`."""
        rows = self._db._execute(self._sql.due_schedules, {"limit": limit, "skip": list(skip)})
        now = rows[0]["now"] if rows else None
        return now, [ScheduleRow.from_mapping(row) for row in rows]

    def next_due(self, skip: Sequence[tuple[str, str]] = ()) -> datetime | None:
        row = self._db._first(self._sql.next_schedule_due, {"skip": list(skip)})
        return row["at"] if row is not None else None

    def advance(self, row: ScheduleRow, next_fire_at: datetime, dispatch_id: str | None) -> bool:
        """Record that `row`'s tick fired and move it to `next_fire_at`; False when another
        beat did so first (or the schedule changed meanwhile)."""
        params = {
            "job": row.job_name,
            "from_source": row.source,
            "seen_next": row.next_fire_at,
            "next_fire_at": next_fire_at,
            "dispatch_id": dispatch_id,
        }
        count, retried = self._db._run(self._sql.advance_schedule, params)
        return bool(count) or retried

    def listed(self) -> list[tuple[ScheduleRow, Status | None]]:
        """Every schedule, with the status of the dispatch its last fire made."""
        return [
            (ScheduleRow.from_mapping(row), row["last_status"])
            for row in self._db._execute(list_schedules(), {})
        ]

    def claim_beat_tick(self, entry: str, tick: str) -> bool:
        """Take the tick of a `beat_schedule` entry; True for exactly one claimer."""
        claimer = str(uuid.uuid4())
        params = {"entry": entry, "tick": tick, "claimer": claimer}
        rows, retried = self._db._run(self._sql.claim_beat_tick, params)
        if rows or not retried:
            return bool(rows)
        # The connection dropped and the insert ran again: was the first try ours?
        found = self._db._first(self._sql.beat_tick_claimer, {"entry": entry, "tick": tick})
        return found is not None and found["claimer"] == claimer
