"""publish(session=...) and publish(connection=...) inside the caller's own transaction.

A session's rows are sent by the publishing process once the outermost transaction
commits (savepoints commit nothing); a connection's rows by the worker's relay. The
relay leaves a session's fresh row alone for `PENDING_GRACE_SECONDS` (30 s), so a
message that reaches an idle queue within a few seconds of the commit was sent by the
publisher itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.orm import Session

from questpie_celery import (
    LedgerError,
    LedgerSchemaError,
    PublishOptionsError,
    derive_dispatch_id,
)
from questpie_celery.ledger import dispatch_table, open_ledger
from tests.support.brokers import capture, deliver, idle_queue, queue_depth
from tests.support.services import PostgresServer
from tests.support.stack import Stack, tag

#: A publisher's after-commit send must reach the broker well within this.
PROMPT_SECONDS = 5.0


@pytest.fixture(scope="module")
def caller_engine(pg_redis: Stack) -> Iterator[Engine]:
    """The application's own engine on the ledger's database (not the ledger's engine)."""
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    yield engine
    engine.dispose()


def dispatch_rows(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(dispatch_table)).scalar_one())
    finally:
        engine.dispose()


def assert_sent_promptly(stack: Stack, idle: str, dispatch_id: str) -> None:
    """The dispatch's first message is in `idle`, sent by the publisher after the commit
    (the relay, which leaves the fresh row alone for PENDING_GRACE_SECONDS, never took
    it), and it is a message the worker runs exactly once."""
    message = capture(stack, idle, timeout=PROMPT_SECONDS)
    assert message.headers["id"] == dispatch_id
    assert message.headers["questpie"]["attempt"] == 1
    # A relay's send counts itself on the row (until a claim); the publisher's does not.
    assert stack.row(dispatch_id).send_count == 0
    assert queue_depth(stack, idle) == 0  # one message, not two
    deliver(stack, message)
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1


# --- publish(session=...) ------------------------------------------------------------------


def test_session_publish_runs_after_commit(pg_redis: Stack, caller_engine: Engine) -> None:
    t = tag()
    with Session(caller_engine) as session, session.begin():
        dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t}, session=session)
        assert dispatch_id is not None
        # Not visible outside the transaction, so not sent yet.
        assert pg_redis.ledger.get(dispatch_id) is None
    pg_redis.wait_status(dispatch_id, "completed")
    assert len(pg_redis.runs(t)) == 1


