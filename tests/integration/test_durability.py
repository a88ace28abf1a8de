"""`durability="relaxed"`: how the ledger commits, and what the fence does with a
delivery whose row a database crash lost. Real PostgreSQL, Redis and workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, delete, event, text

from questpie_celery import ConfigurationError, Questpie
from questpie_celery.jobs.options import FIRE_KEY_PREFIX, DispatchOptions, RunOptions
from questpie_celery.ledger import create_ledger_engine, dispatch_table
from tests.support import jobapp
from tests.support.brokers import capture, deliver
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

StackFactory = Callable[..., Stack]
RELAXED = {"QP_TEST_DURABILITY": "relaxed"}
SECRET = "s" * 16 + "-test-secret-0123456789abcdef"


def own_engine(stack: Stack) -> Engine:
    """The engine the stack's Questpie made for its ledger (not the test's own)."""
    engine: Engine = stack.questpie._ledger.engine
    return engine


def test_postgresql_commits_asynchronously_only_when_relaxed(make_stack: StackFactory) -> None:
    durable = make_stack("redis", start_worker=False)
    relaxed = make_stack("redis", start_worker=False, env=RELAXED)
    # The suite's server runs without fsync for speed: what matters is who set what.
    query = "SELECT setting, source FROM pg_settings WHERE name = 'synchronous_commit'"
    with own_engine(durable).connect() as conn:
        assert conn.exec_driver_sql(query).one().source != "client"  # the server's choice
    with own_engine(relaxed).connect() as conn:
        assert tuple(conn.exec_driver_sql(query).one()) == ("off", "client")


def test_sqlite_syncs_every_commit_unless_relaxed(tmp_path: Any) -> None:
    full = create_ledger_engine(f"sqlite:///{tmp_path / 'a.db'}")
    normal = create_ledger_engine(f"sqlite:///{tmp_path / 'b.db'}", relaxed=True)
    with full.connect() as a, normal.connect() as b:
        assert a.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert b.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    full.dispose()
    normal.dispose()


def test_relaxed_needs_a_ledger_url() -> None:
    engine = create_ledger_engine("sqlite://")
    with pytest.raises(ConfigurationError, match="needs ledger_url"):
        Questpie(Celery("x"), engine=engine, durability="relaxed")
    with pytest.raises(ConfigurationError, match="'durable' or 'relaxed'"):
        Questpie(Celery("y"), ledger_url="sqlite://", durability="fast")  # type: ignore[arg-type]


def test_a_secret_row_commits_durably_even_when_relaxed(make_stack: StackFactory) -> None:
    stack = make_stack("redis", start_worker=False, env={**RELAXED, "QP_TEST_SECRET": SECRET})
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()[:2]))

    engine = own_engine(stack)
    event.listen(engine, "before_cursor_execute", record)
    try:
        stack.questpie.queue.record.publish({"tag": tag()}, idempotency_key=tag(), queue="idle")
        plain = list(seen)
        seen.clear()
        stack.questpie.queue["secret.link"].publish(
            {"tag": tag(), "link": "l"}, idempotency_key=tag(), secret_payload=True, queue="idle"
        )
        secret = list(seen)
        seen.clear()
        stack.questpie.queue["secret.link"].publish_many(
            [{"tag": tag(), "link": "l"}], idempotency_keys=[tag()], secret_payload=True
        )
        secret_many = list(seen)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert "SET LOCAL" not in plain
    # In one transaction of its own, told to wait for the disk after its INSERT (so that
    # no setting made by the INSERT itself, as a pooled ledger's do, can undo it), before
    # the commit, where it counts.
    for statements in (secret, secret_many):
        assert statements.index("INSERT INTO") < statements.index("SET LOCAL")


def lose_row(stack: Stack, dispatch_id: str) -> None:
    """What a database crash does to a commit that had not reached the disk."""
    with stack.ledger.engine.begin() as conn:
        conn.execute(delete(dispatch_table).where(dispatch_table.c.id == dispatch_id))


@pytest.mark.parametrize("durability", ["relaxed", "durable"])
def test_a_delivery_whose_row_was_lost_runs_once_when_relaxed(
    make_stack: StackFactory, durability: str
) -> None:
    env = RELAXED if durability == "relaxed" else {}
    stack = make_stack("redis", start_worker=False, env=env)
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t)
    assert dispatch_id is not None
    message = capture(stack, stack.queue_name)
    lose_row(stack, dispatch_id)
    deliver(stack, message, copies=2)  # and the broker delivers it twice
    stack.worker.start()
    if durability == "durable":
        # A durable ledger never loses a committed row: a delivery without one is not ours.
        stack.wait_log(dispatch_id, "skipped (unknown)")
        assert stack.runs(t) == []
        return
    stack.wait_runs(t, 1)
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    stack.wait_log(dispatch_id, "skipped")  # the second copy
    assert len(stack.runs(t)) == 1
    # The key still answers with the same id and runs nothing more.
    assert stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t) == dispatch_id
    assert len(stack.runs(t)) == 1


def test_a_lost_row_of_a_policy_job_is_not_rebuilt(make_stack: StackFactory) -> None:
    stack = make_stack("redis", start_worker=False, env=RELAXED)
    t = tag()
    dispatch_id = stack.questpie.queue["policy.exclusive"].publish({"tag": t})
    assert dispatch_id is not None
    message = capture(stack, stack.queue_name)
    lose_row(stack, dispatch_id)
    deliver(stack, message)
    stack.worker.start()
    stack.wait_log(dispatch_id, "cannot rebuild it")
    assert stack.runs(t) == []
    with stack.ledger.engine.connect() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM questpie_queue_dispatch WHERE id = :i"), {"i": dispatch_id}
        ).scalar()
    assert count == 0


def test_a_stale_copy_of_a_pruned_dispatch_is_not_taken_back(make_stack: StackFactory) -> None:
    # Fire rows are kept 4 s here, so a message older than 2 s may be a pruned row's.
    stack = make_stack("redis", start_worker=False, env={**RELAXED, "QP_TEST_FIRE_RETENTION": "4"})
    t = tag()
    key = f"{FIRE_KEY_PREFIX}call:{t}"
    # Published as a schedule's fire is (a user's publish may not take a key there).
    fire = DispatchOptions(run=RunOptions(), idempotency_key=key)
    dispatch_id = stack.questpie._publisher.publish(jobapp.record_job, {"tag": t}, fire)
    assert dispatch_id is not None
    message = capture(stack, stack.queue_name)
    deliver(stack, message)  # the copy that runs
    stack.worker.start()
    stack.wait_status(dispatch_id, "completed")
    # Pruned once it is 4 s old: its message, published before, is older still.
    wait_until(
        lambda: stack.ledger.retention.prune_schedule_history(
            key_prefix=FIRE_KEY_PREFIX, older_than=4, limit=10
        ),
        "the fire's row old enough to prune",
    )
    deliver(stack, message)  # a stale duplicate: a redelivery, a copy the relay sent
    stack.wait_log(dispatch_id, "older than rows the ledger has pruned")
    assert len(stack.runs(t)) == 1


def test_on_sqlite_a_secret_row_syncs_its_commit_even_when_relaxed(tmp_path: Path) -> None:
    app, questpie = jobapp.build(
        broker="memory://",
        ledger=f"sqlite:///{tmp_path / 'l.db'}",
        secret=SECRET,
        durability="relaxed",
    )
    questpie.migrate()
    seen: list[str] = []
    engine = questpie._ledger.engine

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(" ".join(statement.split()[:2]))

    event.listen(engine, "before_cursor_execute", record)
    try:
        questpie.queue["secret.link"].publish(
            {"tag": "t", "link": "l"}, idempotency_key="k", secret_payload=True, queue="idle"
        )
    finally:
        event.remove(engine, "before_cursor_execute", record)
        questpie.close()
    first, insert = seen.index("PRAGMA synchronous=FULL"), seen.index("INSERT INTO")
    assert first < insert < seen.index("PRAGMA synchronous=NORMAL")
    del app
