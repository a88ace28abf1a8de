"""`Ledger`: every operation on the ledger tables, addressed by what it does.

How each one runs its statement (autocommit, the one rerun, reading back) is
`executor.py`'s.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, func, inspect, select
from sqlalchemy.sql import Executable

from .claims import Claims
from .engine import create_ledger_engine
from .errors import schema_missing, translate_errors
from .policies import Policies
from .relay import Relay
from .retention import Retention
from .rows import DispatchRow, NewDispatch
from .schedules import Schedules
from .schema import (
    LEDGER_ID_KEY,
    SCHEMA_VERSION,
    dispatch_table,
    info_table,
    metadata,
    schedule_table,
    schema_version_table,
)
from .slots import Slots
from .statements import Statements, db_time, insert_or_nothing
from .views import Views

#: The first schema version whose dispatch ids may be longer than a UUID's 36 characters.
WIDE_IDS_SCHEMA_VERSION = 5
UUID_LENGTH = 36


class Ledger(Claims, Slots, Policies, Relay, Schedules, Retention, Views):
    """The dispatch ledger in one database."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        super()._prepare(dialect, preamble)
        self._sql = Statements(dialect, preamble)
        #: The statements run in a caller's transaction, which must not keep our settings.
        self._in_caller = Statements(dialect) if preamble is not None else self._sql
        self._ledger_id: str | None = None
        self._wide_ids_ready = False  # the schema was seen at WIDE_IDS_SCHEMA_VERSION

    @property
    def statements(self) -> Statements:
        """The statements of this ledger's dialect (for `aio.AsyncLedger`)."""
        return self._sql

    # --- schema ------------------------------------------------------------------------

    def migrate(self) -> int:
        """Create or upgrade the schema; safe to run again. Returns the schema version."""
        with translate_errors(self.migrate_command), self._begin() as conn:
            metadata.create_all(conn, checkfirst=True)
            # Committed on its own: on PostgreSQL their exclusive locks (which stop reads
            # too) then last a moment, not as long as the index builds below.
            _allow_pruned_options(conn)
            _widen_dispatch_ids(conn)
        with translate_errors(self.migrate_command), self._begin() as conn:
            # create_all adds missing tables only; indexes added by a later version too.
            for table in metadata.sorted_tables:
                for index in table.indexes:
                    index.create(conn, checkfirst=True)
            conn.execute(
                insert_or_nothing(self.dialect, info_table).values(
                    key=LEDGER_ID_KEY, value=str(uuid.uuid4())
                )
            )
            current = conn.execute(select(func.max(schema_version_table.c.version))).scalar()
            if current is None or current < SCHEMA_VERSION:
                conn.execute(
                    insert_or_nothing(self.dialect, schema_version_table).values(
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
            with translate_errors(self.migrate_command):
                found = conn.execute(self._sql.ledger_id).scalar()
        else:
            row = self._first(self._sql.ledger_id, {})
            found = row["value"] if row is not None else None
        if not isinstance(found, str):
            raise schema_missing(self.migrate_command)
        if conn is None:
            self._ledger_id = found
        return found

    # --- publishing --------------------------------------------------------------------

    def insert(self, new: NewDispatch, conn: Connection | None = None) -> bool:
        """Insert the row unless its id (or its policy slot) is taken; True if inserted.

        One statement, so concurrent publishers of one key race inside the database:
        exactly one of them gets True. With `conn`, it runs in the caller's transaction.
        """
        if len(new.id) > UUID_LENGTH:
            self._check_wide_ids()
        params = row_params(new)
        if conn is None:
            # A secret's ciphertext exists nowhere else: a relaxed ledger still waits for
            # the disk before the publisher is told it is accepted.
            secret = new.secret_ciphertext is not None
            rows, retried = self._run(self._sql.insert, params, durable=secret)
            # A retried insert that now conflicts may have been our own first try. A row
            # under a random id can only be ours; for a key's derived id, a second send of
            # another publisher's row is harmless (the fence drops the duplicate).
            return bool(rows) or (retried and self.exists(new.id))
        # The caller's connection reaches the ledger's own database (checked by
        # transactions.caller_connection), so the ledger's statements fit its dialect.
        with translate_errors(self.migrate_command):
            return conn.execute(self._in_caller.insert, params).first() is not None

    def _check_wide_ids(self) -> None:
        """Raise `LedgerSchemaError` before a statement meets a column too narrow for an
        id longer than a UUID: the package was upgraded and `migrate` has not run since
        (on PostgreSQL the insert would fail on the old width, leaving a plain call taken
        into the ledger unrun; as a schema error, the fence waits for the migration)."""
        if self._wide_ids_ready:
            return
        found = self.schema_version()
        if found is None or found < WIDE_IDS_SCHEMA_VERSION:
            raise schema_missing(self.migrate_command)
        self._wide_ids_ready = True  # a schema never goes back

    def insert_many(self, batch: Sequence[NewDispatch], conn: Connection | None = None) -> set[str]:
        """Insert the rows in order, each unless its id or policy slot is taken (by an
        existing row or an earlier one of the batch); return the ids inserted.

        One statement on PostgreSQL. The rows must share everything but their ids, keys,
        slots and payloads: the publish of one call's items does.
        """
        if not batch:
            return set()
        stmt: Executable
        params: Any
        sql = self._sql if conn is None else self._in_caller
        if sql.insert_batch is not None:
            stmt, params = sql.insert_batch, batch_params(batch)
        else:
            stmt, params = sql.insert, [row_params(new) for new in batch]
        if conn is not None:
            with translate_errors(self.migrate_command):
                return {row.id for row in conn.execute(stmt, params)}
        secret = batch[0].secret_ciphertext is not None  # as in `insert`
        rows, retried = self._run(stmt, params, durable=secret, rerun_if_rolled_back=True)
        inserted = {row["id"] for row in rows}
        if retried:
            # As in `insert`: a row found now may be our first try's, which nobody sent.
            inserted |= self.existing([new.id for new in batch if new.id not in inserted])
        return inserted

    def existing(self, dispatch_ids: Sequence[str], conn: Connection | None = None) -> set[str]:
        """Which of these rows exist (with `conn`: as the caller's transaction sees them)."""
        if not dispatch_ids:
            return set()
        params = {"dispatch_ids": list(dispatch_ids)}
        if conn is not None:
            with translate_errors(self.migrate_command):
                return {row.id for row in conn.execute(self._sql.existing, params)}
        return {row["id"] for row in self._execute(self._sql.existing, params)}

    def exists(self, dispatch_id: str, conn: Connection | None = None) -> bool:
        """Whether the row exists (with `conn`: as the caller's transaction sees it)."""
        params = {"dispatch_id": dispatch_id}
        if conn is not None:
            with translate_errors(self.migrate_command):
                return conn.execute(self._sql.exists, params).first() is not None
        return self._first(self._sql.exists, params) is not None

    def get_many(self, dispatch_ids: Sequence[str]) -> list[DispatchRow]:
        if not dispatch_ids:
            return []
        rows = self._execute(self._sql.get_many, {"dispatch_ids": list(dispatch_ids)})
        return [DispatchRow.from_mapping(row) for row in rows]

    def mark_queued(
        self, dispatch_ids: Sequence[str], redeliver_in: float, accepted_ago: float = 0.0
    ) -> None:
        """Record that the broker accepted these dispatches, in one batch, `accepted_ago`
        seconds ago (the newest of them: a batch is written a moment after)."""
        if dispatch_ids:
            params = {
                "dispatch_ids": list(dispatch_ids),
                "redeliver_in": redeliver_in,
                "accepted_ago": max(accepted_ago, 0.0),
            }
            self._execute(self._sql.mark_queued, params)

    # --- the relay's sends -------------------------------------------------------------

    # --- schedules ------------------------------------------------------------------------

    # --- retention -------------------------------------------------------------------------

    # --- the operator's views ------------------------------------------------------------


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
    for index in dispatch_table.indexes:
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {index.name}")
    conn.exec_driver_sql(f"ALTER TABLE {name} RENAME TO {old}")
    dispatch_table.create(conn)
    columns = ", ".join(column.name for column in dispatch_table.columns)
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


def open_ledger(url: str, *, relaxed: bool = False, pooled: bool = False) -> Ledger:
    """A `Ledger` on an engine of its own, for tools that have a URL and no `Questpie`
    (`pooled`: the URL reaches PostgreSQL through a pooler in transaction mode)."""
    return Ledger(
        create_ledger_engine(url, relaxed=relaxed, pooled=pooled), relaxed=relaxed, pooled=pooled
    )


def row_params(new: NewDispatch) -> dict[str, Any]:
    return {
        "id": new.id,
        "job_name": new.job_name,
        "idempotency_key": new.idempotency_key,
        "singleton_key": new.singleton_key,
        "status": new.status,
        "attempt": new.attempt,
        "policy": new.policy if new.slot is not None else None,
        "slot": new.slot,
        "payload": new.payload,
        "secret": new.secret_ciphertext is not None,
        "secret_ciphertext": new.secret_ciphertext,
        "secret_wrapped_key": new.secret_wrapped_key,
        "secret_key_id": new.secret_key_id,
        "options": new.options,
        "run_after": new.run_after,
        "next_send_at": new.next_send_at,
        "send_in": new.send_in,
    }


def batch_params(batch: Sequence[NewDispatch]) -> dict[str, Any]:
    """`insert_batch`'s parameters: the values the rows share once, the others as arrays."""
    first = batch[0]
    shared = (first.job_name, first.status, first.options, first.run_after, first.next_send_at)
    if any(
        (new.job_name, new.status, new.options, new.run_after, new.next_send_at) != shared
        for new in batch
    ):
        # Storing one row's options under another's id would be a silent corruption.
        raise ValueError("the rows of a batch must share job, status, options and times")
    params = {name: value for name, value in row_params(first).items() if name in _SHARED}
    params["policy"] = next((new.policy for new in batch if new.slot is not None), None)
    for name in _PER_ROW:
        params[f"{name}s"] = [getattr(new, name) for new in batch]
    return params


_SHARED = ("job_name", "status", "secret", "options", "run_after", "next_send_at", "send_in")
_PER_ROW = (
    "id", "idempotency_key", "singleton_key", "slot", "payload",
    "secret_ciphertext", "secret_wrapped_key", "secret_key_id",
)  # fmt: skip
