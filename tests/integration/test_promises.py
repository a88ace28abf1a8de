"""Promises the documentation makes about running parts, each held to a test."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import uuid
from datetime import timedelta

import pytest

from questpie_celery import derive_dispatch_id
from questpie_celery.ledger import open_ledger
from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.brokers import capture, deliver, queue_depth
from tests.support.services import PostgresServer
from tests.support.stack import tag
from tests.support.waiting import wait_until


def test_a_run_longer_than_its_lease_is_renewed_and_runs_once(make_stack: StackFactory) -> None:
    stack = make_stack("redis", env={"QP_TEST_LEASE": "1.5", "QP_TEST_RELAY": "0.3"})
    t, gate = tag(), stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=f"long:{t}"
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    # Watch the database's lease move on three times while the run is held open.
    seen = {stack.row(dispatch_id).lease_expires_at}

    def renewed_three_times() -> bool:
        row = stack.row(dispatch_id)
        assert row.status == "active" and row.attempt == 1
        seen.add(row.lease_expires_at)
        return len(seen) >= 4

    wait_until(
        renewed_three_times,
        "the lease to be renewed three times",
        30,
        0.1,
        explain=lambda: f"the lease's ends seen: {sorted(seen)}",
    )
    gate.open()
    assert stack.wait_status(dispatch_id, "completed").attempt == 1
    assert len(stack.runs(t)) == 1


def test_a_retry_delayed_beyond_a_minute_waits_in_the_ledger(make_stack: StackFactory) -> None:
    stack = make_stack("redis")
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"far-retry:{t}", retry_delay=600, queue=idle
    )
    assert dispatch_id is not None
    deliver(stack, capture(stack, idle))  # the first attempt runs on the worker, and fails
    row = stack.wait_status(dispatch_id, "retry")
    assert row.next_send_at is not None
    # Due in 600 s; the relay sends it 60 s before that. No message waits meanwhile.
    assert row.run_after - row.next_send_at == timedelta(seconds=60)
    assert row.started_at is not None
    assert row.run_after - row.started_at > timedelta(seconds=590)
    stack.wait_log(dispatch_id, "the relay sends its retry in 600s")
    assert queue_depth(stack, idle) == 0


def test_a_child_forked_while_other_threads_use_the_pool_starts(
    postgres: PostgresServer,
) -> None:
    """Forking never waits on a lock of the parent's: a thread of the parent may hold the
    pool's at that moment, and no thread of the child would ever release it. So the
    child's reset of the ledger (and of the connection its hottest statements keep) must
    not touch the pool."""
    ledger = open_ledger(postgres.create_database())
    ledger.migration.migrate()
    stop = threading.Event()

    def churn() -> None:  # check pool connections out and in, as busy threads do
        while not stop.is_set():
            with ledger.engine.connect():
                pass

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    stuck = 0
    try:
        for n in range(30):
            assert ledger.dispatches.exists(derive_dispatch_id("record", f"{n}")) is False  # kept
            ready, told = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: past the fork's hooks, it says so and leaves
                os.write(told, b"x")
                os._exit(0)
            os.close(told)
            started, _, _ = select.select([ready], [], [], 5)
            os.close(ready)
            if not started:
                stuck += 1
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert stuck == 0, f"{stuck} of 30 children never got past the fork"
    ledger.close()


def test_the_ledger_pool_is_not_shared_across_fork(
    postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A parent and the child it forked publish at the same time, each on connections of
    its own: on a shared socket, one would read the other's answers, or wait for ever."""
    url = postgres.create_database()
    _, questpie = jobapp.build(broker="memory://", ledger=url)
    questpie.migrate()
    publish = questpie.queue.record.publish
    # The pool now holds a connection, and the hottest statements keep one of their own;
    # a child inheriting either would share its socket.
    assert publish({"tag": "p"}, idempotency_key="before-fork")
    each = 300
    pid = os.fork()
    if pid == 0:  # the child: publish on the inherited Questpie, then leave at once
        signal.alarm(60)  # a child stuck on a shared socket dies, and the test says so
        try:
            ok = all(
                publish({"tag": "c"}, idempotency_key=f"child-{n}")
                == derive_dispatch_id("record", f"child-{n}")
                for n in range(each)
            )
            questpie.close()
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    answers: list[bool] = []

    def parent() -> None:
        answers.extend(
            publish({"tag": "p"}, idempotency_key=f"parent-{n}")
            == derive_dispatch_id("record", f"parent-{n}")
            for n in range(each)
        )

    with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
        publishing = threading.Thread(target=parent, daemon=True)
        publishing.start()
        publishing.join(60)
        assert not publishing.is_alive(), "the parent's publishes hung"
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # And after the child's exit, no statement of the parent meets its connection
        # dropped.
        for n in range(3):
            assert publish({"tag": "p"}, idempotency_key=f"after-{n}")
    assert answers == [True] * each
    assert not any("reconnecting" in record.getMessage() for record in caplog.records)
    assert questpie.queue.get_status(derive_dispatch_id("record", f"child-{each - 1}"))
    questpie.close()
