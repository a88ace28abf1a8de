"""The ledger's connections (PostgreSQL): dropped by the server (each operation reconnects
once, a finish reads back whether it landed), a statement interrupted by a signal on the
connection the process keeps, and a server that stays down."""

from __future__ import annotations

import logging
import signal
import threading

import pytest
from sqlalchemy import func, select

from questpie_celery import LedgerUnavailableError
from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.ledger import Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.hot import HotConnection
from tests.support.ledgers import JOB, claimed, drop_connections, new_row, row_of
from tests.support.services import PostgresServer, free_port
from tests.support.tracing import at_line


def test_finish_after_a_dropped_connection_reconnects_once(
    postgres: PostgresServer, pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    dispatch_id, token = claimed(pg_ledger)
    drop_connections(postgres, pg_ledger)
    with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    assert any("reconnecting" in r.getMessage() for r in caplog.records), (
        "the statement did not meet the dropped connection"
    )
    row = row_of(pg_ledger, dispatch_id)
    assert (row.status, row.claim_token) == ("completed", token)


@pytest.mark.parametrize("operation", ["insert", "claim", "renew", "retry", "get", "mark_queued"])
def test_each_operation_survives_a_dropped_connection(
    postgres: PostgresServer, pg_ledger: Ledger, operation: str
) -> None:
    dispatch_id, token = claimed(pg_ledger)
    drop_connections(postgres, pg_ledger)
    if operation == "insert":
        assert pg_ledger.dispatches.insert(new_row()) is True
    elif operation == "claim":
        fresh = random_dispatch_id()
        # Insert first (reconnecting), then drop again before the claim.
        assert pg_ledger.dispatches.insert(new_row(fresh)) is True
        drop_connections(postgres, pg_ledger)
        assert pg_ledger.claims.claim(fresh, JOB, 1, 60).outcome == "claimed"
    elif operation == "renew":
        assert pg_ledger.claims.renew(dispatch_id, token, 60) is True
    elif operation == "retry":
        assert pg_ledger.claims.retry(dispatch_id, token, retry_in=1, relay_in=2, error="E") is True
        assert row_of(pg_ledger, dispatch_id).status == "retry"
    elif operation == "get":
        assert row_of(pg_ledger, dispatch_id).status == "active"
    else:
        queued = new_row()
        assert pg_ledger.dispatches.insert(queued) is True
        drop_connections(postgres, pg_ledger)
        pg_ledger.dispatches.mark_queued([queued.id], 60)
        assert row_of(pg_ledger, queued.id).status == "queued"


def test_finish_twice_across_a_dropped_connection(
    postgres: PostgresServer, pg_ledger: Ledger
) -> None:
    dispatch_id, token = claimed(pg_ledger)
    assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    drop_connections(postgres, pg_ledger)
    # The first write landed: run again on a fresh connection, it reads back True.
    assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
    drop_connections(postgres, pg_ledger)
    assert pg_ledger.claims.finish(dispatch_id, "another-token", "completed", None) is False


class _Interrupted(Exception):
    """What a signal handler raises in the middle of a statement (a soft time limit)."""


def test_a_statement_interrupted_on_the_kept_connection_leaves_it_to_the_pool(
    pg_ledger: Ledger,
) -> None:
    """The hottest statements share one connection the process keeps (ledger/hot.py). A
    statement interrupted while the server still works on it must not leave that
    connection to the next statement, which would read the interrupted one's answer."""
    assert pg_ledger.dispatches.insert(new_row()) is True  # the kept connection now exists
    contested = new_row()
    caller = pg_ledger.engine.execution_options(isolation_level="READ COMMITTED")

    def interrupt(*_: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    with caller.connect() as holder:
        transaction = holder.begin()
        # Another transaction's uncommitted row under the same id: the insert waits for it.
        assert pg_ledger.dispatches.insert(contested, holder) is True
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(_Interrupted):
                pg_ledger.dispatches.insert(contested)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # While the interrupted insert still waits on the server: each next statement
        # gets its own answer.
        other = new_row(idempotency_key="other")
        assert pg_ledger.dispatches.insert(other) is True
        assert row_of(pg_ledger, other.id).idempotency_key == "other"
        dispatch_id, token = claimed(pg_ledger)
        assert pg_ledger.claims.finish(dispatch_id, token, "completed", None) is True
        transaction.rollback()
    # The interrupted insert may still land once the lock is gone: never twice.
    assert pg_ledger.dispatches.insert(contested) in (True, False)
    with pg_ledger.engine.connect() as conn:
        rows = conn.execute(
            select(func.count())
            .select_from(dispatch_table)
            .where(dispatch_table.c.id == contested.id)
        ).scalar()
    assert rows == 1
    assert row_of(pg_ledger, dispatch_id).status == "completed"


@pytest.mark.parametrize(
    "where",
    [
        "try:",  # the turn taken, before anything can give it back: the narrowest window
        "conn = self._kept.pop() if self._kept else self._open()",
        "if not conn.closed:",
        "self._turn.release()",
    ],
)
def test_a_signal_anywhere_in_taking_the_kept_connection_never_hangs(
    pg_ledger: Ledger, where: str
) -> None:
    """A signal's exception (a soft time limit) can land on any line of the short cut:
    afterwards the statements still get their answers, and closing the ledger (which
    `Questpie.close()` and the test plugin's rebinding do) returns."""
    known = new_row()
    assert pg_ledger.dispatches.insert(known) is True

    def interrupt() -> None:
        raise _Interrupted

    with at_line(HotConnection.connect, where, interrupt), pytest.raises(_Interrupted):
        pg_ledger.dispatches.exists(known.id)
    for _ in range(3):  # (a turn the signal took away leaves them to the pool)
        assert pg_ledger.dispatches.exists(known.id) is True
        assert pg_ledger.dispatches.exists(random_dispatch_id()) is False
    closing = threading.Thread(target=pg_ledger.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "closing the ledger hung"
    assert pg_ledger.dispatches.insert(new_row()) is True


def test_a_ledger_that_stays_down_raises_unavailable() -> None:
    ledger = open_ledger(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    try:
        with pytest.raises(LedgerUnavailableError):
            ledger.get(random_dispatch_id())
    finally:
        ledger.close()
