"""A throttled publish's statements: its row inserted and its window taken, in one
transaction, or neither.

A window is the row of `questpie_throttle` for a job and key (the publish's singleton
key, or "" for the job as a whole): the dispatch it last accepted, and when it opens
again. The publish inserts its dispatch row as any publish does (a known idempotency
key, or a taken queue policy slot, inserts nothing and takes no window), then takes the
window with a conditional upsert that only an open window lets through; a closed one
rolls the insert back. Of concurrent publishers one takes the window: the upsert waits
on the row another uncommitted one wrote, then finds it closed.
"""

from __future__ import annotations

from typing import Literal

from sqlalchemy import ColumnElement, Connection, Delete, Insert, bindparam, delete, select
from sqlalchemy.dialects import postgresql, sqlite

from .dispatches import Dispatches
from .executor import Executor, Part
from .inserts import row_params
from .rows import NewDispatch
from .schema import throttle_table
from .statements import db_time, seconds

#: What a throttled publish's statements settled: its row inserted and the window taken,
#: nothing written because its row was not inserted (a known key, a policy slot), or
#: nothing written because the window was closed.
Throttled = Literal["accepted", "not inserted", "closed"]


class _Closed(Exception):
    """The window was closed: the transaction rolls back."""


class ThrottleStatements:
    def __init__(self, dialect: str) -> None:
        w = throttle_table.c
        take = (
            (postgresql if dialect == "postgresql" else sqlite)
            .insert(throttle_table)
            .values(
                job_name=bindparam("job_name"),
                throttle_key=bindparam("throttle_key"),
                dispatch_id=bindparam("dispatch_id"),
                open_at=db_time(seconds("window")),
            )
        )
        self.take: Insert = take.on_conflict_do_update(
            index_elements=["job_name", "throttle_key"],
            set_={"dispatch_id": take.excluded.dispatch_id, "open_at": take.excluded.open_at},
            where=w.open_at <= db_time(),
        ).returning(w.dispatch_id)
        self.taken_by = select(w.dispatch_id).where(
            w.job_name == bindparam("job_name"), w.throttle_key == bindparam("throttle_key")
        )
        self.prune: Delete = delete(throttle_table).where(
            w.open_at < db_time(-seconds("older_than"))
        )


class Throttle(Part):
    """Throttled publishing (the row inserted as `dispatches` inserts any row), and the
    pruning of long-open windows."""

    def __init__(self, db: Executor, dispatches: Dispatches) -> None:
        self._dispatches = dispatches
        super().__init__(db)

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = ThrottleStatements(dialect)

    def insert(self, new: NewDispatch, *, key: str, window: float) -> Throttled:
        """Insert `new`'s row and take the window of its job and `key` for `window`
        seconds, in one transaction of its own; or write nothing."""
        params = row_params(new)
        take = {"job_name": new.job_name, "throttle_key": key, "dispatch_id": new.id}

        def both(conn: Connection) -> bool:
            if conn.execute(self._dispatches.statements.insert, params).first() is None:
                return False
            if conn.execute(self._sql.take, {**take, "window": window}).first() is None:
                raise _Closed
            return True

        try:
            inserted, reran = self._db._run_transaction(
                both, durable=new.secret_ciphertext is not None
            )
        except _Closed:
            return "closed"
        if inserted:
            return "accepted"
        if reran:
            # The first try may have committed unseen: then the window names our row.
            rows = self._db._execute(self._sql.taken_by, take)
            if rows and rows[0]["dispatch_id"] == new.id:
                return "accepted"
        return "not inserted"

    def prune_windows(self, *, older_than: float) -> int:
        """Delete the windows that opened again over `older_than` seconds ago: an open
        window and no window take a publish alike."""
        return int(self._db._execute(self._sql.prune, {"older_than": older_than}))
