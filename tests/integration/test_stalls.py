"""Processes that stand still (SIGSTOP: a paused VM, a debugger, a swap storm) while a
run holds its claim, and ledgers that stall instead: a pool process whose claim may have
lapsed ends itself before its handler goes on; one that stood still for less, and a
stalled ledger, end nothing. Real prefork workers, PostgreSQL (through PgBouncer where
the pooler is paused), Redis."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select, text

from questpie_celery.ledger import dispatch_table
from tests.integration.conftest import StackFactory
from tests.support.services import PgBouncerServer
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


def _renewed_after(stack: Stack, dispatch_id: str, mark: datetime | None) -> bool:
    """Whether the run's lease was renewed since its end was `mark`."""
    return stack.row(dispatch_id).lease_expires_at != mark


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("share", [0.85])
def test_a_pooler_paused_for_less_than_a_lease_does_not_kill_the_run(
    make_stack: StackFactory, pgbouncer: PgBouncerServer, share: float
) -> None:
    """PgBouncer PAUSEd for 0.85 of a lease: renewals hang instead of failing, and each
    lands once it resumes, before the claim lapses (the relay leaves a lease that lapsed
    behind a stalled pooler to its holder anyway). A stalled ledger, not a process that
    stood still: the run goes on, once, on its first attempt. (Before, the pool process
    took the hung renewal for a stall and ended itself.)"""
    lease = 6.0
    stack = make_stack(
        "redis", ledger="pooled", env={"QP_TEST_LEASE": str(lease), "QP_TEST_RELAY": "0.5"}
    )
    t = tag()
    gate = stack.gate()
    first = stack.questpie.queue.fenced_one.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert first is not None
    [started] = stack.wait_runs(t, 1)
    pid = int(started["pid"])
    database_name = stack.env["QP_TEST_RUNS"].rsplit("/", 1)[1]
    pgbouncer.console(f"PAUSE {database_name}")
    try:
        time.sleep(share * lease)  # the outage itself: the scenario, not a wait
    finally:
        pgbouncer.console(f"RESUME {database_name}")
    mark = stack.row(first).lease_expires_at
    wait_until(lambda: _renewed_after(stack, first, mark), "a renewal after the pooler is back")
    gate.open()
    row = stack.wait_status(first, "completed", timeout=60)
    said = [line for line in stack.worker.log().splitlines() if "stood still" in line]
    assert not said, said
    assert _alive(pid), "the pool process was killed by an outage"
    assert row.attempt == 1


def test_a_whole_worker_stopped_past_the_lease_loses_nothing_and_keeps_the_retrys_result(
    make_stack: StackFactory,
) -> None:
    """The whole first worker (main process and its pool processes: `kill -STOP -pgid`, a
    paused VM) stands still past the lease while its run holds the claim. A second
    worker runs the retry to its end. Continued, the stopped pool process ends itself;
    the first worker's main process goes on, the result backend keeps the retry's
    SUCCESS, the ledger the retry's outcome, and the stopped run never reaches its end."""
    stack = make_stack("redis", env={"QP_TEST_LEASE": "4", "QP_TEST_RELAY": "0.5"})
    t = tag()
    gate = stack.gate()
    first = stack.questpie.queue.fenced_one.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert first is not None
    [started] = stack.wait_runs(t, 1)
    child = int(started["pid"])
    assert stack.worker.proc is not None
    group = stack.worker.proc.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        other = stack.start_worker()
        gate.open()
        row = stack.wait_status(first, "completed", timeout=90)
        assert row.attempt == 2
        # Celery stores the result after the ledger's outcome.
        wait_until(lambda: stack.celery_app.AsyncResult(first).state == "SUCCESS", "SUCCESS")
    finally:
        os.killpg(group, signal.SIGCONT)
    wait_until(lambda: not _alive(child), "the stopped pool process to end itself")
    assert stack.worker.alive()
    ends = [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t, phase="end")]
    assert ends == [(first, 2)]
    assert stack.celery_app.AsyncResult(first).state == "SUCCESS"
    row = stack.row(first)
    assert (row.status, row.attempt) == ("completed", 2)
    # The first worker still runs deliveries once the second is gone.
    other.stop()
    stack.extra_workers.remove(other)
    later = tag()
    after = stack.questpie.queue.fenced_one.publish({"tag": later}, idempotency_key=later)
    assert after is not None
    stack.wait_status(after, "completed", timeout=60)


