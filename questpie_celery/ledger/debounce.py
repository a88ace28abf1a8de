"""A debounced publish's statements: the open burst of a job and key pushed back (latest
payload, later start), or, with none, a new burst's row inserted.

A burst is the one waiting row (`pending`, `queued` or `parked`) whose `debounce_key` is
the publish's key (its singleton key, or "" for the job as a whole); the unique index
`questpie_debounce_burst` keeps it one per job and key, and the claim clears the column,
so a run that started has left its burst. Concurrent publishers race inside the
database: the update takes the burst row's lock, and of two inserts the index lets one
through; the other then updates the row that won.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Insert, Update, bindparam, case, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

from ..errors import LedgerError
from .dispatches import Dispatches
from .errors import translate_errors
from .executor import Executor, Part
from .inserts import row_params
from .rows import NewDispatch
from .schema import WAITING, UTCDateTime, dispatch_table
from .statements import add_preamble, larger, seconds, smaller, statement_time

#: Rounds of update-then-insert before a publish that met neither a burst nor room for
#: one counts as refused by its queue policy's slot (each lost round means a burst was
#: claimed or inserted by another publisher in between).
ROUNDS = 3


class time_after(FunctionElement[Any]):
    """A time column plus a number of seconds (a bind parameter)."""

    type = UTCDateTime()
    inherit_cache = True


@compiles(time_after, "postgresql")
def _pg_after(element: time_after, compiler: SQLCompiler, **kw: Any) -> str:
    column, offset = (compiler.process(arg, **kw) for arg in element.clauses)
    return f"({column} + make_interval(secs => {offset}))"


@compiles(time_after, "sqlite")
def _sqlite_after(element: time_after, compiler: SQLCompiler, **kw: Any) -> str:
    # The layout `db_time` writes, so the result compares with it as text.
    column, offset = (compiler.process(arg, **kw) for arg in element.clauses)
    return f"strftime('%Y-%m-%d %H:%M:%f000', {column}, printf('%+.6f seconds', {offset}))"


class DebounceStatements:
    def __init__(self, insert: Insert, preamble: ColumnElement[bool] | None) -> None:
        t = dispatch_table.c
        # The earlier of the quiet period from now and the burst's longest start, measured
        # from its first publish (the row's creation). "Now" is the publish's statement:
        # in a caller's transaction open for a while, its start would be long past.
        start = smaller(
            statement_time(seconds("debounce")), time_after(t.created_at, seconds("most"))
        )
        self.push_back: Update = (
            update(dispatch_table)
            .where(
                t.job_name == bindparam("job"),
                t.debounce_key == bindparam("burst"),
                t.status.in_(WAITING),
            )
            .values(
                payload=bindparam("latest", type_=t.payload.type),
                run_after=start,
                # The relay's next send stays where it was unless the new start is
                # later: a message on its way arrives early, and the fence then makes the
                # row due for the relay at its start (`send_when_due`). Never earlier: a
                # stream of publishes past the burst's longest start would otherwise undo
                # the relay's backoff and send it again at every pass while no worker is
                # free, until the relay gave up on it. A parked run waits for its slot,
                # and keeps the relay's time of its own.
                next_send_at=case(
                    (t.status == "parked", t.next_send_at),
                    else_=larger(t.next_send_at, start),
                ),
            )
            .returning(t.id)
        )
        # The row of a new burst: a publish's insert, with its burst and its start by
        # the database's clock.
        values: dict[str, Any] = {
            "debounce_key": bindparam("debounce_key"),
            "run_after": statement_time(seconds("debounce")),
        }
        if preamble is None:
            # The burst's first publish, from which its longest start counts. (With a
            # pooled ledger's preamble, the column carries it; its own statements run in
            # autocommit, where the two times are one.)
            values["created_at"] = statement_time()
        self.insert: Insert = insert.values(**values)
        add_preamble(self, preamble, ("push_back",))


class Debounce(Part):
    """Debounced publishing: a burst's row inserted as `dispatches` inserts any row."""

    def __init__(self, db: Executor, dispatches: Dispatches) -> None:
        self._dispatches = dispatches  # before attaching: `_prepare` builds on its insert
        super().__init__(db)

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = DebounceStatements(self._dispatches.statements.insert, preamble)
        self._in_caller = (
            DebounceStatements(self._dispatches.caller_statements.insert, None)
            if preamble is not None
            else self._sql
        )

    def join(
        self,
        new: NewDispatch,
        *,
        key: str,
        debounce: float,
        most: float,
        conn: Connection | None = None,
    ) -> tuple[str | None, bool]:
        """Join the open burst of `new`'s job and `key` (its payload replaced by `new`'s,
        its start pushed to `debounce` seconds from now, never past `most` seconds after
        the burst's first publish), or start one with `new`'s row. Returns the burst's id
        and whether `new` was inserted (then its message is to be sent); (None, False)
        when no burst was open and `new`'s queue policy slot refused it.

        With `conn`, in the caller's transaction."""
        sql = self._sql if conn is None else self._in_caller
        push = {
            "job": new.job_name,
            "burst": key,
            "latest": new.payload,
            "debounce": debounce,
            "most": most,
        }
        row = {**row_params(new), "debounce_key": key, "debounce": debounce}
        if new.next_send_at is None:
            # The relay's first look comes after the start, not inside the quiet period.
            row["send_in"] = new.send_in + debounce
        for _ in range(ROUNDS):
            pushed = self._push_back(sql.push_back, push, conn)
            if pushed:
                return str(pushed[0]["id"]), False
            if self._insert(sql.insert, row, new.id, conn):
                return new.id, True
        if new.slot is None:
            raise LedgerError(
                f"debounced publish of job {new.job_name!r} met neither its burst nor room "
                f"for one in {ROUNDS} rounds"
            )
        return None, False

    def _push_back(self, stmt: Any, params: Any, conn: Connection | None) -> Any:
        # Pushing back twice (a rerun on a fresh connection) lands as once would.
        if conn is None:
            return self._db._run(stmt, params)[0]
        with translate_errors(self._db.migrate_command):
            return conn.execute(stmt, params).mappings().all()

    def _insert(self, stmt: Any, params: Any, dispatch_id: str, conn: Connection | None) -> bool:
        if conn is not None:
            with translate_errors(self._db.migrate_command):
                return conn.execute(stmt, params).first() is not None
        rows, reran = self._db._run(stmt, params)
        if rows:
            return True
        # A rerun that conflicts may have met our own first try: under a random id, a
        # row found is ours (inserts.insert's rule).
        return reran and self._dispatches.exists(dispatch_id)
