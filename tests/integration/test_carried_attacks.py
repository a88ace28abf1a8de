"""Attacks on a completion carried by the next claim of its process
(`worker/carried.py`): a carrying claim that meets a row another transaction holds, a
carrying statement whose reply is lost or whose server process is killed mid-wait, and
real prefork workers (Redis and RabbitMQ) whose held completions meet a cancel, a
duplicate message, a secret payload, `--max-tasks-per-child=1`, a threads pool, the
worker's main process killed, and a ledger behind PgBouncer. Each time the run ran once
(or, where a process was killed, at most once more after its lease), and its row ends
as it should."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Connection

from questpie_celery.ledger import CarriedEnd, Claim, Ledger, open_ledger
from tests.integration.conftest import StackFactory
from tests.integration.test_secrets import SECRET, assert_absent, canary, ledger_dump
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.faultproxy import FaultProxy
from tests.support.ledgers import JOB, claimed, new_row, row_of
from tests.support.services import PostgresServer, Worker
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

BROKERS = ["redis", "rabbitmq"]
#: No result backend: only the ledger tells that a run ended, so completions are carried.
NO_RESULTS = {"QP_TEST_BACKEND": ""}


@contextmanager
def row_locked(ledger: Ledger, dispatch_id: str) -> Iterator[Connection]:
    """Another transaction holds the row's lock (an uncommitted publish or cancel, say)
    for the block."""
    with ledger.engine.connect() as conn:
        conn.exec_driver_sql("BEGIN")
        conn.exec_driver_sql(
            "SELECT 1 FROM questpie_queue_dispatch WHERE id = %(id)s FOR UPDATE",
            {"id": dispatch_id},
        )
        try:
            yield conn
        finally:
            conn.exec_driver_sql("ROLLBACK")


def _claim_in_thread(
    ledger: Ledger, dispatch_id: str, carried: CarriedEnd
) -> tuple[threading.Thread, list[Claim | BaseException]]:
    answer: list[Claim | BaseException] = []

    def claim() -> None:
        try:
            answer.append(ledger.claims.claim(dispatch_id, JOB, 1, 60, carried=carried))
        except BaseException as exc:
            answer.append(exc)

    thread = threading.Thread(target=claim, daemon=True)
    thread.start()
    return thread, answer


def test_a_carrying_claim_that_meets_a_held_row_records_the_completion_at_once(
    pg_ledger: Ledger,
) -> None:
    """The claimed row is held by another open transaction: the completion it carries
    does not wait with it (it would outlive a short lease, and the run would run again),
    and the claim then waits for its row as a claim does."""
    ended, token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    with row_locked(pg_ledger, nxt.id):
        thread, answer = _claim_in_thread(pg_ledger, nxt.id, CarriedEnd(ended, token, None))
        wait_until(
            lambda: row_of(pg_ledger, ended).status == "completed",
            "the carried completion to land while the claimed row is held",
            timeout=2.5,  # well inside the 5 s lock timeout the claim itself waits
        )
    thread.join(10)
    [claim] = answer
    assert isinstance(claim, Claim)
    assert (claim.outcome, claim.carried) == ("claimed", True)
    assert row_of(pg_ledger, nxt.id).status == "active"


def test_a_carrying_claim_whose_reply_is_lost_reads_back_both_writes(
    pg_ledger: Ledger, pg_db: str, postgres: PostgresServer, proxy: FaultProxy
) -> None:
    """The statement commits and its reply is lost: the driver runs it again on a fresh
    connection, which matches nothing; the completion is read back as landed, the claim
    as ours, and each row was written once."""
    ended, token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    via = open_ledger(proxy.url(pg_db, postgres.port))
    try:
        proxy.arm(nxt.id.encode())
        claim = via.claims.claim(nxt.id, JOB, 1, 60, carried=CarriedEnd(ended, token, {"json": 1}))
        assert proxy.fired.is_set(), "the carrying claim never went through the proxy"
    finally:
        via.close()
    assert (claim.outcome, claim.carried) == ("claimed", True)
    done, taken = row_of(pg_ledger, ended), row_of(pg_ledger, nxt.id)
    assert (done.status, done.result, done.claim_token) == ("completed", {"json": 1}, token)
    assert (taken.status, taken.attempt, taken.claim_token) == ("active", 1, claim.token)


def test_a_carrying_claim_whose_server_process_is_killed_records_the_completion_once(
    pg_ledger: Ledger, postgres: PostgresServer
) -> None:
    """pg_terminate_backend on the carrying statement while it runs (it waits for the
    completed run's row, which another transaction holds): nothing of it committed, the
    driver runs it again on a fresh connection, and both writes land once."""
    ended, token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    admin = open_ledger(postgres.url())
    try:
        with row_locked(pg_ledger, ended) as holder:
            holder_pid = holder.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            thread, answer = _claim_in_thread(pg_ledger, nxt.id, CarriedEnd(ended, token, None))

            def waiting_pid() -> int | None:
                with admin.engine.connect() as conn:
                    return conn.exec_driver_sql(
                        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND %(holder)s = ANY(pg_blocking_pids(pid))",
                        {"holder": holder_pid},
                    ).scalar()

            pid = wait_until(waiting_pid, "the carrying claim to wait on the held row", 4)
            with admin.engine.connect() as conn:
                assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})").scalar()
            # Run again on a fresh connection: it waits on the held row again.
            wait_until(
                lambda: (found := waiting_pid()) is not None and found != pid,
                "the carrying claim to run again and wait",
                4,
            )
        thread.join(10)
    finally:
        admin.close()
    [claim] = answer
    assert isinstance(claim, Claim), claim
    assert (claim.outcome, claim.carried) == ("claimed", True)
    assert row_of(pg_ledger, ended).status == "completed"
    taken = row_of(pg_ledger, nxt.id)
    assert (taken.status, taken.attempt, taken.claim_token) == ("active", 1, claim.token)


def test_a_carrying_claim_through_sqlalchemy_writes_each_result_to_its_own_row(
    pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """With SQLAlchemy's statement log on (as with any listener of the engine), the
    statement goes through SQLAlchemy, which writes a parameter named as a column to
    that column: the carried result must not become the claimed row's, nor the statement
    fail for a parameter SQLAlchemy then cannot bind."""
    ended, token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    caplog.set_level(logging.INFO, logger="sqlalchemy.engine")
    claim = pg_ledger.claims.claim(
        nxt.id, JOB, 1, 60, carried=CarriedEnd(ended, token, {"json": "theirs"})
    )
    assert (claim.outcome, claim.carried) == ("claimed", True)
    assert any("questpie_carried" in record.getMessage() for record in caplog.records)
    assert row_of(pg_ledger, ended).result == {"json": "theirs"}
    assert row_of(pg_ledger, nxt.id).result is None


# --- real workers ---------------------------------------------------------------------

#: A completion held for the next claim for a sixth of the lease (10 s): only a claim, a
#: process that stops, or a test's patience ends the hold.
HELD = {**NO_RESULTS, "QP_TEST_CARRY": "120"}


def _publish(stack: Stack, t: str, **payload: Any) -> str:
    dispatch_id = stack.questpie.queue.record.publish({"tag": t, **payload}, idempotency_key=t)
    assert dispatch_id is not None
    return dispatch_id


def _held(stack: Stack, t: str, dispatch_id: str) -> None:
    """The run returned and its completion is held in its process."""
    stack.wait_ends(t, 1)
    assert stack.row(dispatch_id).status == "active"


@pytest.mark.parametrize("broker", BROKERS)
def test_a_cancel_requested_while_a_completion_is_held_ends_it_cancelled(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, env=HELD)
    t = tag()
    dispatch_id = _publish(stack, t)
    _held(stack, t, dispatch_id)
    assert stack.questpie.queue.cancel(dispatch_id) is True
    stack.worker.stop()  # records what it holds
    row = stack.row(dispatch_id)
    assert (row.status, row.attempt) == ("cancelled", 1)
    assert len(stack.runs(t)) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_copy_of_the_message_delivered_while_its_completion_is_held_runs_nothing(
    make_stack: StackFactory, broker: str
) -> None:
    """The copy reaches the very process that holds the completion (one pool process):
    its claim carries nothing of its own dispatch, finds the run active, and is skipped;
    the completion is recorded once, under the run's own claim."""
    stack = make_stack(broker, env=HELD, concurrency=1)
    t, idle = tag(), idle_queue()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t, queue=idle)
    assert dispatch_id is not None
    message = capture(stack, idle)
    deliver(stack, message)
    _held(stack, t, dispatch_id)
    claim_token = stack.row(dispatch_id).claim_token
    deliver(stack, message)
    stack.wait_log(dispatch_id, "skipped (busy)")
    stack.worker.stop()
    row = stack.row(dispatch_id)
    assert (row.status, row.attempt, row.claim_token) == ("completed", 1, claim_token)
    assert len(stack.runs(t)) == 1


