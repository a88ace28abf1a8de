"""What every concept's statements are built from: the database's clock, the dialect
helpers, a pooled ledger's settings in a statement, and the conditions several
concepts share (the row addressed, a delivery's claim, the terminal write, a busy slot).

Each concept module (`dispatches`, `claims`, `slots`, ...) builds its own statements
from these once per dialect, with bind parameters, and reuses them: SQLAlchemy then
skips construction and cache-key generation on each call, which is most of its
per-statement cost. Dialect differences (PostgreSQL and SQLite) live in these
statements and in `engine.py`, nowhere else.

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
    Table,
    Text,
    Update,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    or_,
    select,
    true,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import FunctionElement

from ..errors import LedgerError
from .schema import (
    CLAIMABLE,
    RUNNING,
    UTCDateTime,
    dispatch_table,
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
    #: PostgreSQL's clock: now() is the transaction's start, in autocommit the statement's,
    #: one instant for the whole statement (and across a transaction's statements).
    pg_clock = "now()"


class statement_time(db_time):
    """The time the current statement started, plus an optional offset in seconds: in a
    caller's transaction, the moment of the write itself, not of the transaction's start
    (which `db_time` gives, for one instant across a transaction's statements). SQLite's
    clock is the statement's in both."""

    inherit_cache = True
    pg_clock = "statement_timestamp()"


@compiles(db_time, "postgresql")
def _pg_time(element: db_time, compiler: SQLCompiler, **kw: Any) -> str:
    args = list(element.clauses)
    if not args:
        return element.pg_clock
    return f"({element.pg_clock} + make_interval(secs => {compiler.process(args[0], **kw)}))"


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


def cancelled_values() -> dict[str, Any]:
    """What a write that ends a dispatch as `cancelled` before its run sets: the terminal
    values, its claim and its wait left behind, and the last attempt's error kept (a
    cancel is no error)."""
    t = dispatch_table.c
    return {
        **terminal_values(),
        "status": "cancelled",
        "claim_token": None,
        "waiting_for": None,
        "last_error": t.last_error,
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


def limit_group(table: Any = dispatch_table) -> ColumnElement[Any]:
    """The group a row counts against for its job's limits ("" for the job as a whole).
    A row that holds a seat or waits for a limit has it written (`group_written`), so
    those are found by the plain column, through the limit indexes."""
    return func.coalesce(table.c.group_key, "")


def group_written() -> dict[str, Any]:
    """The values that write a row's group for the limit indexes: "" for none."""
    return {"group_key": limit_group()}


def _holds_seat(alias: Any) -> ColumnElement[bool]:
    """`alias` is a run holding a seat of the (job, group) of the row the enclosing
    statement addresses."""
    t = dispatch_table
    return and_(
        alias.c.job_name == t.c.job_name,
        alias.c.group_key == limit_group(t),
        alias.c.seat.is_not(None),
        # Written into the statement, not bound: PostgreSQL's reusable plan of the claim
        # may use the partial seat index only where the statuses are constants (with
        # bound ones it planned every claim afresh, 0.7 ms each). And spelled out, not
        # IN: the claim runs on psycopg's cursor, compiled once, and an IN list's
        # parameters are expanded per execution.
        or_(*(alias.c.status == literal_column(f"'{status}'") for status in RUNNING)),
    )


def free_seat() -> ColumnElement[Any]:
    """The lowest concurrency seat no run of the row's own (job, group) holds: 0 if free,
    else the lowest seat just above a held one that is free. Correlated to the row the
    enclosing statement addresses; read through the seat index (`schema.py`)."""
    t = dispatch_table
    held = dispatch_table.alias("held")
    above = dispatch_table.alias("held_above")
    # Correlated to the addressed row explicitly: SQLAlchemy correlates a subquery only to
    # the statement right around it, and the innermost one sits two levels down.
    zero_held = select(held.c.seat).where(_holds_seat(held), held.c.seat == 0).correlate(t).exists()
    next_held = (
        select(above.c.seat)
        .where(_holds_seat(above), above.c.seat == held.c.seat + 1)
        .correlate(t, held)
        .exists()
    )
    lowest_gap = (
        select(func.min(held.c.seat + 1))
        .where(_holds_seat(held), ~next_held)
        .correlate(t)
        .scalar_subquery()
    )
    return case((~zero_held, 0), else_=lowest_gap)


def seats_held() -> ColumnElement[Any]:
    """How many seats of the addressed row's (job, group) are held. Below the limit as
    well as a free seat below it: after a limit was lowered, runs on seats above the new
    limit still count."""
    held = dispatch_table.alias("counted")
    return select(func.count()).where(_holds_seat(held)).correlate(dispatch_table).scalar_subquery()
