"""Every SQL statement against the ledger, built once per dialect and addressed by name.

Statements are built once with bind parameters and reused: SQLAlchemy then skips
construction and cache-key generation on each call, which is most of its
per-statement cost. Dialect differences (PostgreSQL and SQLite) live here and in
`engine.py`, nowhere else.

Times come from the database's clock (`db_time`), never a host's: leases, due
times and redelivery times written by workers on different machines compare
against one clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Insert,
    LargeBinary,
    Select,
    String,
    Table,
    Text,
    Update,
    and_,
    bindparam,
    case,
    column,
    func,
    literal,
    literal_column,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

from ..errors import LedgerError
from .schema import (
    CLAIMABLE,
    LEDGER_ID_KEY,
    RUNNING,
    UTCDateTime,
    dispatch_table,
    info_table,
)

#: The PostgreSQL channel a `publish(connection=...)` notifies in the caller's transaction
#: and every relay listens on: the notification arrives only once that transaction commits,
#: exactly when the row becomes visible to the relay.
RELAY_WAKE_CHANNEL = "questpie_relay"
LISTEN_FOR_SENDS = f"LISTEN {RELAY_WAKE_CHANNEL}"


class db_time(FunctionElement[Any]):
    """The database's current time, plus an optional offset in seconds."""

    type = UTCDateTime()
    inherit_cache = True


