"""Regression tests for the review's findings (R1-R8, R11), on real servers and workers.

The faults are real: a TCP proxy in front of PostgreSQL (tests/support/faultproxy.py)
lets a statement commit and then loses its reply, or cuts every connection; a Redis
server with `maxmemory 1` refuses every write. Stacks whose ledger goes through the
proxy keep their `test_runs` table in a database of their own, reached directly, and
the test inspects the ledger through a direct connection too: only the worker's and
the publisher's ledger traffic meets the faults.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
import redis
from celery import chain
from celery.result import AsyncResult
from sqlalchemy import func, select, update

from questpie_celery.fence import CLAIM_PATIENCE_SECONDS
from questpie_celery.ledger import DispatchRow, dispatch_table, open_ledger
from questpie_celery.ledger.schema import TERMINAL
from tests.integration.conftest import StackFactory
from tests.support import jobapp, routeapp
from tests.support.brokers import capture, deliver
from tests.support.faultproxy import FaultProxy
from tests.support.services import PostgresServer, RedisServer, free_port
from tests.support.stack import Stack, tag
from tests.unit.helpers import wait_until

T = TypeVar("T")

BROKERS = ["redis", "rabbitmq"]
#: A short lease and a fast relay: a claim orphaned by a bug lapses within the test.
SHORT_LEASE = {"QP_TEST_LEASE": "3", "QP_TEST_RELAY": "0.5"}


def idle_queue() -> str:
    return f"idle-{uuid.uuid4().hex[:8]}"


def wait_ended(stack: Stack, dispatch_id: str, timeout: float = 40.0) -> DispatchRow:
    """The row once it is terminal (completed or failed), however it ended."""

    def ended() -> DispatchRow | None:
        row = stack.ledger.get(dispatch_id)
        return row if row is not None and row.status in TERMINAL else None

    return wait_until(ended, f"dispatch {dispatch_id} to end", timeout)


@pytest.fixture
def proxy(postgres: PostgresServer) -> Iterator[FaultProxy]:
    made = FaultProxy(postgres.port)
    yield made
    made.close()


def via_proxy(
    make_stack: StackFactory,
    postgres: PostgresServer,
    proxy: FaultProxy,
    broker: str,
    env: dict[str, str] | None = None,
    **worker: Any,
) -> Stack:
    """A stack whose worker and publisher reach the ledger through `proxy`; the test's
    own `stack.ledger` and the `test_runs` table are reached directly."""
    direct = postgres.create_database("review")
    settings = {
        "QP_TEST_LEDGER": proxy.url(direct, postgres.port),
        "QP_TEST_RUNS": postgres.create_database("runs"),
        **SHORT_LEASE,
        **(env or {}),
    }
    stack = make_stack(broker, env=settings, **worker)
    stack.ledger.close()
    stack.ledger = open_ledger(direct)
    return stack


# --- R1: a lost claim reply -----------------------------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_r1_a_claim_whose_reply_is_lost_still_runs_the_attempt(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The claim commits, its reply is lost and the server refuses connections for a
    moment; the delivery's next try finds its own token and runs. Before the fix each
    try minted a new token, read the landed claim back as "busy", and the orphaned
    claim lapsed into a failed attempt that never ran."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t, idle = tag(), idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=t, retry_limit=0, queue=idle
    )
    assert dispatch_id is not None
    # The acceptance mark written, nothing but the worker's claim names the id any more.
    stack.wait_status(dispatch_id, "queued")
    message = capture(stack, idle)
    proxy.arm(dispatch_id.encode(), refuse_for=1.5)
    deliver(stack, message)
    assert proxy.fired.wait(20), "the worker never sent its claim"
    assert b"UPDATE" in proxy.fired_data
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt, row.last_error) == ("completed", 1, None)
    assert [r["attempt"] for r in stack.runs(t)] == [1]


# --- R2: an adopted plain delivery keeps its route ------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_r2_a_parked_plain_delivery_goes_back_by_its_exchange_and_routing_key(
    make_stack: StackFactory, broker: str
) -> None:
    """Topic routing as in Celery's routing guide: the routing key `task.default` names
    no queue. A plain call of a singleton job parked behind a running one is sent again,
    once the slot frees, through the exchange and key it came by. Before the fix the
    routing key was stored as its queue, and it went to a queue nobody reads."""
    stack = make_stack(broker, start_worker=False)
    app, questpie = routeapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    try:
        stack.start_worker(app="tests.support.routeapp:celery_app")
        task = app.tasks["policy.singleton"]
        t1, t2 = tag(), tag()
        gate = stack.gate()
        first = task.delay({"tag": t1, "gate": str(gate)})
        stack.wait_status(first.id, "active")
        second = task.delay({"tag": t2})
        stack.wait_status(second.id, "parked")
        gate.open()
        stack.wait_status(first.id, "completed")
        stack.wait_status(second.id, "completed")
        assert [r["dispatch_id"] for r in stack.runs(t2)] == [second.id]
    finally:
        questpie.close()


# --- R3: a ledger outage longer than the lease ----------------------------------------


def lease_lapsed(stack: Stack, dispatch_id: str) -> bool:
    """Whether the row's lease has run out by the database's clock."""
    c = dispatch_table.c
    with stack.ledger.engine.connect() as conn:
        return bool(
            conn.execute(
                select(c.lease_expires_at < func.now()).where(c.id == dispatch_id)
            ).scalar_one()
        )


def renewal_failures(stack: Stack, dispatch_id: str) -> int:
    return sum("could not renew the claim" in line for line in stack.worker.log_about(dispatch_id))


@pytest.mark.parametrize("broker", BROKERS)
def test_r3_a_ledger_outage_longer_than_the_lease_does_not_run_a_live_handler_twice(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The worker and its relay lose the ledger while a handler runs, for longer than the
    lease. When the ledger is back, the holder renews its claim before the relay ends
    it. Before the fix the relay (every 0.2 s) ended the lapsed lease before the renewer
    (every lease/3 s) tried again, and a second run started beside the live one."""
    stack = via_proxy(
        make_stack,
        postgres,
        proxy,
        broker,
        env={"QP_TEST_LEASE": "6", "QP_TEST_RELAY": "0.2"},
        loglevel="debug",  # every failed renewal is logged (after the first, at DEBUG)
    )
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=t
    )
    assert dispatch_id is not None
    token = stack.wait_status(dispatch_id, "active").claim_token
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


