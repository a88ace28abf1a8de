"""The ledger cut off under running work, through a TCP proxy in front of PostgreSQL:
an outage longer than a lease, the ledger and the broker down together, a hand-on and
a delivery sent back while it is down, outcome writes waiting it out, a one-shot relay
right after it, and a worker that knows (or could not read) a job's recorded policy.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from celery import chain
from celery.result import AsyncResult

from questpie_celery.worker.delivery_wait import CLAIM_PATIENCE_SECONDS
from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.brokers import deliver
from tests.support.faultproxy import FaultProxy
from tests.support.faults import (
    BROKERS,
    held_dispatch,
    lease_lapsed,
    log_times,
    logged,
    renewal_failures,
    wait_ended,
)
from tests.support.services import RedisServer
from tests.support.stack import Gate, Stack, tag
from tests.support.waiting import wait_until


def gated_run(stack: Stack, t: str, gate: Gate) -> tuple[str, str | None]:
    """A keyed `record` run held open by `gate`, once it is active: its id and token."""
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=t
    )
    assert dispatch_id is not None
    return dispatch_id, stack.wait_status(dispatch_id, "active").claim_token


@pytest.mark.parametrize("broker", BROKERS)
def test_a_ledger_outage_longer_than_the_lease_does_not_run_a_live_handler_twice(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """The worker and its relay lose the ledger while a handler runs, for longer than the
    lease. When the ledger is back, the holder renews its claim before the relay ends
    it. Before the fix the relay (every 0.2 s) ended the lapsed lease before the renewer
    (every lease/3 s) tried again, and a second run started beside the live one."""
    stack = via_proxy(
        broker,
        env={"QP_TEST_LEASE": "6", "QP_TEST_RELAY": "0.2"},
        loglevel="debug",  # every failed renewal is logged (after the first, at DEBUG)
    )
    t = tag()
    gate = stack.gate()
    dispatch_id, token = gated_run(stack, t, gate)
    proxy.cut()
    try:
        wait_until(lambda: lease_lapsed(stack, dispatch_id), "the lease to lapse", timeout=20)
        # Heal right after a renewal failed: the holder's next try is its retry interval
        # away, while the relay tries every 0.2 s.
        seen = renewal_failures(stack, dispatch_id)
        wait_until(
            lambda: renewal_failures(stack, dispatch_id) > seen, "a failed renewal", timeout=20
        )
    finally:
        proxy.heal()

    def settled() -> bool:
        row = stack.row(dispatch_id)
        return row.claim_token != token or not lease_lapsed(stack, dispatch_id)

    wait_until(settled, "the claim to be renewed or ended", timeout=20)
    assert stack.row(dispatch_id).claim_token == token, "the live run's claim was ended"
    gate.open()
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


def test_a_delivery_the_broker_will_not_take_back_waits_for_the_ledger(
    proxy: FaultProxy, via_proxy: StackFactory, redis_server: RedisServer
) -> None:
    """A plain call of a singleton job meets a ledger that stays unreachable past the
    fence's patience, and the broker refuses the delivery back too: the worker keeps
    trying both, and runs it once the ledger is back. Before the fix the refused
    requeue failed the task: the message was acknowledged, no row existed, and the
    run was lost. Redis only: `maxmemory 1` makes it refuse writes on cue."""
    stack = via_proxy("redis")
    broker = redis.Redis(port=redis_server.port)
    t = tag()
    proxy.cut()
    try:
        sent = stack.celery_app.tasks["policy.singleton"].delay({"tag": t})
        stack.wait_log(sent.id, "waiting to claim it")
        broker.config_set("maxmemory", 1)
        # Past the fence's patience the worker sends the delivery back, is refused, and
        # keeps trying. (Before the fix the refusal escaped and failed the task.)
        stack.wait_log(sent.id, "refused the delivery back", timeout=CLAIM_PATIENCE_SECONDS + 30)
    finally:
        proxy.heal()
        broker.config_set("maxmemory", 0)
        broker.close()
    row = stack.wait_status(sent.id, "completed", timeout=60)
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [sent.id]


@pytest.mark.parametrize("broker", BROKERS)
def test_a_hand_on_that_meets_the_ledger_down_does_not_break_a_chain(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """Step 1 of a chain of a singleton job completes; the slot hand-on that follows
    meets the ledger down. The completion stands, Celery sees success and sends step 2.
    Before the fix the hand-on's error failed the Celery task and the chain stopped."""
    stack = via_proxy(broker)
    t1, t2 = tag(), tag()
    gate = stack.gate()
    task = stack.celery_app.tasks["policy.singleton"]
    chain(task.si({"tag": t1, "gate": str(gate)}), task.si({"tag": t2})).apply_async()
    [run] = stack.wait_runs(t1, 1)
    step1 = run["dispatch_id"]
    # From here on only the hand-on's look for parked runs binds the job's name.
    proxy.arm(b"policy.singleton", refuse_for=2.0)
    gate.open()
    assert proxy.fired.wait(20), "no hand-on after step 1"
    assert b"SELECT" in proxy.fired_data
    assert stack.wait_status(step1, "completed").attempt == 1
    ends = stack.wait_ends(t2, 1)
    assert len(ends) == 1, "the chain's second step never ran"
    if broker == "redis":  # the stack with a result backend
        assert AsyncResult(step1, app=stack.celery_app).state == "SUCCESS"