@compiles(db_time, "postgresql")
def _pg_time(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    # now() is the statement's start in autocommit: one instant for the whole statement.
    args = list(element.clauses)
    if not args:
        return "now()"
    return f"(now() + make_interval(secs => {compiler.process(args[0], **kw)}))"


@compiles(db_time, "sqlite")
def _sqlite_time(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    # The text layout SQLAlchemy stores SQLite datetimes in, so comparisons stay textual.
    # SQLite keeps 'now' fixed within one statement.
    args = list(element.clauses)
    fmt = "'%Y-%m-%d %H:%M:%f000', 'now'"
    if not args:
        return f"strftime({fmt})"
    offset = compiler.process(args[0], **kw)
    return f"strftime({fmt}, printf('%+.6f seconds', {offset}))"


def seconds(name: str) -> Any:
    """A bind parameter holding a number of seconds."""
    return bindparam(name, type_=Float)


def insert_or_nothing(dialect: str, table: Table) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING, on the dialects the ledger supports."""
    if dialect == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing()
    raise LedgerError(f"the ledger supports PostgreSQL and SQLite, not {dialect!r}")


def upsert(dialect: str, table: Table, keys: list[str], values: dict[str, Any]) -> Any:
    """INSERT ... ON CONFLICT (keys) DO UPDATE SET every other value."""
    if dialect not in ("postgresql", "sqlite"):
        raise LedgerError(f"the ledger supports PostgreSQL and SQLite, not {dialect!r}")
    stmt = (postgresql if dialect == "postgresql" else sqlite).insert(table).values(**values)
    changed = {name: stmt.excluded[name] for name in values if name not in keys}
    return stmt.on_conflict_do_update(index_elements=keys, set_=changed)


def in_own_transaction(settings: Mapping[str, str]) -> ColumnElement[bool]:
    """True, once each of `settings` is in force for the rest of the statement's own
    transaction (`set_config(..., true)`: local to it), for a ledger behind a pooler in
    transaction mode, where a setting made for a session would stay on a server
    connection that other clients use next.

    In autocommit a statement is its own transaction, so the settings end with it. It is
    evaluated before the statement can wait: in a WHERE, on each row before that row is
    locked or updated; in an inserted value, before the row meets another's uncommitted
    row under the same key or slot. PostgreSQL's lock timeout is read when a lock wait
    starts, so a wait inside the same statement honours it (tested through PgBouncer).
    """
    checks = []
    for name, value in settings.items():
        # Our own constants, rendered in the statement's text: the parameters stay the
        # caller's, also in an executemany.
        if not (name.replace("_", "").isalpha() and value.replace("_", "").isalnum()):
            raise LedgerError(f"a setting the ledger cannot carry in a statement: {name}={value}")
        checks.append(
            func.set_config(
                literal_column(f"'{name}'"), literal_column(f"'{value}'"), true(), type_=Text
            ).is_not(None)
        )
    return and_(*checks)


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


def by_id() -> ColumnElement[bool]:
    """The one dispatch a statement addresses (`dispatch_id`)."""
    return dispatch_table.c.id == bindparam("dispatch_id")


def claimable() -> ColumnElement[bool]:
    """The row waits for a claim (see `schema.CLAIMABLE`)."""
    t = dispatch_table.c
    return or_(*(t.status == status for status in CLAIMABLE))


def deliverable() -> ColumnElement[bool]:
    """The row waits for the claim of delivery `previous + 1` of it, by its job.

    Bound to its job: a message for another job that carries this id claims nothing.
    `job_name || ''` keeps the job out of the index conditions: the row is found by
    its id. PostgreSQL, for a job its statistics have not seen yet (a new job on a
    big ledger, until the next ANALYZE), would otherwise rate the per-job index as
    good as the primary key and read every row of the job on each claim.
    """
    t = dispatch_table.c
    return and_(
        by_id(),
        t.job_name.concat("") == bindparam("job"),
        claimable(),
        t.attempt == bindparam("previous"),
    )


def delivered() -> ColumnElement[Any]:
    """The row's `queued_at` once a delivery of it arrived.

    A delivery is proof that the broker had its message: a claim (or a park, or the
    end of a revoked one) records the acceptance if the publisher's batched mark has
    not landed yet, and the mark then leaves the row alone. Never after now: a claim
    that waited on a mark's row lock started before the mark.
    """
    t = dispatch_table.c
    now = db_time()
    return case((or_(t.queued_at.is_(None), t.queued_at > now), now), else_=t.queued_at)


def terminal_values() -> dict[str, Any]:
    """What every write that ends a dispatch sets, with its `error`."""
    return {
        "lease_expires_at": None,
        "last_error": bindparam("error"),
        "finished_at": db_time(),
        "next_send_at": None,  # an ended dispatch is never sent again
        # Key erasure is part of the terminal write, never a second step.
        "secret_ciphertext": None,
        "secret_wrapped_key": None,
    }


def add_preamble(
    statements: object, preamble: ColumnElement[bool] | None, names: tuple[str, ...]
) -> None:
    """`preamble` (a pooled ledger's settings, `in_own_transaction`) in each of the
    updates `names` of `statements`: the writes that may wait on a row another
    transaction holds (a key, a policy slot, a row lock), or that commit on the hot path
    (a relaxed ledger's `synchronous_commit`). The rare ones (schedules, retention,
    policies, backlog samples) commit with the server's defaults."""
    if preamble is None:
        return
    for name in names:
        update_: Update = getattr(statements, name)
        setattr(statements, name, update_.where(preamble))


class Statements:
    """The ledger's statements for one dialect.

    With `settings` (a pooled PostgreSQL ledger's own connections), every write that can
    wait on another transaction's row, or that commits on the hot path, sets them for its
    own transaction first (its preamble, `in_own_transaction`): what an unpooled engine
    sets once per connection at startup. Statements run in a caller's transaction must
    come from a `Statements` without settings, or the caller's transaction would keep
    them.
    """

    def __init__(self, dialect: str, preamble: ColumnElement[bool] | None = None) -> None:
        t = dispatch_table.c
        now = db_time()
        by_id = dispatch_table.c.id == bindparam("dispatch_id")

        self.insert: Insert = (
            insert_or_nothing(dialect, dispatch_table)
            .values(
                id=bindparam("id"),
                job_name=bindparam("job_name"),
                idempotency_key=bindparam("idempotency_key"),
                singleton_key=bindparam("singleton_key"),
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
        self.exists: Select[Any] = select(t.id).where(by_id)
        # A fast worker may already have claimed the row: keep its status then, and only a
        # row still waiting for its first claim gets a redelivery time.
        still_pending = t.status == "pending"
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
        self.ledger_id: Select[Any] = select(info_table.c.value).where(
            info_table.c.key == LEDGER_ID_KEY
        )
        if preamble is not None:
            self._add_preamble(preamble)

    def _add_preamble(self, preamble: ColumnElement[bool]) -> None:
        """`preamble` in every write that may wait on a row another transaction holds (a
        key, a policy slot, a row lock), or that commits on the hot path (a relaxed
        ledger's `synchronous_commit`). The rare ones (schedules, retention, policies,
        backlog samples) commit with the server's defaults."""
        # In a value: the insert evaluates its row before checking its keys and slots.
        self.insert = self.insert.values(created_at=case((preamble, db_time())))
        for name in _PREAMBLE_UPDATES:
            update_: Update = getattr(self, name)
            setattr(self, name, update_.where(preamble))


#: The updates `Statements._add_preamble` gives the pooled ledger's settings.
_PREAMBLE_UPDATES = (
    "mark_queued",
)  # fmt: skip


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


def smaller(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    # least() and greatest() are spelled min() and max() on SQLite: CASE reads the same.
    return case((a < b, a), else_=b)


def larger(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((a > b, a), else_=b)


def slot_busy(job: ColumnElement[Any], slot: ColumnElement[Any]) -> ColumnElement[bool]:
    """Something runs in the slot, or is on its way to it.

    A run on its way (an unparked or accepted run that is due, its message in the
    broker) keeps it busy too; a delayed dispatch that is not yet due does not, or a
    far-off start would hide the slot's parked runs from the relay.
    """
    other = dispatch_table.alias("other")
    on_its_way: ColumnElement[bool] = or_(
        other.c.status.in_(RUNNING),
        and_(other.c.status.in_(("pending", "queued")), other.c.run_after <= db_time()),
    )
    return (
        select(other.c.id).where(other.c.job_name == job, other.c.slot == slot, on_its_way).exists()
    )