def test_a_secret_dispatch_carried_erases_its_key_and_keeps_no_plaintext(
    make_stack: StackFactory,
) -> None:
    """A secret dispatch's completion carried by the next claim: the key is erased in
    that write, and the canary is in no table of the ledger and no line of the worker's
    DEBUG log."""
    stack = make_stack(
        "redis", env={**HELD, "QP_TEST_SECRET": SECRET}, concurrency=1, loglevel="debug"
    )
    t, secret = tag(), canary()
    first = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": secret}, idempotency_key=t, secret_payload=True
    )
    assert first is not None
    stack.wait_runs(t, 1)
    nxt = _publish(stack, tag())  # its claim carries the secret run's completion
    stack.wait_status(nxt, "completed")
    row, carrier = stack.row(first), stack.row(nxt)
    assert (row.status, row.attempt, row.result) == ("completed", 1, None)
    assert (row.secret_ciphertext, row.secret_wrapped_key) == (None, None)
    assert row.finished_at == carrier.started_at  # carried: one transaction wrote both
    assert_absent(secret, "the ledger", ledger_dump(stack.ledger.engine))
    assert_absent(secret, "the worker's log", stack.worker.log())


def test_a_threads_pool_records_every_held_completion_once(make_stack: StackFactory) -> None:
    """Four threads of one process hold completions and carry each other's."""
    stack = make_stack("redis", env={**NO_RESULTS, "QP_TEST_CARRY": "0.5"}, pool="threads",
                       concurrency=4)  # fmt: skip
    t = tag()
    ids = [stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}")
           for n in range(30)]  # fmt: skip
    dispatch_ids = [dispatch_id for dispatch_id in ids if dispatch_id is not None]
    assert len(dispatch_ids) == 30
    for dispatch_id in dispatch_ids:
        stack.wait_status(dispatch_id, "completed")
    stack.wait_settled(*dispatch_ids)
    rows = [stack.row(dispatch_id) for dispatch_id in dispatch_ids]
    assert {(row.status, row.attempt) for row in rows} == {("completed", 1)}
    assert sorted(run["dispatch_id"] for run in stack.runs(t)) == sorted(dispatch_ids)
    starts = {row.started_at for row in rows}
    assert any(row.finished_at in starts for row in rows)  # some were carried


