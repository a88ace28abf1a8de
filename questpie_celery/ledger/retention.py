"""What the ledger keeps of an ended dispatch, one batch per statement: unkeyed rows
deleted, keyed ones pruned to what answers their key, spent schedule fires and beat tick
claims deleted, and the time before which rows may be gone (see `worker/retention.py` above,
which decides how long and how often)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    and_,
    any_,
    bindparam,
    delete,
    func,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from ..errors import LedgerSchemaError
from .executor import Part
from .schema import (
    PRUNED_BEFORE_KEY,
    TERMINAL,
    beat_tick_table,
    canvas_table,
    dispatch_table,
    info_table,
)
from .statements import db_time

#: The schema retention needs: `options` nullable, and its index on `finished_at`.
RETENTION_SCHEMA_VERSION = 4


class RetentionStatements:
    """Retention's prebuilt statements for one dialect (the batches are built per call)."""

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        i = info_table.c
        self.pruned_before: Select[Any] = select(i.value).where(i.key == PRUNED_BEFORE_KEY)
        raise_pruned_before = (
            (postgresql if dialect == "postgresql" else sqlite)
            .insert(info_table)
            .values(key=PRUNED_BEFORE_KEY, value=bindparam("value"))
        )
        # Only ever forward: ISO 8601 texts in UTC compare as the times they spell.
        self.raise_pruned_before: Insert = raise_pruned_before.on_conflict_do_update(
            index_elements=["key"],
            set_={"value": raise_pruned_before.excluded.value},
            where=i.value < raise_pruned_before.excluded.value,
        )


def spent_fires(dialect: str, *, key_prefix: str, older_than: float, limit: int) -> Any:
    """Delete up to `limit` ended dispatches that schedule fires made, `older_than`
    seconds after they ended: a past tick never fires again, so its key is spent.

    Retention never prunes a fire row (it leaves them to the beat), so `options IS NOT
    NULL` holds for all of them; it is there to let the scan use retention's partial
    index on `finished_at`, oldest first, instead of reading the whole table.
    """
    t = dispatch_table.c
    spent = (
        select(t.id)
        .where(
            _ended_status(),
            t.idempotency_key.startswith(key_prefix, autoescape=True),
            t.finished_at < db_time(-older_than),
            t.options.is_not(None),
        )
        .order_by(t.finished_at)
        .limit(limit)
    )
    return delete(dispatch_table).where(_one_of(dialect, spent))


def _ended_status() -> ColumnElement[bool]:
    """The row has ended, as a filter only: `status || ''` keeps SQLite (which, without
    statistics, takes an equality for the most selective condition) from walking every
    ended row through the `(status, next_send_at)` index and sorting them, where the
    partial index on `finished_at` gives the oldest first."""
    return dispatch_table.c.status.concat("").in_(TERMINAL)


def _one_of(dialect: str, ids: Select[Any]) -> ColumnElement[bool]:
    """`id` is one of those `ids` selects (a batch of at most a few thousand).

    On PostgreSQL as `id = ANY(ARRAY(...))`: the batch is read first and each row found
    through the primary key. As `id IN (...)`, the planner may hash the batch and read
    the whole table to join it, which on a big ledger costs a full scan per batch.
    """
    t = dispatch_table.c
    if dialect == "postgresql":
        return t.id == any_(func.array(ids.scalar_subquery()))
    return t.id.in_(ids.scalar_subquery())


