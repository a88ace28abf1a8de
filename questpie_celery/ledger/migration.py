"""Creating and upgrading the ledger's schema, and the identity its first migration
gave the database."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, func, inspect, select

from .errors import schema_missing, translate_errors
from .executor import Part
from .schema import (
    LEDGER_ID_KEY,
    SCHEMA_VERSION,
    dispatch_table,
    info_table,
    metadata,
    schedule_table,
    schema_version_table,
)
from .statements import db_time, insert_or_nothing


class MigrationStatements:
    """What `migrate` reads back of the schema, for one dialect."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self.ledger_id: Select[Any] = select(info_table.c.value).where(
            info_table.c.key == LEDGER_ID_KEY
        )


class Migration(Part):
    """The schema's operations."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._ledger_id: str | None = None
        self._sql = MigrationStatements(dialect, preamble)

    def migrate(self) -> int:
        """Create or upgrade the schema; safe to run again. Returns the schema version."""
        with translate_errors(self._db.migrate_command), self._db._begin() as conn:
            metadata.create_all(conn, checkfirst=True)
            # Committed on its own: on PostgreSQL their exclusive locks (which stop reads
            # too) then last a moment, not as long as the index builds below.
            _allow_pruned_options(conn)
            _widen_dispatch_ids(conn)
            _add_limit_columns(conn)
            _add_cancel_debounce_columns(conn)
            _add_columns(conn, _CLAIM_GENERATION_COLUMNS)
            _add_columns(conn, _CANVAS_COLUMNS)
        with translate_errors(self._db.migrate_command), self._db._begin() as conn:
            # create_all adds missing tables only; indexes added by a later version too.
            for table in metadata.sorted_tables:
                for index in table.indexes:
                    index.create(conn, checkfirst=True)
            conn.execute(
                insert_or_nothing(self._db.dialect, info_table).values(
                    key=LEDGER_ID_KEY, value=str(uuid.uuid4())
                )
            )
            current = conn.execute(select(func.max(schema_version_table.c.version))).scalar()
            if current is None or current < SCHEMA_VERSION:
                conn.execute(
                    insert_or_nothing(self._db.dialect, schema_version_table).values(
                        version=SCHEMA_VERSION, applied_at=db_time()
                    )
                )
        return SCHEMA_VERSION

    @property
    def knows_identity(self) -> bool:
        """Whether `ledger_id()` answers from memory."""
        return self._ledger_id is not None

    def ledger_id(self, conn: Connection | None = None) -> str:
        """The random identity the first migration gave this ledger database.

        With `conn`, read through the caller's connection: which database that is.
        """
        if conn is None and self._ledger_id is not None:
            return self._ledger_id
        if conn is not None:
            with translate_errors(self._db.migrate_command):
                found = conn.execute(self._sql.ledger_id).scalar()
        else:
            row = self._db._first(self._sql.ledger_id, {})
            found = row["value"] if row is not None else None
        if not isinstance(found, str):
            raise schema_missing(self._db.migrate_command)
        if conn is None:
            self._ledger_id = found
        return found


def _allow_pruned_options(conn: Connection) -> None:
    """Schema version 4: `options` may be NULL (a pruned row); a dispatch table made by an
    older version still refuses it."""
    name = dispatch_table.name
    options = next(c for c in inspect(conn).get_columns(name) if c["name"] == "options")
    if options["nullable"]:
        return
    if conn.dialect.name != "sqlite":
        # A change to the catalog only: no rewrite, and the lock lasts a moment.
        conn.exec_driver_sql(f"ALTER TABLE {name} ALTER COLUMN options DROP NOT NULL")
        return
    # SQLite cannot drop a NOT NULL constraint in place: rebuild the table, as its ALTER
    # TABLE documentation advises, within one transaction. An engine passed in may leave
    # DDL outside any transaction (pysqlite opens one only before DML), so open it here:
    # a crash half-way must not leave the table renamed.
    if not conn.connection.driver_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    old = f"{name}_before_v4"
    had = {c["name"] for c in inspect(conn).get_columns(name)}
    for index in dispatch_table.indexes:
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index.name}")
    conn.exec_driver_sql(f"ALTER TABLE {name} RENAME TO {old}")
    dispatch_table.create(conn)
    # The columns a later version added are new here: NULL in every copied row.
    columns = ", ".join(column.name for column in dispatch_table.columns if column.name in had)
    conn.exec_driver_sql(f"INSERT INTO {name} ({columns}) SELECT {columns} FROM {old}")
    conn.exec_driver_sql(f"DROP TABLE {old}")


#: The columns that hold a dispatch id, unbounded since schema version 5 (String(36) before).
_DISPATCH_ID_COLUMNS = ((dispatch_table.name, "id"), (schedule_table.name, "last_dispatch_id"))


def _widen_dispatch_ids(conn: Connection) -> None:
    """Schema version 5: a dispatch id may be any task id a plain Celery call carries
    (see `ids.unstorable_id`), not only a 36-character UUID.

    On PostgreSQL, `varchar(36)` to `text` is a change to the catalog only: the two are
    binary-compatible, so neither the table nor its indexes are rewritten, and the
    exclusive lock lasts a moment. SQLite never enforced the length, so nothing changes
    there: its tables made before version 5 keep `VARCHAR(36)` in their definition and
    store ids of any length all the same.
    """
    if conn.dialect.name == "sqlite":
        return
    inspector = inspect(conn)
    for table, name in _DISPATCH_ID_COLUMNS:
        column = next(c for c in inspector.get_columns(table) if c["name"] == name)
        if getattr(column["type"], "length", None) is not None:
            conn.exec_driver_sql(f"ALTER TABLE {table} ALTER COLUMN {name} TYPE text")


#: The columns schema version 6 added for the flow-control limits, with their types.
_LIMIT_COLUMNS = (
    (dispatch_table.name, "group_key", "TEXT"),
    (dispatch_table.name, "seat", "INTEGER"),
    (dispatch_table.name, "waiting_for", "VARCHAR(16)"),
    (schedule_table.name, "group_key", "TEXT"),
)
#: The columns schema version 7 added: a cancel that found the run active, a burst.
_CANCEL_DEBOUNCE_COLUMNS = (
    (dispatch_table.name, "cancel_requested_at", "TIMESTAMP WITH TIME ZONE"),
    (dispatch_table.name, "debounce_key", "TEXT"),
)

#: The column schema version 8 added: each claim's generation, the fencing token.
_CLAIM_GENERATION_COLUMNS = ((dispatch_table.name, "claim_generation", "INTEGER"),)
#: The columns schema version 9 added: a member's chord or batch, and its result.
_CANVAS_COLUMNS = (
    (dispatch_table.name, "canvas_id", "TEXT"),
    (dispatch_table.name, "result", "JSON"),
)


def _add_limit_columns(conn: Connection) -> None:
    """Schema version 6: the columns of the concurrency and rate limits. Nullable with no
    default, so on both dialects adding one changes the catalog only: no row is
    rewritten, and PostgreSQL's exclusive lock lasts a moment."""
    _add_columns(conn, _LIMIT_COLUMNS)


def _add_cancel_debounce_columns(conn: Connection) -> None:
    """Schema version 7: cancellation and debounce; as version 6's, catalog only."""
    _add_columns(conn, _CANCEL_DEBOUNCE_COLUMNS)


def _add_columns(conn: Connection, columns: tuple[tuple[str, str, str], ...]) -> None:
    inspector = inspect(conn)
    for table, name, kind in columns:
        if name not in {c["name"] for c in inspector.get_columns(table)}:
            # SQLite stores a datetime as text: it has no zone in its type names.
            typed = kind.replace(" WITH TIME ZONE", "") if conn.dialect.name == "sqlite" else kind
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {name} {typed}")
