"""The hottest statements on the driver's cursor (PostgreSQL, ledger/direct.py): the same
SQL and rows as SQLAlchemy's, every execution listener, error handler and statement log
still sees them, an engine of one's own keeps its options, and a held row costs one lock
timeout."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import bindparam, create_engine, event, select, text

from questpie_celery import LedgerBusyError
from questpie_celery.jobs.policies import QueuePolicy
from questpie_celery.ledger import DispatchRow, Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.direct import DriverStatement
from questpie_celery.ledger.schema import UTCDateTime
from questpie_celery.ledger.statements import by_id
from tests.support.ledgers import JOB, claimed, drop_connections, lock_timeouts, new_row, row_of
from tests.support.services import PostgresServer


@contextmanager
def _listening(ledger: Ledger, name: str, listener: Callable[..., Any]) -> Iterator[None]:
    """`listener` on the ledger's engine's event `name` for the block's length."""
    event.listen(ledger.engine, name, listener)
    try:
        yield
    finally:
        event.remove(ledger.engine, name, listener)


def test_the_fences_statements_on_the_drivers_cursor_are_sqlalchemys_own(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish's insert, the claim, the renewal and the outcome run on psycopg's cursor
    (see ledger/direct.py): the same SQL SQLAlchemy runs, rows of the same values and
    types; and while something listens to SQLAlchemy's cursor events, they go through it."""
    direct_runs: list[str] = []  # the SQL of each statement run on the driver's cursor
    real_run = DriverStatement.run

    def counted(self: DriverStatement, conn: Any, params: Any) -> Any:
        direct_runs.append(self.sql)
        return real_run(self, conn, params)

    def kinds() -> list[str]:
        return [sql.split()[0] for sql in direct_runs]

    monkeypatch.setattr(DriverStatement, "run", counted)
    shortcut, token = claimed(pg_ledger)
    assert pg_ledger.claims.renew(shortcut, token, 60) is True
    assert kinds() == ["INSERT", "UPDATE", "UPDATE"]
    # Our own claim again (a try whose reply was lost): nothing matches, the row is read.
    claimed_direct = pg_ledger.claims.claim(shortcut, JOB, 1, 60, token)
    assert claimed_direct.outcome == "claimed" and len(direct_runs) == 4
    assert claimed_direct.row == row_of(pg_ledger, shortcut)

    seen: list[str] = []

    def listener(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    with _listening(pg_ledger, "before_cursor_execute", listener):
        traced, traced_token = claimed(pg_ledger)
        assert pg_ledger.claims.finish(traced, traced_token, "completed", None) is True
    assert len(direct_runs) == 4, "a listened-to engine's statement skipped SQLAlchemy"
    assert direct_runs[0] in seen and direct_runs[1] in seen, (
        "the driver's SQL is not the one SQLAlchemy runs"
    )
    # The claim's row, as each path returns it: the same values, of the same types.
    fresh = new_row(idempotency_key=None)
    assert pg_ledger.dispatches.insert(fresh)
    through_driver = pg_ledger.claims.claim(fresh.id, JOB, 1, 60)
    assert kinds()[4:] == ["INSERT", "UPDATE"]
    assert through_driver.row is not None
    by_sqlalchemy = row_of(pg_ledger, fresh.id)
    assert through_driver.row == by_sqlalchemy
    for name in DispatchRow.__dataclass_fields__:
        ours, theirs = getattr(through_driver.row, name), getattr(by_sqlalchemy, name)
        assert type(ours) is type(theirs), name
    assert pg_ledger.claims.finish(fresh.id, through_driver.token or "", "completed", None) is True
    assert len(direct_runs) == 7
    assert row_of(pg_ledger, fresh.id).status == "completed"


@pytest.mark.parametrize(
    "name",
    [
        "before_execute",
        "after_execute",
        "before_cursor_execute",
        "after_cursor_execute",
        "begin",
        "commit",
        "rollback",
        "handle_error",
    ],
)
def test_a_listener_of_any_execution_event_sees_the_hottest_statements(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Tracing and error listeners see every statement: none takes the driver's cursor
    past them."""
    direct_runs: list[str] = []
    real_run = DriverStatement.run

    def counted(self: DriverStatement, conn: Any, params: Any) -> Any:
        direct_runs.append(self.sql)
        return real_run(self, conn, params)

    monkeypatch.setattr(DriverStatement, "run", counted)
    assert pg_ledger.dispatches.insert(new_row()) is True
    assert len(direct_runs) == 1  # unwatched: on the driver's cursor
    heard: list[object] = []
    with _listening(pg_ledger, name, lambda *args, **_: heard.append(args)):
        dispatch_id, token = claimed(pg_ledger)
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    assert len(direct_runs) == 1, f"a statement skipped the {name} listener"
    if name.endswith("execute"):  # (nothing failed, and autocommit commits nothing)
        assert heard


def test_sqlalchemys_statement_log_shows_the_hottest_statements_too(
    pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """With SQLAlchemy's statement log on (`echo`, or its logger at INFO), the insert, the
    claim and the outcome are logged like every other statement."""
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"):
        dispatch_id, token = claimed(pg_ledger)
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    logged = [
        r.getMessage().split()[0] for r in caplog.records if r.name.startswith("sqlalchemy.engine")
    ]
    assert logged.count("INSERT") == 1 and logged.count("UPDATE") == 2, logged


def test_listeners_of_the_engines_execution_and_errors_see_the_hottest_statements(
    pg_ledger: Ledger,
) -> None:
    """A listener of statements (`before_execute`) or of their errors (`handle_error`)
    sees the insert, the claim and the outcome as every other statement: none of them
    takes the driver's cursor while one listens."""
    seen: list[str] = []
    heard: list[str] = []

    def before(conn: Any, clauseelement: Any, *_: Any) -> None:
        seen.append(type(clauseelement).__name__)

    def on_error(context: Any) -> None:
        heard.append(getattr(context.original_exception, "sqlstate", None) or "?")

    with _listening(pg_ledger, "before_execute", before):
        dispatch_id, token = claimed(pg_ledger)
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    assert seen.count("Insert") == 1 and seen.count("Update") == 2, seen
    with _listening(pg_ledger, "handle_error", on_error):
        first = new_row(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
        second = new_row(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
        assert pg_ledger.dispatches.insert(first) and pg_ledger.dispatches.insert(second)
        assert pg_ledger.claims.claim(first.id, JOB, 1, 60).outcome == "claimed"
        assert pg_ledger.claims.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert heard == ["23505"], heard  # the slot index's unique violation


def test_a_failure_on_the_drivers_cursor_is_sqlalchemys_to_handle(
    postgres: PostgresServer, pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement that fails on the driver's cursor runs through SQLAlchemy, which finds
    what went wrong as for any statement: here a slot index refusing a second run of a
    singleton slot (SlotTaken, a blocked claim), and a dropped connection (reconnected)."""
    first = new_row(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
    second = new_row(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
    assert pg_ledger.dispatches.insert(first) and pg_ledger.dispatches.insert(second)
    assert pg_ledger.claims.claim(first.id, JOB, 1, 60).outcome == "claimed"
    assert pg_ledger.claims.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert row_of(pg_ledger, second.id).status == "pending"
    drop_connections(postgres, pg_ledger)
    with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
        assert pg_ledger.claims.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert any("reconnecting" in r.getMessage() for r in caplog.records)


def test_a_handle_error_listener_that_counts_more_errors_as_disconnects_still_works(
    pg_ledger: Ledger,
) -> None:
    """SQLAlchemy's way to treat another error as a dropped connection (a `handle_error`
    listener setting `is_disconnect`; here a read-only server, as a primary demoted in a
    failover) holds for the fence's statements: the pool drops the connection and the
    outcome is written on a fresh one."""

    def on_error(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == "25006":  # read only
            context.is_disconnect = True

    with _listening(pg_ledger, "handle_error", on_error):
        dispatch_id, token = claimed(pg_ledger)
        with pg_ledger.engine.connect() as conn:  # the pool's one idle connection
            conn.exec_driver_sql("SET default_transaction_read_only = on")
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    assert row_of(pg_ledger, dispatch_id).status == "completed"


def test_a_select_on_the_drivers_cursor_returns_rows_and_escaped_names_bind(
    pg_ledger: Ledger,
) -> None:
    """A SELECT returns its rows, as through SQLAlchemy, not a row count; and a bind whose
    name SQLAlchemy escapes (a space) gets its value, through its type's processor."""
    new = new_row()
    assert pg_ledger.dispatches.insert(new) is True
    exists = DriverStatement(select(dispatch_table.c.id).where(by_id()), pg_ledger.engine)
    with pg_ledger.engine.connect() as conn:
        assert exists.run(conn, {"dispatch_id": new.id}) == [{"id": new.id}]
        t = dispatch_table.c
        due = DriverStatement(
            select(t.id).where(
                t.id == new.id, t.run_after < bindparam("due by", type_=UTCDateTime)
            ),
            pg_ledger.engine,
        )
        assert due.run(conn, {"due by": datetime.now(UTC) + timedelta(hours=1)}) == [{"id": new.id}]


def test_a_ledger_on_an_engine_of_ones_own_keeps_its_execution_options(
    pg_ledger: Ledger,
) -> None:
    """An engine passed in may map the ledger's tables to another schema: a statement
    compiled once would not know the map, so only the ledger's own engines take the
    driver's cursor, and a tenant's rows stay in the tenant's tables."""
    url = pg_ledger.engine.url.render_as_string(hide_password=False)
    plain = create_engine(url)
    with plain.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant"))
    tenant = Ledger(plain.execution_options(schema_translate_map={None: "tenant"}))
    try:
        tenant.migration.migrate()
        new = new_row()
        assert tenant.dispatches.insert(new) is True
        claim = tenant.claims.claim(new.id, JOB, 1, 60)
        assert claim.outcome == "claimed" and claim.token is not None
        assert tenant.claims.finish(new.id, claim.token, "completed", None) is True
        assert pg_ledger.get(new.id) is None, "the tenant's row went into the other ledger"
        assert row_of(tenant, new.id).status == "completed"
    finally:
        tenant.close()
        plain.dispose()


def test_a_claim_meeting_a_held_row_waits_the_lock_timeout_once(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's transaction holds the row: the claim fails with LedgerBusyError after one
    lock timeout (PG_LOCK_TIMEOUT_MS); an error of the database on the driver's cursor is
    not run again, on that cursor or through SQLAlchemy."""
    locked = new_row()
    assert pg_ledger.dispatches.insert(locked)
    caller = create_engine(pg_ledger.engine.url.render_as_string(hide_password=False))
    try:
        with caller.begin() as conn:
            conn.execute(
                select(dispatch_table.c.id)
                .where(dispatch_table.c.id == locked.id)
                .with_for_update()
            )
            with lock_timeouts(monkeypatch) as timeouts, pytest.raises(LedgerBusyError):
                pg_ledger.claims.claim(locked.id, JOB, 1, 60)
    finally:
        caller.dispose()
    assert len(timeouts) == 1, timeouts
    assert row_of(pg_ledger, locked.id).status == "pending"


def test_only_the_ledgers_own_postgresql_engines_share_inserts(pg_db: str) -> None:
    """A shared statement cannot let a row go: on an engine without the ledger's lock
    timeout, one meeting a row that a publishing thread's own open transaction holds would
    hold that thread up for good. So threads share inserts on the ledger's own engines
    only (and never on SQLite, whose multi-row insert is an insert per row)."""
    own = open_ledger(pg_db)
    passed_in = Ledger(create_engine(pg_db))
    try:
        assert own.dispatches.inserts_in_batches is True
        assert passed_in.dispatches.inserts_in_batches is False
    finally:
        own.close()
        passed_in.close()