# --- R4: a lost unpark reply -----------------------------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_r4_an_unpark_whose_reply_is_lost_still_sends_the_parked_run(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The unpark (parked -> queued) commits and its reply is lost; the retried update
    matches nothing, the row is read back and the run is sent. Before the fix it was
    taken for another process's win: the row stayed `queued` with no message, for an
    hour, holding the stately slot's waiting place."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t = tag()
    gate = stack.gate()
    jobs = stack.questpie.queue["policy.stately"]
    first = jobs.publish({"tag": t, "gate": str(gate)})
    assert first is not None
    stack.wait_status(first, "active")
    second = jobs.publish({"tag": t})
    assert second is not None
    stack.wait_status(second, "parked")
    # The worker logs this after its last statement naming the parked row; the
    # publisher's acceptance mark is written too: only the unpark names it next.
    stack.wait_log(second, "parked: its")
    wait_until(lambda: stack.row(second).queued_at is not None, "the acceptance mark")
    proxy.arm(second.encode())
    gate.open()
    assert proxy.fired.wait(20), "nobody unparked the parked run"
    assert b"UPDATE" in proxy.fired_data
    stack.wait_status(first, "completed")
    row = stack.wait_status(second, "completed")
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [first, second]


# --- R5: a lost insert reply -----------------------------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_r5_a_publish_whose_insert_reply_is_lost_returns_its_id_and_sends(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """An unkeyed publish of a singleton job whose INSERT commits and loses its reply:
    the retried insert conflicts with its own row, and publish returns the row's id and
    sends it. Before the fix it returned None ("suppressed, nothing written")."""
    stack = via_proxy(make_stack, postgres, proxy, broker, start_worker=False)
    proxy.arm(b"INSERT INTO questpie_queue_dispatch")
    dispatch_id = stack.questpie.queue["policy.singleton"].publish({"tag": tag()})
    assert proxy.fired.is_set(), "the publish sent no insert"
    with stack.ledger.engine.connect() as conn:
        written = conn.execute(select(dispatch_table.c.id)).scalars().all()
    assert written == [dispatch_id]
    assert capture(stack, stack.queue_name).headers["id"] == dispatch_id


# --- R6: the relay's refused send of a row the broker once accepted --------------------


def closed_broker(broker: str) -> str:
    """A broker URL nothing listens on."""
    port = free_port()
    if broker == "redis":
        return f"redis://127.0.0.1:{port}/0"
    return f"amqp://guest:guest@127.0.0.1:{port}//"


@pytest.mark.parametrize("broker", BROKERS)
def test_r6_a_refused_relay_send_of_a_retry_is_tried_again_soon(
    make_stack: StackFactory, broker: str
) -> None:
    """The relay sends a due `retry` row and the broker refuses: the row is due again in
    seconds (2**send_count), not after redeliver_after (an hour), since the broker never
    took this send. Before the fix every non-pending row waited the hour."""
    stack = make_stack(broker, start_worker=False)
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=idle_queue()
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    # Its first attempt failed and the retry's message was lost: due for the relay now.
    with stack.ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(
                status="retry",
                attempt=1,
                last_error="RuntimeError",
                next_send_at=datetime.now(UTC) - timedelta(seconds=1),
            )
        )
    _, offline = jobapp.build(
        broker=closed_broker(broker), ledger=stack.env["QP_TEST_LEDGER"], queue=stack.queue_name
    )
    try:
        assert offline.run_relay(once=True) == 0  # refused
    finally:
        offline.close()
    row = stack.row(dispatch_id)
    assert (row.status, row.send_count) == ("retry", 1)
    assert row.next_send_at is not None
    assert row.next_send_at - datetime.now(UTC) <= timedelta(seconds=10), "waits too long"


# --- R7: ledger and broker down together ----------------------------------------------


def test_r7_a_delivery_the_broker_will_not_take_back_waits_for_the_ledger(
    proxy: FaultProxy,
    make_stack: StackFactory,
    postgres: PostgresServer,
    redis_server: RedisServer,
) -> None:
    """A plain call of a singleton job meets a ledger that stays unreachable past the
    fence's patience, and the broker refuses the delivery back too: the worker keeps
    trying both, and runs it once the ledger is back. Before the fix the refused
    requeue failed the task: the message was acknowledged, no row existed, and the
    run was lost. Redis only: `maxmemory 1` makes it refuse writes on cue."""
    stack = via_proxy(make_stack, postgres, proxy, "redis")
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


# --- R8: a failed hand-on after a recorded completion ---------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_r8_a_hand_on_that_meets_the_ledger_down_does_not_break_a_chain(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """Step 1 of a chain of a singleton job completes; the slot hand-on that follows
    meets the ledger down. The completion stands, Celery sees success and sends step 2.
    Before the fix the hand-on's error failed the Celery task and the chain stopped."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
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


# --- R11: a result backend that refuses the STARTED state -----------------------------


@pytest.fixture
def refusing_backend() -> Iterator[RedisServer]:
    """A Redis result backend that refuses every write."""
    server = RedisServer().start()
    client = redis.Redis(port=server.port)
    client.config_set("maxmemory", 1)
    client.close()
    yield server
    server.close()


@pytest.mark.parametrize("broker", BROKERS)
def test_r11_a_backend_refusing_started_does_not_orphan_the_claim(
    refusing_backend: RedisServer, make_stack: StackFactory, broker: str
) -> None:
    """With task_track_started, storing STARTED fails: the run goes on and completes.
    Before the fix the error escaped with the claim taken and nobody renewing it: the
    lease lapsed into a failed attempt that never ran."""
    stack = make_stack(
        broker,
        env={"QP_TEST_BACKEND": refusing_backend.url(1), "QP_TEST_EXTENDED": "1", **SHORT_LEASE},
    )
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t, retry_limit=0)
    assert dispatch_id is not None
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t, "end")) == 1
    stack.wait_log(dispatch_id, "could not store its STARTED state")
