"""The hottest statements on the driver's own cursor.

A fenced run makes two statements (its claim and its outcome) and a keyed publish one
(its insert). On a busy worker, SQLAlchemy's execution of each (an execution context,
parameter processing, describing the cursor, the result's metadata) cost the process
more CPU than the statement's round trip. These statements are compiled once by
SQLAlchemy and run on the pooled connection's psycopg cursor, with the same SQL text,
the same parameters (through the same type processors) and the same result types.

Only the success path is short-cut. A statement that fails on the driver's cursor
runs once more through SQLAlchemy's execution on the same connection, which finds
what went wrong as it does for every statement: a dead connection invalidated and
the statement rerun on a fresh one (`Reruns`), a stale plan, a slot index, a lock
timeout. A failed statement in autocommit wrote nothing, so running it again is
safe; a reply lost after a commit is the ambiguity every rerun already handles.

While anything listens to SQLAlchemy's cursor events on the engine (tracing
instrumentation does), every statement goes through SQLAlchemy, so the listener
sees them all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

_Processor = Callable[[Any], Any] | None


class DriverStatement:
    """One statement compiled for `engine`'s dialect, run on the driver's cursor."""

    def __init__(self, stmt: ClauseElement, engine: Engine) -> None:
        dialect = engine.dialect
        self._engine = engine
        #: What the driver raises for a failed statement or a broken connection.
        self.driver_error: type[Exception] = dialect.loaded_dbapi.Error
        compiled = stmt.compile(dialect=dialect)
        assert isinstance(compiled, SQLCompiler)  # a DML statement compiles to SQL
        self._compiled = compiled
        self.sql = self._compiled.string
        self._binds: list[tuple[str, Callable[[Any], Any]]] = []
        for bind, name in compiled.bind_names.items():
            process = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if process is not None:
                self._binds.append((name, process))
        returning = getattr(stmt, "returning_column_descriptions", None) or []
        self._names: list[str] = [column["name"] for column in returning]
        self._results: list[_Processor] = [
            column["type"].dialect_impl(dialect).result_processor(dialect, None)
            for column in returning
        ]

    def observed(self) -> bool:
        """Whether something listens to the engine's cursor executions (then the
        statement goes through SQLAlchemy, for the listener to see)."""
        events = self._engine.dispatch
        return bool(events.before_cursor_execute or events.after_cursor_execute)

    def run(self, conn: Connection, params: Mapping[str, Any]) -> Any:
        """Its rows as mappings (for a statement with RETURNING) or its row count."""
        values = dict(self._compiled.construct_params(dict(params)) or {})
        for name, process in self._binds:
            values[name] = process(values[name])
        driver = conn.connection.driver_connection
        assert driver is not None  # a checked-out connection always has one
        with driver.cursor() as cursor:
            cursor.execute(self.sql, values)
            if not self._names:
                return cursor.rowcount
            return [
                {
                    name: value if process is None else process(value)
                    for name, process, value in zip(self._names, self._results, row, strict=True)
                }
                for row in cursor.fetchall()
            ]


def runs_direct(engine: Engine) -> bool:
    """Whether statements on `engine` may take the driver's cursor: PostgreSQL through
    psycopg (3), the dialect whose results SQLAlchemy does not reshape."""
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"