@dataclass
class OneTaskWorker(Worker):
    """A worker whose pool processes end after each task (`--max-tasks-per-child=1`)."""

    def start(self, timeout: float = 60.0) -> Worker:
        cmd = [
            self.python, "-m", "celery", "-A", self.app, "worker",
            "-l", self.loglevel, "-P", self.pool, "-c", str(self.concurrency),
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "--max-tasks-per-child=1",
            "-n", f"qp-one-{os.getpid()}-{time.monotonic_ns()}@localhost",
        ]  # fmt: skip
        self._launch(cmd, ready=" ready.", what="celery worker", timeout=timeout)
        return self


def test_a_pool_process_that_ends_after_its_task_records_what_it_holds(
    make_stack: StackFactory,
) -> None:
    """`--max-tasks-per-child=1`: the process ends right after the run, holding its
    completion for 10 s more; it records it as it goes, well before that."""
    stack = make_stack("redis", env=HELD, start_worker=False)
    stack.worker = OneTaskWorker(stack.env, concurrency=1).start()
    t = tag()
    dispatch_id = _publish(stack, t)
    row = stack.wait_status(dispatch_id, "completed", timeout=8)  # before the 10 s hold
    assert row.attempt == 1
    assert len(stack.runs(t)) == 1


def test_a_worker_whose_main_process_is_killed_loses_no_held_completion(
    make_stack: StackFactory,
) -> None:
    """SIGKILL to the worker's main process while its pool process holds a completion:
    the run ends `completed`, by that process or, if it went down with the main one,
    by the next attempt after the lease (the documented window): at most two runs."""
    stack = make_stack(
        "redis", env={**HELD, "QP_TEST_LEASE": "6", "QP_TEST_RELAY": "0.5"}, concurrency=1
    )
    t = tag()
    dispatch_id = _publish(stack, t)
    stack.wait_ends(t, 1)
    proc = stack.worker.proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    try:
        stack.start_worker()
        row = stack.wait_status(dispatch_id, "completed", timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # pool processes left behind, if any
    assert row.attempt in (1, 2)
    assert [run["attempt"] for run in stack.runs(t)] == list(range(1, row.attempt + 1))


def test_carried_completions_through_pgbouncer(make_stack: StackFactory) -> None:
    """The ledger behind PgBouncer in transaction mode (`pooled=True`): the carrying
    statement carries the pooled settings too, and every run is recorded once."""
    stack = make_stack("redis", ledger="pooled", env={**NO_RESULTS, "QP_TEST_CARRY": "5"},
                       concurrency=1)  # fmt: skip
    t = tag()
    ids = [stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}")
           for n in range(10)]  # fmt: skip
    dispatch_ids = [dispatch_id for dispatch_id in ids if dispatch_id is not None]
    assert len(dispatch_ids) == 10
    stack.wait_settled(*dispatch_ids)
    stack.worker.stop()
    rows = [stack.row(dispatch_id) for dispatch_id in dispatch_ids]
    assert {(row.status, row.attempt) for row in rows} == {("completed", 1)}
    assert len(stack.runs(t)) == 10
    starts = {row.started_at for row in rows}
    assert sum(row.finished_at in starts for row in rows) >= 9  # all but the last carried