def ended_batch(
    dialect: str, *, keyed: bool, older_than: float, limit: int, spare_key_prefix: str
) -> Any:
    """One batch of retention: up to `limit` dispatches that ended over `older_than`
    seconds ago, oldest first. Unkeyed ones are deleted. Keyed ones keep what answers their
    key (id, job, key, status, times) and lose their payload, options and result; those whose key
    starts with `spare_key_prefix` are left alone.

    The rows are chosen through the partial index on `finished_at` (`options IS NOT NULL`
    is there to match it) and, on PostgreSQL, locked with SKIP LOCKED: a row another
    statement holds (a requeue, another relay's batch) is left for a later batch, so
    retention never waits on a lock, and a row requeued meanwhile is seen no longer ended.
    """
    t = dispatch_table.c
    # An id derived from a key (a version-5 UUID) is a key's even where the row does not
    # know the key: one a relaxed ledger's fence wrote again from its message. Deleting
    # it would let the key run again.
    derived = func.substr(t.id, 15, 1) == "5"
    # A member of a chord or batch still open keeps its row and its result: the
    # callback is given them when the last member ends.
    open_canvas = (
        select(canvas_table.c.id)
        .where(canvas_table.c.id == t.canvas_id, canvas_table.c.status == "open")
        .exists()
    )
    ended = and_(
        _ended_status(),
        t.finished_at < db_time(-older_than),
        t.options.is_not(None),
        or_(t.canvas_id.is_(None), ~open_canvas),
        (
            or_(
                and_(
                    t.idempotency_key.is_not(None),
                    ~t.idempotency_key.startswith(spare_key_prefix, autoescape=True),
                ),
                and_(t.idempotency_key.is_(None), derived),
            )
            if keyed
            else and_(t.idempotency_key.is_(None), ~derived)
        ),
    )
    batch = _one_of(
        dialect,
        select(t.id)
        .where(ended)
        .order_by(t.finished_at)
        .limit(limit)
        .with_for_update(skip_locked=True),  # SQLite has one writer, and ignores it
    )
    if not keyed:
        return delete(dispatch_table).where(batch)
    # null(), not None: SQL NULL; None would be stored as the JSON value null. What the
    # run returned goes with its payload: the application's data.
    return update(dispatch_table).where(batch).values(payload=null(), options=null(), result=null())


def old_beat_ticks(*, older_than: float) -> Any:
    bt = beat_tick_table.c
    return delete(beat_tick_table).where(bt.claimed_at < db_time(-older_than))


class Retention(Part):
    """Retention's operations."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = RetentionStatements(dialect, preamble)
        self._retention_ready = False  # the schema was seen at RETENTION_SCHEMA_VERSION

    def prune_schedule_history(self, *, key_prefix: str, older_than: float, limit: int) -> int:
        """Delete spent fire rows and beat tick claims older than `older_than` seconds."""
        self._record_pruned_before(older_than)
        self._db._execute(old_beat_ticks(older_than=older_than), {})
        stmt = spent_fires(
            self._db.dialect, key_prefix=key_prefix, older_than=older_than, limit=limit
        )
        return int(self._db._execute(stmt, {}))

    def _record_pruned_before(self, older_than: float) -> None:
        """Say, before deleting any, that rows ended over `older_than` seconds ago may go."""
        cutoff = self._db.now() - timedelta(seconds=older_than)
        self._db._execute(self._sql.raise_pruned_before, {"value": cutoff.isoformat()})

    def pruned_before(self) -> datetime | None:
        """Rows that ended before this time may have been deleted; None: none ever was."""
        found = self._db._first(self._sql.pruned_before, {})
        return datetime.fromisoformat(found["value"]) if found is not None else None

    def prune_ended(
        self, *, keyed: bool, older_than: float, limit: int, spare_key_prefix: str
    ) -> int:
        """One batch of retention: delete up to `limit` unkeyed dispatches (or, `keyed`,
        drop the payload and options of keyed ones) that ended over `older_than` seconds
        ago, oldest first; keys starting with `spare_key_prefix` are left alone. Returns
        how many rows it changed. Raises `LedgerSchemaError` before schema version 4."""
        if not self._retention_ready:
            found = self._db.schema_version()
            if found is None or found < RETENTION_SCHEMA_VERSION:
                raise LedgerSchemaError(
                    f"retention needs ledger schema version {RETENTION_SCHEMA_VERSION} "
                    f"(this one is at {found}); run `{self._db.migrate_command}`"
                )
            self._retention_ready = True  # a schema never goes back
        self._record_pruned_before(older_than)
        stmt = ended_batch(
            self._db.dialect,
            keyed=keyed,
            older_than=older_than,
            limit=limit,
            spare_key_prefix=spare_key_prefix,
        )
        return int(self._db._execute(stmt, {}))
