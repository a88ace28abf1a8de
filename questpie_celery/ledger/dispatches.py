"""Publishing's side of the ledger: inserting dispatch rows (one, or a batch in one
statement), reading them back, and recording the broker's acceptance.

With `conn`, an operation runs in the caller's transaction (`publish(session=...)`),
on statements built without a pooled ledger's settings: the caller's transaction must
not keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    Insert,
    LargeBinary,
    Select,
    String,
    Text,
    Update,
    and_,
    bindparam,
    case,
    column,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Executable

from ..errors import LedgerError
from . import inserts
from .engine import runs_in_autocommit
from .errors import schema_missing, translate_errors
from .executor import Part
from .inserts import batch_params, row_params
from .rows import DispatchRow, NewDispatch
from .schema import UTCDateTime, dispatch_table
from .statements import add_preamble, by_id, db_time, insert_or_nothing, larger, seconds, smaller

#: The first schema version whose dispatch ids may be longer than a UUID's 36 characters.
WIDE_IDS_SCHEMA_VERSION = 5
UUID_LENGTH = 36


T = TypeVar("T")


class DispatchStatements:
    """Publishing's statements for one dialect.

    With `preamble` (a pooled PostgreSQL ledger's own connections), the insert and the
    acceptance mark set the ledger's settings for their own transaction first
    (`statements.in_own_transaction`): what an unpooled engine sets once per connection
    at startup. Statements run in a caller's transaction must come from a
    `DispatchStatements` without `preamble`, or the caller's transaction would keep them.
    """

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None = None) -> None:
        t = dispatch_table.c
        now = db_time()

        self.insert: Insert = (
            insert_or_nothing(dialect, dispatch_table)
            .values(
                id=bindparam("id"),
                job_name=bindparam("job_name"),
                idempotency_key=bindparam("idempotency_key"),
                singleton_key=bindparam("singleton_key"),
                group_key=bindparam("group_key"),
                status=bindparam("status"),
                policy=bindparam("policy", type_=t.policy.type),
                slot=bindparam("slot"),
                payload=bindparam("payload", type_=t.payload.type),
                secret=bindparam("secret"),
                secret_ciphertext=bindparam("secret_ciphertext", type_=t.secret_ciphertext.type),
                secret_wrapped_key=bindparam("secret_wrapped_key", type_=t.secret_wrapped_key.type),
                secret_key_id=bindparam("secret_key_id"),
                options=bindparam("options", type_=t.options.type),
                attempt=bindparam("attempt"),
                canvas_id=bindparam("canvas_id"),
                send_count=0,
                created_at=now,
                # An absolute start (start_after) or now; the relay's first look: an
                # absolute time or now plus a delay.
                run_after=func.coalesce(bindparam("run_after", type_=UTCDateTime), now),
                next_send_at=func.coalesce(
                    bindparam("next_send_at", type_=UTCDateTime), db_time(seconds("send_in"))
                ),
                queued_at=case((bindparam("status") == "queued", now), else_=None),
            )
            .returning(t.id)
        )
        self.insert_batch: Insert | None = (
            insert_batch(dialect, preamble) if dialect == "postgresql" else None
        )
        self.existing: Select[Any] = select(t.id).where(
            t.id.in_(bindparam("dispatch_ids", expanding=True))
        )
        self.get_many: Select[Any] = select(dispatch_table).where(
            t.id.in_(bindparam("dispatch_ids", expanding=True))
        )
        self.exists: Select[Any] = select(t.id).where(by_id())
        # A fast worker may already have claimed the row: keep its status then, and only a
        # row still waiting for its first claim gets a redelivery time.
        # Only a row still waiting for its first claim (acceptance is recorded for first
        # sends alone): a late mark of a first send must not take a row an operator
        # requeued meanwhile (pending again, attempt 1 or more) for sent, putting its
        # relay's send off by `redeliver_after`.
        still_pending = and_(t.status == "pending", t.attempt == 0)
        # When the broker took the message: the mark is batched, so it comes a moment
        # later (`accepted_ago`, measured by the publisher), never before the row was
        # written, and never after a run started (on a row a release before this one
        # claimed without recording its acceptance).
        accepted = larger(t.created_at, db_time(-seconds("accepted_ago")))
        # One statement (one commit) for a whole batch of acceptances.
        self.mark_queued: Update = (
            update(dispatch_table)
            .where(
                t.id.in_(bindparam("dispatch_ids", expanding=True)),
                # Rows already marked (or claimed, which records acceptance too) are left
                # alone: no write.
                or_(still_pending, t.queued_at.is_(None)),
            )
            .values(
                queued_at=func.coalesce(
                    t.queued_at, smaller(accepted, func.coalesce(t.started_at, accepted))
                ),
                status=case((still_pending, "queued"), else_=t.status),
                next_send_at=case(
                    (
                        and_(still_pending, ~_made_due_at_start()),
                        db_time(seconds("redeliver_in")),
                    ),
                    else_=t.next_send_at,
                ),
            )
        )
        if preamble is not None:
            self._add_preamble(preamble)

    def _add_preamble(self, preamble: ColumnElement[bool]) -> None:
        """`preamble` in the insert and the acceptance mark (see `statements.add_preamble`)."""
        # In a value: the insert evaluates its row before checking its keys and slots.
        self.insert = self.insert.values(created_at=case((preamble, db_time())))
        add_preamble(self, preamble, ("mark_queued",))


def _made_due_at_start() -> ColumnElement[bool]:
    """The fence dropped an early delivery of the row and made it due for the relay at its
    start (`send_when_due`): its next send is exactly its `run_after`, still to come. The
    acceptance mark of its publish, which may come a moment after (it is batched), keeps
    that rather than putting the next send off by `redeliver_after`: the delivery dropped
    may have been the very message accepted.

    Only that write makes the two equal while the start is ahead: an insert's next send
    equals its start only when both are its now (no `start_after`, `send_in` 0), which has
    passed by the time of its mark; a far-off start's is the start less the ETA horizon.
    One equal by chance would cost one more send, which the fence drops."""
    t = dispatch_table.c
    return and_(t.next_send_at == t.run_after, t.run_after > db_time())


def insert_batch(dialect: str, preamble: ColumnElement[bool] | None = None) -> Insert:
    """Many new rows in one statement, each inserted or skipped as `insert` would, in order.

    The values a batch shares (job, status, policy, options, times) are single
    parameters; the per-row values travel as one array per column. On PostgreSQL that
    keeps the statement's text the same for every batch size (unnest, in order), so
    neither the driver nor the server parses thousands of placeholders; SQLite runs the
    one-row `insert` for each parameter set instead (SQLAlchemy batches it).
    """
    if dialect != "postgresql":
        raise LedgerError("insert_batch is PostgreSQL's; SQLite executes `insert` per row")
    t = dispatch_table.c
    per_row = {
        "id": String,
        "idempotency_key": Text,
        "singleton_key": Text,
        "group_key": Text,
        "slot": Text,
        "payload": postgresql.JSON,
        "secret_ciphertext": LargeBinary,
        "secret_wrapped_key": LargeBinary,
        "secret_key_id": String,
    }
    rows = (
        func.unnest(
            *(bindparam(f"{name}s", type_=postgresql.ARRAY(kind)) for name, kind in per_row.items())
        )
        .table_valued(
            *(column(name, kind) for name, kind in per_row.items()), with_ordinality="ord"
        )
        .render_derived()
    )
    now = db_time()
    shared = {
        "job_name": bindparam("job_name", type_=String),
        "status": bindparam("status", type_=String),
        "policy": bindparam("policy", type_=t.policy.type),
        "secret": bindparam("secret", type_=t.secret.type),
        "options": bindparam("options", type_=t.options.type),
        "canvas_id": bindparam("canvas_id", type_=Text),
        "attempt": literal(0),
        "send_count": literal(0),
        "created_at": now,
        "run_after": func.coalesce(bindparam("run_after", type_=UTCDateTime), now),
        "next_send_at": func.coalesce(
            bindparam("next_send_at", type_=UTCDateTime), db_time(seconds("send_in"))
        ),
    }
    values = {**{name: rows.c[name] for name in per_row}, **shared}
    # In the order given: a later row conflicts with an earlier one, as it would if
    # published after it.
    chosen = select(*values.values()).order_by(rows.c.ord)
    if preamble is not None:  # `in_own_transaction`, before any row is inserted
        chosen = chosen.where(preamble)
    return (
        postgresql.insert(dispatch_table)
        .from_select(list(values), chosen)
        .on_conflict_do_nothing()
        .returning(t.id)
    )


class Dispatches(Part):
    """Writing and reading dispatch rows."""

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        self._sql = DispatchStatements(dialect, preamble)
        # A keyed publish's insert, and the existence check of a key seen before.
        self._db._run_on_driver(self._sql.insert, self._sql.exists)
        #: The statements run in a caller's transaction, which must not keep our settings.
        self._in_caller = DispatchStatements(dialect) if preamble is not None else self._sql
        self._wide_ids_ready = False  # the schema was seen at WIDE_IDS_SCHEMA_VERSION

    @property
    def statements(self) -> DispatchStatements:
        """The publishing statements of this ledger's dialect (for `aio.AsyncLedger`, and
        the debounced and throttled publishes' inserts)."""
        return self._sql

    @property
    def caller_statements(self) -> DispatchStatements:
        """The publishing statements run in a caller's transaction: without a pooled
        ledger's settings, which that transaction must not keep."""
        return self._in_caller

    @property
    def inserts_in_batches(self) -> bool:
        """Whether rows of concurrent publishes gain by sharing `insert_many`, and may: it
        is one statement (PostgreSQL; on SQLite it runs the insert per row), on
        connections that belong to no thread. Django's are each thread's own, and may be
        in that thread's transaction (`set_autocommit(False)`): another thread's row
        written there would be that transaction's, and undone by its rollback. And only
        the ledger's own engines, whose statements give up on a row lock after the lock
        timeout: a shared statement meeting a row a publishing thread's own open
        transaction holds would otherwise hold that thread up for good."""
        return (
            self._sql.insert_batch is not None
            and self._db._borrowed is None
            and runs_in_autocommit(self._db.engine)
        )

    def insert(
        self, new: NewDispatch, conn: Connection | None = None, *, again: bool = False
    ) -> bool:
        """Insert the row unless its id (or its policy slot) is taken; True if inserted.

        One statement, so concurrent publishers of one key race inside the database:
        exactly one of them gets True. With `conn`, it runs in the caller's transaction.
        `again`: a statement that failed may have written this row already (a shared
        insert's), so the row found under its id counts as inserted, as after a rerun.
        """
        if len(new.id) > UUID_LENGTH:
            self._check_wide_ids()
        if conn is None:
            return self._drive(inserts.insert(self._sql, new, again=again))
        # The caller's connection reaches the ledger's own database (checked by
        # transactions.caller_connection), so the ledger's statements fit its dialect.
        with translate_errors(self._db.migrate_command):
            return conn.execute(self._in_caller.insert, row_params(new)).first() is not None

    def _check_wide_ids(self) -> None:
        """Raise `LedgerSchemaError` before a statement meets a column too narrow for an
        id longer than a UUID: the package was upgraded and `migrate` has not run since
        (on PostgreSQL the insert would fail on the old width, leaving a plain call taken
        into the ledger unrun; as a schema error, the fence waits for the migration)."""
        if self._wide_ids_ready:
            return
        found = self._db.schema_version()
        if found is None or found < WIDE_IDS_SCHEMA_VERSION:
            raise schema_missing(self._db.migrate_command)
        self._wide_ids_ready = True  # a schema never goes back

    def insert_many(self, batch: Sequence[NewDispatch], conn: Connection | None = None) -> set[str]:
        """Insert the rows in order, each unless its id or policy slot is taken (by an
        existing row or an earlier one of the batch); return the ids inserted.

        One statement on PostgreSQL. The rows must share everything but their ids, keys,
        slots and payloads: the publish of one call's items does.
        """
        if conn is None:
            return self._drive(inserts.insert_many(self._sql, batch))
        if not batch:
            return set()
        stmt: Executable
        params: Any
        if self._in_caller.insert_batch is not None:
            stmt, params = self._in_caller.insert_batch, batch_params(batch)
        else:
            stmt, params = self._in_caller.insert, [row_params(new) for new in batch]
        with translate_errors(self._db.migrate_command):
            return {row.id for row in conn.execute(stmt, params)}

    def existing(self, dispatch_ids: Sequence[str], conn: Connection | None = None) -> set[str]:
        """Which of these rows exist (with `conn`: as the caller's transaction sees them)."""
        if conn is None:
            return self._drive(inserts.existing(self._sql, dispatch_ids))
        if not dispatch_ids:
            return set()
        params = {"dispatch_ids": list(dispatch_ids)}
        with translate_errors(self._db.migrate_command):
            return {row.id for row in conn.execute(self._sql.existing, params)}

    def exists(self, dispatch_id: str, conn: Connection | None = None) -> bool:
        """Whether the row exists (with `conn`: as the caller's transaction sees it)."""
        if conn is None:
            return self._drive(inserts.exists(self._sql, dispatch_id))
        with translate_errors(self._db.migrate_command):
            return conn.execute(self._sql.exists, {"dispatch_id": dispatch_id}).first() is not None

    def _drive(self, plan: inserts.Plan[T]) -> T:
        """Run a plan's statements (see `inserts`) as `_run` runs one."""
        return inserts.drive(
            plan,
            lambda step: self._db._run(
                step.stmt,
                step.params,
                durable=step.durable,
                rerun_if_rolled_back=step.rerun_if_rolled_back,
            ),
        )

    def get_many(self, dispatch_ids: Sequence[str]) -> list[DispatchRow]:
        if not dispatch_ids:
            return []
        rows = self._db._execute(self._sql.get_many, {"dispatch_ids": list(dispatch_ids)})
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
            self._db._execute(self._sql.mark_queued, params)
