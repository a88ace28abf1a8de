"""Celery's soft time limit falling while the fence records an outcome, or while a
delivery waits out a ledger outage: the handler never runs again, and a delivery goes
back to the broker before the limit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.integration.conftest import StackFactory
from tests.support.brokers import deliver
from tests.support.faultproxy import FaultProxy
from tests.support.faults import (
    BROKERS,
    SOFT_LIMIT,
    SOFT_LIMITS,
    held_dispatch,
    logged,
    wait_ended,
    wait_logged,
)
from tests.support.stack import Stack, tag


@pytest.mark.parametrize("broker", BROKERS)
def test_a_soft_time_limit_while_recording_the_outcome_does_not_run_the_handler_again(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """The handler returned; recording `completed` meets the ledger down, and the run's
    soft time limit falls while the write waits. The write goes on and lands once the
    ledger is back. Before the fix SoftTimeLimitExceeded escaped the wait, nobody
    recorded the outcome, and the relay ran the handler a second time. (The limit may
    fall anywhere in the wait: in a try, or in the pause between two tries.) The run's
    result is kept (Redis; RabbitMQ's `rpc://`), so its completion is recorded in the
    run's own thread, where the limit falls, not held for a later claim."""
    stack = via_proxy(broker, env=KEEPS_RESULTS[broker])
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1},
        idempotency_key=t,
        expire_in_seconds=SOFT_LIMIT,
        retry_limit=2,
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    proxy.cut()
    try:
        gate.open()
        assert len(stack.wait_ends(t, 1)) == 1  # the handler returned
        # The worker's child met the soft limit: it says so, or Celery logs the failure.
        wait_logged(
            stack,
            dispatch_id,
            "soft time limit reached while recording",
            "SoftTimeLimitExceeded",
            timeout=SOFT_LIMIT + 20,
        )
    finally:
        proxy.heal()
    row = wait_ended(stack, dispatch_id, timeout=60)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


def test_a_held_completion_that_meets_the_ledger_down_lands_once_it_is_back(
    proxy: FaultProxy, via_proxy: StackFactory
) -> None:
    """No result backend: the run's completion is held for the next claim, then recorded
    by the process's own thread, which meets the ledger down. The run has returned (Celery
    logs its success) and its row stays `active` while the ledger is away; once it is
    back the completion lands, on the first attempt, and the handler ran once."""
    stack = via_proxy("rabbitmq")
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t, retry_limit=2
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    proxy.cut()
    try:
        gate.open()
        wait_logged(stack, dispatch_id, "] succeeded in ")  # returned, its end not recorded
        assert stack.row(dispatch_id).status == "active"
    finally:
        proxy.heal()
    row = wait_ended(stack, dispatch_id, timeout=60)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t)) == 1


#: Result backends that keep a run's result, per broker: the run's completion is then
#: recorded in its own thread, before the task returns.
KEEPS_RESULTS = {"redis": {}, "rabbitmq": {"QP_TEST_BACKEND": "rpc://"}}


#: How a run reaches the worker: given the stack, a tag and a soft time limit, and while
#: the ledger is still up, a function that sends it (the ledger down by then) and
#: returns its id.
Arrival = Callable[[Stack, str, int], Callable[[], str]]


def plain_call(stack: Stack, t: str, soft_limit: int) -> Callable[[], str]:
    """A plain call of a singleton job, the limit Celery's `soft_time_limit` option."""

    def send() -> str:
        task = stack.celery_app.tasks["policy.singleton"]
        return str(task.apply_async(args=[{"tag": t}], soft_time_limit=soft_limit).id)

    return send


def published_dispatch(stack: Stack, t: str, soft_limit: int) -> Callable[[], str]:
    """A published dispatch, the limit its expire_in_seconds, its message held back."""
    dispatch_id, message = held_dispatch(stack, t, expire_in_seconds=soft_limit)

    def send() -> str:
        deliver(stack, message)
        return dispatch_id

    return send


@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("soft_limit", SOFT_LIMITS)
@pytest.mark.parametrize("arrival", [plain_call, published_dispatch], ids=lambda a: a.__name__)
def test_a_delivery_waiting_for_the_ledger_goes_back_before_its_soft_time_limit(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str, soft_limit: int, arrival: Arrival
) -> None:
    """A plain call of a singleton job, or a published dispatch, with a soft time limit
    shorter than the fence's patience, is delivered while the ledger is down: it goes
    back to the broker before the limit falls, and runs once the ledger is back. Before
    the fix SoftTimeLimitExceeded escaped the wait with the message acknowledged: the
    plain call was lost (no row, no run), the dispatch's row waited for the relay's
    redeliver_after (an hour)."""
    stack = via_proxy(broker)
    t = tag()
    send = arrival(stack, t, soft_limit)
    proxy.cut()
    try:
        dispatch_id = send()
        wait_logged(
            stack,
            dispatch_id,
            "went back to the broker",
            "Soft time limit",
            timeout=soft_limit + 20,
        )
    finally:
        proxy.heal()
    assert not logged(stack, dispatch_id, "Soft time limit"), "the limit fell while it waited"
    row = stack.wait_status(dispatch_id, "completed", timeout=30)
    assert row.attempt == 1
    assert [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)] == [(dispatch_id, 1)]
