"""A run's completion carried by the next claim of its process: one statement and one
commit for both, on PostgreSQL. The ledger's half (no worker), then real prefork
workers on Redis and RabbitMQ: a busy worker records every run once, a pool process
killed while it holds a completion loses nothing (its lease decides, as for any run
whose outcome was not recorded), and one that stops in the ordinary way records what it
holds first."""

from __future__ import annotations

from pathlib import Path

import pytest

from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.ledger import CarriedEnd, Ledger
from tests.integration.conftest import StackFactory
from tests.support.ledgers import JOB, claimed, new_row, row_of
from tests.support.stack import Stack, tag


def _writers(ledger: Ledger, *dispatch_ids: str) -> set[str]:
    """The transactions that last wrote these rows (PostgreSQL's `xmin`)."""
    with ledger.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT xmin::text FROM questpie_queue_dispatch WHERE id = ANY(%(ids)s)",
            {"ids": list(dispatch_ids)},
        ).all()
    return {row[0] for row in rows}


def test_a_claim_records_the_completion_it_carries_in_the_same_commit(pg_ledger: Ledger) -> None:
    ended, token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    claim = pg_ledger.claims.claim(
        nxt.id, JOB, 1, 60, carried=CarriedEnd(ended, token, {"json": [1, 2]})
    )
    assert claim.outcome == "claimed" and claim.carried is True
    done = row_of(pg_ledger, ended)
    assert (done.status, done.result, done.lease_expires_at) == (
        "completed",
        {"json": [1, 2]},
        None,
    )
    assert row_of(pg_ledger, nxt.id).status == "active"
    assert len(_writers(pg_ledger, ended, nxt.id)) == 1  # one transaction wrote both


def test_a_carried_completion_of_a_lost_claim_is_not_recorded(pg_ledger: Ledger) -> None:
    """The relay ended the lapsed claim meanwhile (another token holds it now): the
    completion does not land, and the claim it rode with is taken all the same."""
    ended, _token = claimed(pg_ledger)
    nxt = new_row()
    assert pg_ledger.dispatches.insert(nxt)
    claim = pg_ledger.claims.claim(nxt.id, JOB, 1, 60, carried=CarriedEnd(ended, "not-ours", None))
    assert claim.outcome == "claimed" and claim.carried is False
    assert row_of(pg_ledger, ended).status == "active"


def test_a_claim_that_takes_nothing_still_records_what_it_carries(pg_ledger: Ledger) -> None:
    ended, token = claimed(pg_ledger)
    claim = pg_ledger.claims.claim(
        random_dispatch_id(), JOB, 1, 60, carried=CarriedEnd(ended, token, None)
    )
    assert claim.outcome == "unknown" and claim.carried is True
    assert row_of(pg_ledger, ended).status == "completed"


def test_a_run_cancelled_while_it_ran_ends_cancelled_when_carried(pg_ledger: Ledger) -> None:
    ended, token = claimed(pg_ledger)
    assert pg_ledger.cancels.cancel(ended).outcome == "requested"
    claim = pg_ledger.claims.claim(
        random_dispatch_id(), JOB, 1, 60, carried=CarriedEnd(ended, token, None)
    )
    assert claim.carried is True
    assert row_of(pg_ledger, ended).status == "cancelled"


BROKERS = ["redis", "rabbitmq"]
#: No result backend: only the ledger tells that a run ended, so completions are carried.
NO_RESULTS = {"QP_TEST_BACKEND": ""}


def _carried_pairs(stack: Stack, dispatch_ids: list[str]) -> int:
    """How many of the rows ended in the transaction that claimed another: a carried
    completion's `finished_at` is that transaction's start, as is the claim's
    `started_at`."""
    rows = [stack.row(dispatch_id) for dispatch_id in dispatch_ids]
    starts = {row.started_at: row.id for row in rows}
    return sum(1 for row in rows if starts.get(row.finished_at, row.id) != row.id)


@pytest.mark.parametrize("broker", BROKERS)
def test_a_busy_worker_records_each_run_once_carrying_completions(
    make_stack: StackFactory, broker: str
) -> None:
    """Forty dispatches queued for a prefork worker of two: each runs once and ends
    `completed`, and all but each pool process's last were recorded by the claim after
    them (the window is long here, so a slow machine does not decide it)."""
    stack = make_stack(broker, env={**NO_RESULTS, "QP_TEST_CARRY": "5"})
    t = tag()
    ids = [
        stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}")
        for n in range(40)
    ]
    assert all(ids)
    dispatch_ids = [dispatch_id for dispatch_id in ids if dispatch_id is not None]
    stack.wait_settled(*dispatch_ids)
    rows = [stack.row(dispatch_id) for dispatch_id in dispatch_ids]
    assert {(row.status, row.attempt) for row in rows} == {("completed", 1)}
    assert len(stack.runs(t)) == 40
    assert _carried_pairs(stack, dispatch_ids) >= 40 - 2


@pytest.mark.parametrize("broker", BROKERS)
def test_a_pool_process_that_stops_records_the_completion_it_holds(
    make_stack: StackFactory, broker: str
) -> None:
    """A warm shutdown while a pool process holds a completion no claim will carry: the
    process records it before it goes. The run ran once."""
    stack = make_stack(broker, env={**NO_RESULTS, "QP_TEST_CARRY": "120"})
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t)
    assert dispatch_id is not None
    stack.wait_ends(t, 1)
    assert stack.row(dispatch_id).status == "active"  # held: no claim came to carry it
    stack.worker.stop()
    row = stack.row(dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t)) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_pool_process_killed_holding_a_completion_leaves_the_run_to_its_lease(
    make_stack: StackFactory, broker: str, tmp_path: Path
) -> None:
    """The pool process is SIGKILLed once its task returned, while it holds the run's
    completion: as for any process that dies between a run's end and its outcome's
    commit, the lease lapses and the next attempt runs and completes. Nothing is lost;
    the second run is that documented window."""
    stack = make_stack(
        broker,
        env={
            **NO_RESULTS,
            "QP_TEST_CARRY": "120",  # held for a sixth of the lease: half a second
            "QP_TEST_LEASE": "3",
            "QP_TEST_RELAY": "0.5",
            "QP_TEST_KILL_AFTER_RUN": str(tmp_path),
        },
    )
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t)
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "completed", timeout=60)
    assert row.attempt == 2
    assert [run["attempt"] for run in stack.runs(t)] == [1, 2]


def test_a_completion_whose_result_celery_keeps_is_recorded_at_once(
    make_stack: StackFactory,
) -> None:
    """With a result backend, Celery stores the run's result as soon as it returns: the
    ledger records the completion at once too, never after a reader saw the result."""
    stack = make_stack("redis", env={"QP_TEST_CARRY": "120"})
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t)
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "completed")  # well before the 120 s window
    assert row.attempt == 1