def test_only_the_main_process_stopped_past_the_lease_runs_once(
    make_stack: StackFactory,
) -> None:
    """Only the worker's main process stands still: its pool process keeps renewing, the
    run ends on its first attempt, and nothing is killed."""
    stack = make_stack("redis", env={"QP_TEST_LEASE": "3", "QP_TEST_RELAY": "0.5"})
    t = tag()
    gate = stack.gate()
    first = stack.questpie.queue.fenced_one.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert first is not None
    [started] = stack.wait_runs(t, 1)
    assert stack.worker.proc is not None
    main = stack.worker.proc.pid
    os.kill(main, signal.SIGSTOP)
    try:
        time.sleep(6)  # the stop itself, two leases long: the scenario, not a wait
        gate.open()
        row = stack.wait_status(first, "completed", timeout=30)
        assert row.attempt == 1
    finally:
        os.kill(main, signal.SIGCONT)
    assert _alive(int(started["pid"]))
    assert [r["attempt"] for r in stack.runs(t, phase="end")] == [1]
    assert "stood still" not in stack.worker.log()
    assert stack.celery_app.AsyncResult(first).get(timeout=20) is None


def test_a_pool_process_stopped_for_well_under_its_lease_keeps_its_live_claim(
    make_stack: StackFactory,
) -> None:
    """A pool process stopped for 0.6 of a lease, just before its next renewal was due,
    wakes with its claim live in the ledger (0.12 of a lease left): nothing could have
    taken it, and the renewal it makes on waking lands in time. It goes on and completes
    on its first attempt. (Before, a stop of half a lease ended it.)"""
    lease = 6.0
    stack = make_stack("redis", env={"QP_TEST_LEASE": str(lease), "QP_TEST_RELAY": "0.5"})
    t = tag()
    gate = stack.gate()
    first = stack.questpie.queue.fenced_one.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert first is not None
    [started] = stack.wait_runs(t, 1)
    pid = int(started["pid"])
    # Catch a renewal as it lands: the lease's end moves.
    before = stack.row(first).lease_expires_at
    wait_until(lambda: _renewed_after(stack, first, before), "a renewal", interval=0.01)
    time.sleep(0.28 * lease)  # to just before the next renewal: the scenario, not a wait
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(0.6 * lease)  # the stop itself
        row = stack.row(first)
        assert row.status == "active"
        assert not any(r.id == first for r in stack.ledger.claims.expired())
    finally:
        os.kill(pid, signal.SIGCONT)
    mark = stack.row(first).lease_expires_at
    wait_until(lambda: _renewed_after(stack, first, mark), "a renewal after the stop")
    gate.open()
    row = stack.wait_status(first, "completed", timeout=60)
    said = [line for line in stack.worker.log().splitlines() if "stood still" in line]
    assert not said, said
    assert row.attempt == 1


def test_a_process_stopped_while_its_claim_statement_was_in_flight_never_runs_the_handler(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """The pool process sends its claim (here it waits on a row lock a moment), and stands
    still before the reply is read (a paused VM). The ledger takes the claim; the
    process stays stopped past the lease; the relay ends it and the retry runs to its
    end on the other pool process. Continued, the process reads "claimed", starts its
    lease's hold with the claim's (old) time, and runs the handler: nothing checks the
    claim between the claim statement and the handler's first step, the SIGCONT
    handler saw no held lease yet, and the renewal thread looks only at its next round
    (up to a third of a lease later). Now the hold finds its claim a lease old and the
    process ends itself before the handler begins."""
    held = tmp_path / "held"
    held.mkdir()
    lease = 4.0
    stack = make_stack(
        "redis",
        env={"QP_TEST_HOLD_DIR": str(held), "QP_TEST_LEASE": str(lease), "QP_TEST_RELAY": "0.5"},
    )
    t = tag()
    gate = stack.gate()
    first = stack.questpie.queue.fenced_one.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert first is not None
    marker = held / first
    wait_until(marker.exists, "the delivery to reach its pool process")
    pid = int(marker.read_text())
    direct = create_engine(stack.env["QP_TEST_LEDGER"])
    locker = direct.connect()
    tx = locker.begin()
    locker.execute(
        select(dispatch_table.c.id).where(dispatch_table.c.id == first).with_for_update()
    )
    (held / f"{first}.go").touch()
    try:
        # The claim statement waits on the lock.
        def claim_waits() -> bool:
            with direct.connect() as look:
                return bool(
                    look.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type"
                            " = 'Lock' AND query ILIKE 'UPDATE%questpie_queue_dispatch%'"
                        )
                    ).scalar()
                )

        wait_until(claim_waits, "the claim to wait on the lock", timeout=10)
        os.kill(pid, signal.SIGSTOP)
    finally:
        tx.commit()
        locker.close()
    try:
        # The claim landed while the process stood still; it lapses, and the retry runs.
        row = stack.wait_status(first, "completed", timeout=60)
        assert row.attempt == 2
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: not _alive(pid), "the continued pool process to end itself")
    direct.dispose()
    late = [r for r in stack.runs(t) if int(r["pid"]) == pid]
    assert not late, f"the handler ran after its claim was gone and its retry ended: {late}"
