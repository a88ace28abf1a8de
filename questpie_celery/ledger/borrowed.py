"""Engines over connections the ledger borrows rather than opens: a framework's own
(Django's), handed over by a `creator`. What SQLAlchemy needs to be told for that lives
here, beside the ledger's own engines: no pool (the framework owns each connection's
life), no reset on return, no statement values in errors, and a SQLite dialect that
accepts datetimes the framework's connection already parsed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy import types as sqltypes
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.sqlite import DATETIME
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool


def borrowing_engine(
    creator: Callable[[], Any],
    *,
    postgres: bool,
    sqlite_path: str = "",
    on_invalidate: Callable[[Any, Any, Any], None],
    on_error: Callable[[Any], None],
) -> Engine:
    """An engine whose every connection is `creator()`: PostgreSQL on psycopg, or SQLite
    at `sqlite_path`. `on_invalidate` hears of a connection found dead, `on_error` of
    every failed statement (SQLAlchemy's `invalidate` and `handle_error` events)."""
    url = (
        URL.create("postgresql+psycopg")
        if postgres
        else URL.create("sqlite+questpie_django", database=sqlite_path)
    )
    # The ledger has no hstore column, and psycopg would refuse the proxy for its lookup.
    dialect_options: dict[str, Any] = {"use_native_hstore": False} if postgres else {}
    engine = create_engine(
        url,
        creator=creator,
        poolclass=NullPool,
        pool_reset_on_return=None,
        hide_parameters=True,  # errors name no statement value: no payload in logs
        **dialect_options,
    )
    event.listen(engine, "invalidate", on_invalidate)
    event.listen(engine, "handle_error", on_error)
    return engine


def refusing_engine(refuse: Callable[[], Any]) -> Engine:
    """An engine every connection of which fails as `refuse()` raises."""
    return create_engine("sqlite://", creator=refuse, poolclass=NullPool)


def dedicated_postgres_engine(connect: Callable[[], Any]) -> Engine:
    """An engine of connections of its own to PostgreSQL, each `connect()` (a psycopg
    connection): for a relay's LISTEN, which holds its connection for good."""
    return create_engine(URL.create("postgresql+psycopg"), creator=connect, poolclass=NullPool)


class _ParsedDateTime(DATETIME):
    """A DATETIME that a `PARSE_DECLTYPES` connection (Django's) may hand over parsed."""

    def result_processor(self, dialect: Any, coltype: Any) -> Any:
        parse = super().result_processor(dialect, coltype)

        def process(value: Any) -> Any:
            if value is None or isinstance(value, datetime) or parse is None:
                return value
            return parse(value)

        return process


class DjangoSQLiteDialect(SQLiteDialect_pysqlite):
    """SQLite on Django's connections (`sqlite+questpie_django://`)."""

    supports_statement_cache = True
    colspecs = {  # noqa: RUF012  # declared as SQLAlchemy's own dialects do
        **SQLiteDialect_pysqlite.colspecs,
        sqltypes.DateTime: _ParsedDateTime,
    }


registry.register("sqlite.questpie_django", __name__, "DjangoSQLiteDialect")
