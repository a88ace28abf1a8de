"""publish(session=...) and publish(connection=...) inside the caller's transaction."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from questpie_celery import LedgerError, LedgerSchemaError
from tests.conftest import Stack, tag


def test_session_publish_runs_after_commit(pg_redis: Stack) -> None:
    t = tag()
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    with Session(engine) as session, session.begin():
        dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t}, session=session)
        assert dispatch_id is not None
        # Not visible outside the transaction, not sent yet.
        assert pg_redis.ledger.get(dispatch_id) is None
    pg_redis.wait_status(dispatch_id, "completed")
    assert len(pg_redis.wait_runs(t, 1)) == 1
    engine.dispose()


def test_session_rollback_leaves_nothing_and_runs_nothing(pg_redis: Stack) -> None:
    t = tag()
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    with Session(engine) as session:
        session.begin()
        dispatch_id = pg_redis.questpie.queue.record.publish(
            {"tag": t}, session=session, idempotency_key=f"rb:{t}"
        )
        session.rollback()
    assert dispatch_id is not None
    assert pg_redis.ledger.get(dispatch_id) is None
    assert pg_redis.wait_runs(t, 1, timeout=2) == []
    engine.dispose()


def test_rolled_back_savepoint_is_not_sent_after_commit(pg_redis: Stack) -> None:
    t = tag()
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    with Session(engine) as session, session.begin():
        kept = pg_redis.questpie.queue.record.publish({"tag": t + "-kept"}, session=session)
        nested = session.begin_nested()
        dropped = pg_redis.questpie.queue.record.publish({"tag": t}, session=session)
        nested.rollback()
    assert kept is not None and dropped is not None
    pg_redis.wait_status(kept, "completed")
    assert pg_redis.ledger.get(dropped) is None
    assert pg_redis.wait_runs(t, 1, timeout=2) == []
    engine.dispose()


def test_connection_publish_is_sent_by_the_relay_after_commit(pg_redis: Stack) -> None:
    t = tag()
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    with engine.begin() as conn:
        dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t}, connection=conn)
        assert dispatch_id is not None
        assert pg_redis.ledger.get(dispatch_id) is None  # not committed yet
    # Nothing in this process sends it: the relay inside the worker does.
    pg_redis.wait_status(dispatch_id, "completed")
    # The relay's send was accepted by the broker (recorded in a batch moments later).
    deadline = time.monotonic() + 5
    while (row := pg_redis.ledger.get(dispatch_id)) and row.queued_at is None:
        assert time.monotonic() < deadline, "the relay's send was never recorded"
        time.sleep(0.05)
    assert len(pg_redis.wait_runs(t, 1)) == 1
    engine.dispose()


def test_connection_rollback_leaves_nothing(pg_redis: Stack) -> None:
    t = tag()
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    with engine.connect() as conn:
        transaction = conn.begin()
        dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t}, connection=conn)
        transaction.rollback()
    assert dispatch_id is not None
    assert pg_redis.ledger.get(dispatch_id) is None
    assert pg_redis.wait_runs(t, 1, timeout=3) == []
    engine.dispose()


def test_session_on_a_database_without_the_ledger_says_so(pg_redis: Stack, tmp_path: str) -> None:
    engine = create_engine(f"sqlite:///{tmp_path}/other.sqlite3")
    with Session(engine) as session, pytest.raises(LedgerSchemaError, match="migrate"):
        pg_redis.questpie.queue.record.publish({"tag": "x"}, session=session)
    engine.dispose()


def test_a_callers_open_transaction_does_not_hang_other_publishers(pg_redis: Stack) -> None:
    """The slot row of an uncommitted transaction makes a rival publish wait, not hang."""
    t, key = tag(), f"open-tx-{tag()}"
    client = pg_redis.questpie.queue.policy_exclusive
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    outcome: list[BaseException | str | None] = []

    def rival() -> None:
        try:
            outcome.append(client.publish({"tag": t}, singleton_key=key))
        except BaseException as exc:
            outcome.append(exc)

    with Session(engine) as session, session.begin():
        assert client.publish({"tag": t}, singleton_key=key, session=session) is not None
        thread = threading.Thread(target=rival)
        thread.start()
        thread.join(60)
        assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], LedgerError)
    assert "lock_timeout" in str(outcome[0])
    engine.dispose()
