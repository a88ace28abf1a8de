"""The hottest statements on the driver's own cursor.

A fenced run makes two statements (its claim and its outcome) and a keyed publish one
(its insert). On a busy worker, SQLAlchemy's execution of each (an execution context,
parameter processing, describing the cursor, the result's metadata) cost the process
more CPU than the statement's round trip. These statements are compiled once by
SQLAlchemy and run on the pooled connection's psycopg cursor, with the same SQL text,
the same parameters (through the same type processors) and the same result types.

What goes wrong is left to SQLAlchemy. A connection found dead (or a prepared plan a
migration made stale) sends the statement through SQLAlchemy's execution on the same
connection, which finds it as it finds it for every statement: the pool invalidated,
the statement run again on a fresh connection (`Reruns`), whose first run may have
landed. Any other error of the database (a slot index, a lock timeout, a deadlock) is
raised as SQLAlchemy raises it, once: nothing is run twice. Parameters that do not
convert are left to SQLAlchemy's execution before anything was sent.

Only the ledger's own PostgreSQL engines take the short cut (an engine passed in may
carry execution options, such as a schema map, that a statement compiled once would
not know), and none does while SQLAlchemy logs its statements (`echo`) or anything
listens to the engine's execution, cursor or error events (tracing instrumentation
does; a `handle_error` listener may count more errors as disconnects): they see every
statement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, Engine, Select, exc
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from .errors import is_stale_plan

_Processor = Callable[[Any], Any] | None
_STATEMENT_LOG = logging.getLogger("sqlalchemy.engine.Engine")
#: Where a connection keeps its cursor for these statements (`PoolProxiedConnection.info`).
_CURSOR = "questpie_driver_cursor"
#: The engine's events a statement run through SQLAlchemy would fire.
_EXECUTION = (
    "before_execute",
    "after_execute",
    "before_cursor_execute",
    "after_cursor_execute",
    "begin",
    "commit",
    "rollback",
)


class LeftToSQLAlchemy(Exception):  # a signal inside the ledger, never raised out of it
    """The statement was not run here, or met a connection SQLAlchemy must look at: run
    it through SQLAlchemy's execution on the same connection."""


class DriverStatement:
    """One statement compiled for `engine`'s dialect, run on the driver's cursor."""

    def __init__(self, stmt: ClauseElement, engine: Engine) -> None:
        dialect = engine.dialect
        self._engine = engine
        self._dialect = dialect
        #: What the driver raises for a failed statement or a broken connection.
        self.driver_error: type[Exception] = dialect.loaded_dbapi.Error
        compiled = stmt.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)  # a DML or SELECT statement compiles to SQL
        self._compiled = compiled
        self.sql = compiled.string
        # Keyed as `construct_params` keys its values: by escaped name, each name once.
        escaped: Mapping[str, str] = compiled.escaped_bind_names or {}
        processors: dict[str, Callable[[Any], Any]] = {}
        for bind, name in compiled.bind_names.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                processors.setdefault(escaped.get(name, name), process)
        self._binds = list(processors.items())
        columns: list[tuple[str, Any]]
        if isinstance(stmt, Select):
            columns = [(column.name, column.type) for column in stmt.selected_columns]
        else:
            returning = getattr(stmt, "returning_column_descriptions", None) or []
            columns = [(column["name"], column["type"]) for column in returning]
        self._names = [name for name, _ in columns]
        self._results: list[_Processor] = [
            kind.dialect_impl(dialect).result_processor(dialect, None) for _, kind in columns
        ]

    def observed(self) -> bool:
        """Whether anything outside the ledger watches the engine's statements: SQLAlchemy's
        statement log, or a listener of their execution, their errors or their (auto-)
        transactions. Then the statement goes through SQLAlchemy, for them to see."""
        engine = self._engine
        return bool(
            engine.echo
            or _STATEMENT_LOG.isEnabledFor(logging.INFO)
            # SQLAlchemy sets `_has_events` on the engine (or its class) with the first
            # listener of any of its connection events, and checks it before firing one;
            # every statement asks this, so the listeners are looked at only then (one
            # may have been removed since).
            or (engine._has_events and any(getattr(engine.dispatch, n) for n in _EXECUTION))
            or (
                self._dialect._has_events
                and any(
                    not getattr(listener, "questpie_ledger_own", False)
                    for listener in self._dialect.dispatch.handle_error
                )
            )
        )

    def run(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Its rows as mappings (for a statement with columns) or its row count. Raises
        `LeftToSQLAlchemy` for SQLAlchemy's execution to take over, or the database's
        error as SQLAlchemy raises it (`DBAPIError` and its kinds)."""
        try:
            values = dict(self._compiled.construct_params(dict(params)) or {})
            for name, process in self._binds:
                values[name] = process(values[name])
        except Exception:
            raise LeftToSQLAlchemy() from None  # nothing sent: SQLAlchemy says what is wrong
        pooled = conn.connection
        # psycopg's own connection (what `driver_connection` names too, unless the
        # connection was detached from the pool: see hot.py).
        driver: Any = pooled.dbapi_connection
        assert driver is not None  # a checked-out connection always has one
        # One cursor per connection, made once: making one per statement cost a tenth of
        # the statement's CPU. Put back only after a statement that went through (the
        # pool clears `info` when it replaces the connection).
        cursor = pooled.info.pop(_CURSOR, None) or driver.cursor()
        try:
            cursor.execute(self.sql, values)
            rows = cursor.fetchall() if self._names else None
            count = cursor.rowcount
        except self.driver_error as error:
            if driver.closed or driver.broken or self._must_look(error, driver):
                raise LeftToSQLAlchemy() from None
            # As SQLAlchemy raises it: the statement, its values kept on the exception as
            # SQLAlchemy keeps them, and hidden from its message (the engine's setting).
            raise exc.DBAPIError.instance(
                self.sql,
                values,
                error,
                self.driver_error,
                hide_parameters=True,
                dialect=self._dialect,
            ) from error
        pooled.info[_CURSOR] = cursor
        if rows is None:
            return count
        return [
            {
                name: value if process is None else process(value)
                for name, process, value in zip(self._names, self._results, row, strict=True)
            }
            for row in rows
        ]

    def _must_look(self, error: Any, driver: Any) -> bool:
        """A dead connection by the dialect's reckoning, or a stale plan (which the
        ledger's engine counts as one): SQLAlchemy invalidates the pool for it."""
        return is_stale_plan(error) or bool(self._dialect.is_disconnect(error, driver, None))


def runs_direct(engine: Engine) -> bool:
    """Whether statements on `engine` may take the driver's cursor: PostgreSQL through
    psycopg (3), the dialect whose results SQLAlchemy does not reshape."""
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"