@pytest.mark.parametrize("broker", BROKERS)
def test_delivery_sent_back_while_the_ledger_is_down_keeps_its_claim(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """The claim commits, its reply is lost, and the ledger stays unreachable past the
    fence's patience: the delivery goes back to the broker carrying its fencing token,
    and its next delivery finds its own claim and runs. Before the fix the delivery went
    back without its token, the next one read the landed claim as "busy" and was
    ignored, and the orphaned claim lapsed into a failed attempt that never ran."""
    stack = via_proxy(broker)
    t = tag()
    dispatch_id, message = held_dispatch(stack, t, retry_limit=0)
    proxy.arm(dispatch_id.encode(), refuse_for=5.0)
    deliver(stack, message)
    assert proxy.fired.wait(20), "the worker never sent its claim"
    proxy.cut()  # a failover right after the claim committed, longer than the patience
    try:
        assert b"UPDATE" in proxy.fired_data
        assert stack.row(dispatch_id).status == "active"  # the claim landed, unseen
        stack.wait_log(dispatch_id, "went back to the broker", timeout=CLAIM_PATIENCE_SECONDS + 30)
    finally:
        proxy.heal()
    row = wait_ended(stack, dispatch_id, timeout=60)
    assert (row.status, row.attempt, row.last_error) == ("completed", 1, None)
    assert [r["attempt"] for r in stack.runs(t)] == [1]


@pytest.mark.parametrize("broker", BROKERS)
def test_an_outcome_write_pauses_between_tries_while_the_ledger_is_down(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """While the ledger is down, recording an outcome is tried again after growing
    pauses (0.1 s, 0.2 s, 0.4 s ... up to 2 s), not in a busy loop that floods the log
    and the database with connection attempts. (B's fix moved the pause under the new
    `except SoftTimeLimitExceeded`: the tries after an outage error no longer pause.)"""
    # Every try is logged (after the first, at DEBUG).
    stack = via_proxy(broker, loglevel="debug")
    t = tag()
    gate = stack.gate()
    dispatch_id, _ = gated_run(stack, t, gate)

    def tries() -> list[str]:
        return [
            line
            for line in stack.worker.log_about(dispatch_id)
            if "could not record its outcome yet" in line
        ]

    proxy.cut()
    try:
        gate.open()
        wait_until(lambda: len(tries()) >= 5, "five tries to record the outcome", timeout=30)
    finally:
        proxy.heal()
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    first_five = log_times(tries()[:5])
    assert len(first_five) == 5
    # Four pauses of at least 0.1 + 0.2 + 0.4 + 0.8 s lie between the first five tries.
    assert first_five[-1] - first_five[0] >= timedelta(seconds=1)


@pytest.mark.parametrize("broker", BROKERS)
def test_a_one_shot_relay_leaves_a_lapsed_lease_of_a_live_run_alone(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """A run's holder is cut off from the ledger until its lease lapses; an operator's
    `questpie-celery relay --once` (run_relay(once=True)) reaches the ledger meanwhile.
    It cannot tell a dead holder from a cut-off one, so it leaves the lease alone; the
    holder renews once it is back, and the run completes once. Before the fix the
    one-shot pass ended the claim at once and a retry ran beside the live run."""
    stack = via_proxy(broker)
    t = tag()
    gate = stack.gate()
    dispatch_id, token = gated_run(stack, t, gate)
    direct = stack.ledger.engine.url.render_as_string(hide_password=False)
    _, operator = jobapp.build(broker=stack.env["QP_TEST_BROKER"], ledger=direct)
    proxy.cut()
    try:
        wait_until(lambda: lease_lapsed(stack, dispatch_id), "the lease to lapse", timeout=20)
        operator.run_relay(once=True)
        row = stack.row(dispatch_id)
        assert (row.status, row.claim_token) == ("active", token), "the live claim was ended"
    finally:
        proxy.heal()
        operator.close()
    wait_until(lambda: not lease_lapsed(stack, dispatch_id), "the holder to renew", timeout=20)
    gate.open()
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_worker_knows_the_recorded_policy_before_the_ledger_goes_down(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """`record` is declared standard but recorded `exclusive` (`policy set`) before the
    worker starts; then the ledger goes down. Two plain calls of it wait for the ledger;
    then one runs and the other is suppressed, as the policy says. Before the fix the
    pool's children were forked before any policy was read, could not read it now, and
    fell back to the declaration: both calls ran at once, unfenced."""
    stack = via_proxy(broker, start_worker=False)
    stack.questpie.set_policy("record", "exclusive")
    stack.worker.start()
    t = tag()
    gate = stack.gate()
    task = stack.celery_app.tasks["record"]
    proxy.cut()
    try:
        a = task.delay({"tag": t, "gate": str(gate)})
        b = task.delay({"tag": t, "gate": str(gate)})

        def both_waiting_or_running() -> bool:
            waiting = all(logged(stack, s.id, "waiting to claim it") for s in (a, b))
            return waiting or len(stack.runs(t)) == 2

        wait_until(both_waiting_or_running, "both calls to wait for the ledger (or run)")
        assert stack.runs(t) == [], "a call of an exclusive job ran without the ledger"
    finally:
        proxy.heal()

    # Once the ledger is back, one call is taken in and runs; the exclusive policy
    # suppresses the other (its slot is taken), and nothing of it is written.
    wait_until(
        lambda: any(
            logged(stack, s.id, "suppressed by its exclusive queue policy") for s in (a, b)
        ),
        "one of the calls to be suppressed",
    )
    # The suppression is logged by one call; the other's run may still be on its way.
    [run] = stack.wait_runs(t, 1)
    [suppressed] = [s.id for s in (a, b) if s.id != run["dispatch_id"]]
    assert stack.ledger.get(suppressed) is None
    gate.open()
    row = stack.wait_status(run["dispatch_id"], "completed")
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t, "end")] == [run["dispatch_id"]]


@pytest.mark.parametrize("broker", BROKERS)
def test_a_worker_that_could_not_read_a_policy_waits_for_the_ledger(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """A worker starts while the ledger is down, so it has read no job's policy; a plain
    call of `record` (recorded `exclusive`, declared standard) waits for the ledger and
    then runs fenced, under a ledger row. Before the fix the worker guessed the
    declaration and ran the call at once, without a row."""
    stack = via_proxy(broker, start_worker=False)
    stack.questpie.set_policy("record", "exclusive")
    t = tag()
    proxy.cut()
    try:
        stack.worker.start()
        sent = stack.celery_app.tasks["record"].delay({"tag": t})
        wait_until(
            lambda: logged(stack, sent.id, "waiting to claim it") or stack.runs(t),
            "the call to wait for the ledger (or run)",
        )
        assert stack.runs(t) == [], "the call ran under a guessed policy"
    finally:
        proxy.heal()
    row = stack.wait_status(sent.id, "completed", timeout=30)
    assert (row.attempt, row.policy) == (1, "exclusive")
    assert [r["dispatch_id"] for r in stack.runs(t)] == [sent.id]