def test_session_publish_in_released_savepoint_is_sent_promptly_after_outer_commit(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    t, idle = tag(), idle_queue()
    with Session(caller_engine) as session, session.begin():
        with session.begin_nested():
            dispatch_id = pg_redis.questpie.queue.record.publish(
                {"tag": t}, session=session, queue=idle, idempotency_key=f"sp:{t}"
            )
        # The savepoint is released, but nothing is committed: nothing may be sent yet.
        assert dispatch_id is not None
        assert queue_depth(pg_redis, idle) == 0
        assert pg_redis.ledger.get(dispatch_id) is None
    assert_sent_promptly(pg_redis, idle, dispatch_id)
    assert [r["attempt"] for r in pg_redis.runs(t)] == [1]


@pytest.mark.parametrize("savepoint_ends", ["released", "rolled back"])
def test_session_publish_before_an_unrelated_savepoint_is_sent_promptly(
    pg_redis: Stack, caller_engine: Engine, savepoint_ends: str
) -> None:
    t, idle = tag(), idle_queue()
    with Session(caller_engine) as session, session.begin():
        dispatch_id = pg_redis.questpie.queue.record.publish(
            {"tag": t}, session=session, queue=idle, idempotency_key=f"unrelated:{t}"
        )
        nested = session.begin_nested()
        # Some unrelated work of the application's in the savepoint.
        assert session.execute(select(func.count()).select_from(dispatch_table)).scalar_one() > 0
        if savepoint_ends == "released":
            nested.commit()
        else:
            nested.rollback()
        assert queue_depth(pg_redis, idle) == 0
    assert dispatch_id is not None
    assert_sent_promptly(pg_redis, idle, dispatch_id)
    assert [r["attempt"] for r in pg_redis.runs(t)] == [1]


def test_session_publish_in_rolled_back_savepoint_is_gone_and_never_sent(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    t, idle = tag(), idle_queue()
    with Session(caller_engine) as session, session.begin():
        kept = pg_redis.questpie.queue.record.publish(
            {"tag": t + "-kept"}, session=session, queue=idle
        )
        nested = session.begin_nested()
        dropped = pg_redis.questpie.queue.record.publish(
            {"tag": t}, session=session, queue=idle, idempotency_key=f"dropped:{t}"
        )
        nested.rollback()
    assert kept is not None and dropped is not None
    # Both would be sent by the same after-commit call: once the kept one is in the
    # queue, anything the commit sent is.
    message = capture(pg_redis, idle, timeout=PROMPT_SECONDS)
    assert message.headers["id"] == kept
    assert queue_depth(pg_redis, idle) == 0
    assert pg_redis.ledger.get(dropped) is None
    assert pg_redis.ledger.get(kept) is not None
    # The key was never spent: publishing it again now writes a new row.
    again = pg_redis.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"dropped:{t}", queue=idle
    )
    assert again == dropped
    assert capture(pg_redis, idle, timeout=PROMPT_SECONDS).headers["id"] == dropped


def test_session_rollback_leaves_nothing_and_sends_nothing(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    t, idle = tag(), idle_queue()
    with Session(caller_engine) as session:
        session.begin()
        dropped = pg_redis.questpie.queue.record.publish(
            {"tag": t}, session=session, queue=idle, idempotency_key=f"rb:{t}"
        )
        session.rollback()
        assert dropped is not None
        assert pg_redis.ledger.get(dropped) is None
        # The same session goes on: its next commit must send only what it published.
        with session.begin():
            kept = pg_redis.questpie.queue.record.publish(
                {"tag": t + "-next"}, session=session, queue=idle
            )
    assert kept is not None
    message = capture(pg_redis, idle, timeout=PROMPT_SECONDS)
    assert message.headers["id"] == kept
    assert queue_depth(pg_redis, idle) == 0
    assert pg_redis.ledger.get(dropped) is None


def test_session_on_another_ledger_database_is_refused_before_writing(
    pg_redis: Stack, postgres: PostgresServer
) -> None:
    """A second database with its own ledger tables: a row there would never be sent."""
    other_url = postgres.create_database("other")
    other = open_ledger(other_url)
    other.migration.migrate()
    other.close()
    engine = create_engine(other_url)
    t = tag()
    key = f"other-db:{t}"
    try:
        with (
            Session(engine) as session,
            session.begin(),
            pytest.raises(PublishOptionsError, match="not the one"),
        ):
            pg_redis.questpie.queue.record.publish({"tag": t}, session=session, idempotency_key=key)
        with engine.begin() as conn, pytest.raises(PublishOptionsError, match="not the one"):
            pg_redis.questpie.queue.record.publish({"tag": t}, connection=conn)
        # Asked again (the answer is cached per engine), still refused.
        with Session(engine) as session, session.begin(), pytest.raises(PublishOptionsError):
            pg_redis.questpie.queue.record.publish({"tag": t}, session=session, idempotency_key=key)
    finally:
        engine.dispose()
    assert dispatch_rows(other_url) == 0
    assert pg_redis.ledger.get(derive_dispatch_id("record", key)) is None
    assert pg_redis.runs(t) == []


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_session_on_a_database_without_the_ledger_says_to_migrate(
    pg_redis: Stack, postgres: PostgresServer, tmp_path: Path, dialect: str
) -> None:
    url = (
        postgres.create_database("bare")
        if dialect == "postgresql"
        else f"sqlite:///{tmp_path / 'bare.sqlite3'}"
    )
    engine = create_engine(url)
    try:
        with Session(engine) as session, pytest.raises(LedgerSchemaError, match="migrate"):
            pg_redis.questpie.queue.record.publish({"tag": "x"}, session=session)
        with engine.connect() as conn, pytest.raises(LedgerSchemaError, match="migrate"):
            pg_redis.questpie.queue.record.publish({"tag": "x"}, connection=conn)
    finally:
        engine.dispose()


# --- publish(connection=...) -------------------------------------------------------------


def test_connection_publish_is_sent_by_the_relay_after_commit(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    t, idle = tag(), idle_queue()
    with caller_engine.begin() as conn:
        dispatch_id = pg_redis.questpie.queue.record.publish(
            {"tag": t}, connection=conn, queue=idle
        )
        assert dispatch_id is not None
        assert pg_redis.ledger.get(dispatch_id) is None  # not committed yet
    # Nothing in this process sends it (a connection has no after-commit hook): the
    # relay in the worker does, on its next pass, and counts the send on the row.
    message = capture(pg_redis, idle, timeout=20)
    assert message.headers["id"] == dispatch_id
    assert pg_redis.row(dispatch_id).send_count == 1
    assert queue_depth(pg_redis, idle) == 0
    deliver(pg_redis, message)
    assert pg_redis.wait_status(dispatch_id, "completed").attempt == 1
    assert len(pg_redis.runs(t)) == 1


def test_connection_rollback_leaves_nothing_and_sends_nothing(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    t, idle = tag(), idle_queue()
    with caller_engine.connect() as conn:
        transaction = conn.begin()
        dropped = pg_redis.questpie.queue.record.publish({"tag": t}, connection=conn, queue=idle)
        transaction.rollback()
    assert dropped is not None
    assert pg_redis.ledger.get(dropped) is None
    # A committed one to the same queue: once the relay has sent it, a pass that would
    # have sent the rolled-back row (had it survived) has run.
    with caller_engine.begin() as conn:
        kept = pg_redis.questpie.queue.record.publish(
            {"tag": t + "-kept"}, connection=conn, queue=idle
        )
    message = capture(pg_redis, idle, timeout=20)
    assert message.headers["id"] == kept
    assert queue_depth(pg_redis, idle) == 0
    assert pg_redis.ledger.get(dropped) is None


# --- a caller's open transaction -----------------------------------------------------------


def test_a_callers_open_transaction_does_not_hang_other_publishers(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    """The slot row of an uncommitted transaction makes a rival publish fail after the
    ledger's lock_timeout, not wait for as long as the caller keeps it open."""
    t, key = tag(), f"open-tx-{tag()}"
    client = pg_redis.questpie.queue.policy_exclusive
    outcome: list[BaseException | str | None] = []

    def rival() -> None:
        try:
            outcome.append(client.publish({"tag": t + "-rival"}, singleton_key=key))
        except BaseException as exc:
            outcome.append(exc)

    with Session(caller_engine) as session, session.begin():
        held = client.publish({"tag": t}, singleton_key=key, session=session)
        assert held is not None
        thread = threading.Thread(target=rival)
        thread.start()
        thread.join(60)
        # Ended while the caller's transaction is still open: it did not wait for it.
        assert not thread.is_alive(), "the rival publish hung on the caller's transaction"
        assert session.in_transaction()
    assert len(outcome) == 1
    assert isinstance(outcome[0], LedgerError), outcome[0]
    assert "lock_timeout" in str(outcome[0])
    # The caller's dispatch is unharmed: sent after its commit, it runs once.
    assert pg_redis.wait_status(held, "completed").attempt == 1
    assert len(pg_redis.runs(t)) == 1
    assert pg_redis.runs(t + "-rival") == []
