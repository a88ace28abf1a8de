"""Regression tests for the second review's findings (A-G), on real servers and workers.

The faults are real: a TCP proxy in front of PostgreSQL (tests/support/faultproxy.py)
loses a committed statement's reply or cuts every connection, a PostgreSQL database
set read-only refuses writes as a standby (or a primary being demoted) does, and a
Redis result backend is stopped with SIGSTOP. Stacks whose ledger meets a fault keep
their `test_runs` table in a database of their own, and the test reads the ledger
through a direct connection: only the worker's and the publisher's traffic meets it.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, Questpie, QuestpieError, job
from questpie_celery.fence import CLAIM_PATIENCE_SECONDS
from tests.integration.conftest import StackFactory
from tests.integration.test_review_findings import (
    SHORT_LEASE,
    idle_queue,
    lease_lapsed,
    via_proxy,
    wait_ended,
    wait_until,
)
from tests.support import jobapp
from tests.support.brokers import capture, deliver
from tests.support.faultproxy import FaultProxy
from tests.support.services import PostgresServer, RedisServer
from tests.support.stack import Stack, tag

BROKERS = ["redis", "rabbitmq"]


@pytest.fixture
def proxy(postgres: PostgresServer) -> Iterator[FaultProxy]:
    made = FaultProxy(postgres.port)
    yield made
    made.close()


def logged(stack: Stack, dispatch_id: str, *texts: str) -> bool:
    """Whether a worker of the stack logged any of `texts` on a line naming the dispatch."""
    workers = [stack.worker, *stack.extra_workers]
    return any(t in line for w in workers for line in w.log_about(dispatch_id) for t in texts)


def wait_logged(stack: Stack, dispatch_id: str, *texts: str, timeout: float = 30.0) -> None:
    wait_until(lambda: logged(stack, dispatch_id, *texts), f"{texts} about {dispatch_id}", timeout)


# --- A: a delivery sent back to the broker while the ledger is down -------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_a_delivery_sent_back_while_the_ledger_is_down_keeps_its_claim(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The claim commits, its reply is lost, and the ledger stays unreachable past the
    fence's patience: the delivery goes back to the broker carrying its fencing token,
    and its next delivery finds its own claim and runs. Before the fix the delivery went
    back without its token, the next one read the landed claim as "busy" and was
    ignored, and the orphaned claim lapsed into a failed attempt that never ran."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t, idle = tag(), idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=t, retry_limit=0, queue=idle
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    message = capture(stack, idle)
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


# --- B: the soft time limit falls while the outcome is being recorded -----------------

#: A run's soft time limit (its expire_in_seconds) in B: longer than it takes to start
#: the run and open its gate, short enough for a quick test.
SOFT_LIMIT = 6


@pytest.mark.parametrize("broker", BROKERS)
def test_b_a_soft_time_limit_while_recording_the_outcome_does_not_run_the_handler_again(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The handler returned; recording `completed` meets the ledger down, and the run's
    soft time limit falls while the write waits. The write goes on and lands once the
    ledger is back. Before the fix SoftTimeLimitExceeded escaped the wait, nobody
    recorded the outcome, and the relay ran the handler a second time. (The limit may
    fall anywhere in the wait: in a try, or in the pause between two tries.)"""
    stack = via_proxy(make_stack, postgres, proxy, broker)
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


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def log_times(lines: list[str]) -> list[datetime]:
    """The timestamps of worker log lines (Celery's format: `[2026-01-02 03:04:05,678: ...`)."""
    found = [LOG_TIME.match(line) for line in lines]
    return [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for m in found if m]


@pytest.mark.parametrize("broker", BROKERS)
def test_b_an_outcome_write_pauses_between_tries_while_the_ledger_is_down(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """While the ledger is down, recording an outcome is tried again after growing
    pauses (0.1 s, 0.2 s, 0.4 s ... up to 2 s), not in a busy loop that floods the log
    and the database with connection attempts. (B's fix moved the pause under the new
    `except SoftTimeLimitExceeded`: the tries after an outage error no longer pause.)"""
    # Every try is logged (after the first, at DEBUG).
    stack = via_proxy(make_stack, postgres, proxy, broker, loglevel="debug")
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=t
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")

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


# --- C: the soft time limit falls while a delivery waits out an outage ----------------

#: Soft time limits shorter than the fence's patience. The fence tries the ledger again
#: after pauses of 0.2, 0.4, 0.8, 1.6, 3.2 s ...: its tries fall at about 0, 0.2, 0.6,
#: 1.4, 3.0 and 6.2 s. With 5 s it sends the delivery back at the 3.0 s try (the limit's
#: margin starts there); with 6 s the margin starts at 4 s, inside the pause that runs
#: from 3.0 to 6.2 s, and the limit falls during that pause.
SOFT_LIMITS = [5, 6]


@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("soft_limit", SOFT_LIMITS)
def test_c_a_plain_call_waiting_for_the_ledger_goes_back_before_its_soft_time_limit(
    proxy: FaultProxy,
    make_stack: StackFactory,
    postgres: PostgresServer,
    broker: str,
    soft_limit: int,
) -> None:
    """A plain call of a singleton job, with a soft time limit shorter than the fence's
    patience, meets the ledger down: it goes back to the broker before the limit falls,
    and runs once the ledger is back. Before the fix SoftTimeLimitExceeded escaped the
    wait with the message acknowledged: no row, no run, the call was lost."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t = tag()
    proxy.cut()
    try:
        sent = stack.celery_app.tasks["policy.singleton"].apply_async(
            args=[{"tag": t}], soft_time_limit=soft_limit
        )
        wait_logged(
            stack, sent.id, "went back to the broker", "Soft time limit", timeout=soft_limit + 20
        )
    finally:
        proxy.heal()
    assert not logged(stack, sent.id, "Soft time limit"), "the limit fell while it waited"
    row = stack.wait_status(sent.id, "completed", timeout=30)
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [sent.id]


@pytest.mark.parametrize("broker", BROKERS)
@pytest.mark.parametrize("soft_limit", SOFT_LIMITS)
def test_c_a_dispatch_waiting_to_claim_goes_back_before_its_soft_time_limit(
    proxy: FaultProxy,
    make_stack: StackFactory,
    postgres: PostgresServer,
    broker: str,
    soft_limit: int,
) -> None:
    """A published dispatch whose expire_in_seconds (its soft time limit) is shorter than
    the fence's patience is delivered while the ledger is down: it goes back to the
    broker before the limit falls and runs once the ledger is back. Before the fix
    SoftTimeLimitExceeded escaped the wait with the message acknowledged, and the row
    waited for the relay's redeliver_after (an hour)."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t, idle = tag(), idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=t, queue=idle, expire_in_seconds=soft_limit
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    message = capture(stack, idle)
    proxy.cut()
    try:
        deliver(stack, message)
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
    assert [r["attempt"] for r in stack.runs(t)] == [1]


# --- D: a one-shot relay right after an outage ----------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_d_a_one_shot_relay_leaves_a_lapsed_lease_of_a_live_run_alone(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """A run's holder is cut off from the ledger until its lease lapses; an operator's
    `questpie-celery relay --once` (run_relay(once=True)) reaches the ledger meanwhile.
    It cannot tell a dead holder from a cut-off one, so it leaves the lease alone; the
    holder renews once it is back, and the run completes once. Before the fix the
    one-shot pass ended the claim at once and a retry ran beside the live run."""
    stack = via_proxy(make_stack, postgres, proxy, broker)
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=t
    )
    assert dispatch_id is not None
    token = stack.wait_status(dispatch_id, "active").claim_token
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


# --- E: a result backend that stalls while STARTED is stored --------------------------


@pytest.fixture
def stalling_backend() -> Iterator[RedisServer]:
    """A Redis result backend of its own, for a test to pause."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.mark.parametrize("broker", BROKERS)
def test_e_a_result_backend_stalling_at_started_does_not_lapse_the_claim(
    stalling_backend: RedisServer, make_stack: StackFactory, broker: str
) -> None:
    """With task_track_started, the result backend stalls while the fence stores STARTED,
    for longer than the lease: the claim is renewed all the while (STARTED is stored
    inside the lease hold), and the run goes on once the backend answers. Before the fix
    STARTED was stored before the renewer held the claim: the lease lapsed, the relay
    retried it, and the stalled run went on too: two completions."""
    lease = float(SHORT_LEASE["QP_TEST_LEASE"])
    stack = make_stack(
        broker,
        env={"QP_TEST_BACKEND": stalling_backend.url(1), "QP_TEST_EXTENDED": "1", **SHORT_LEASE},
    )
    t, idle = tag(), idle_queue()
    # Published (which subscribes to the result on this backend) before it stalls.
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t, queue=idle)
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    message = capture(stack, idle)
    stalling_backend.pause()
    try:
        deliver(stack, message)
        first = stack.wait_status(dispatch_id, "active")
        assert first.started_at is not None

        def renewed_through_two_leases_or_ended() -> bool:
            row = stack.row(dispatch_id)
            if (row.status, row.claim_token) != ("active", first.claim_token):
                return True
            assert row.lease_expires_at is not None
            assert first.started_at is not None
            return row.lease_expires_at - first.started_at > timedelta(seconds=3 * lease)

        wait_until(renewed_through_two_leases_or_ended, "the claim to outlive two leases")
        row = stack.row(dispatch_id)
        assert (row.status, row.attempt, row.claim_token) == ("active", 1, first.claim_token)
        assert stack.runs(t) == []  # still storing STARTED: the handler has not begun
    finally:
        stalling_backend.resume()
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


# --- F: the recorded policy of a job, at a worker cut off from the ledger -------------


@pytest.mark.parametrize("broker", BROKERS)
def test_f_a_worker_knows_the_recorded_policy_before_the_ledger_goes_down(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """`record` is declared standard but recorded `exclusive` (`policy set`) before the
    worker starts; then the ledger goes down. Two plain calls of it wait for the ledger;
    then one runs and the other is suppressed, as the policy says. Before the fix the
    pool's children were forked before any policy was read, could not read it now, and
    fell back to the declaration: both calls ran at once, unfenced."""
    stack = via_proxy(make_stack, postgres, proxy, broker, start_worker=False)
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
def test_f_a_worker_that_could_not_read_a_policy_waits_for_the_ledger(
    proxy: FaultProxy, make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """A worker starts while the ledger is down, so it has read no job's policy; a plain
    call of `record` (recorded `exclusive`, declared standard) waits for the ledger and
    then runs fenced, under a ledger row. Before the fix the worker guessed the
    declaration and ran the call at once, without a row."""
    stack = via_proxy(make_stack, postgres, proxy, broker, start_worker=False)
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


# --- G: a read-only PostgreSQL (a standby, or a failover in progress) -----------------


def own_runs_stack(make_stack: StackFactory, postgres: PostgresServer, broker: str) -> Stack:
    """A stack whose test_runs table is in a database of its own (it stays writable)."""
    return make_stack(broker, env={"QP_TEST_RUNS": postgres.create_database("runs"), **SHORT_LEASE})


@pytest.mark.parametrize("broker", BROKERS)
def test_g_a_completion_that_meets_a_read_only_ledger_waits_for_it(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The handler returned; the ledger turns read-only (SQLSTATE 25006) before
    `completed` is recorded. The write waits it out like an outage and lands once the
    database takes writes again. Before the fix 25006 was a plain LedgerError: it
    escaped, the claim lapsed, and the relay ran the handler again."""
    stack = own_runs_stack(make_stack, postgres, broker)
    ledger_url = stack.env["QP_TEST_LEDGER"]
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    postgres.set_read_only(ledger_url, True)
    try:
        gate.open()
        assert len(stack.wait_ends(t, 1)) == 1
        wait_logged(stack, dispatch_id, "read-only", "raised unexpected")
    finally:
        postgres.set_read_only(ledger_url, False)
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_g_a_plain_call_that_meets_a_read_only_ledger_waits_for_it(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """A plain call of a singleton job is taken into a ledger that is read-only: the
    worker waits until it takes writes again, then runs the call. Before the fix the
    adoption's LedgerError failed the task with the message acknowledged: no row, no
    run."""
    stack = own_runs_stack(make_stack, postgres, broker)
    ledger_url = stack.env["QP_TEST_LEDGER"]
    t = tag()
    postgres.set_read_only(ledger_url, True)
    try:
        sent = stack.celery_app.tasks["policy.singleton"].delay({"tag": t})
        wait_logged(stack, sent.id, "read-only", "raised unexpected")
    finally:
        postgres.set_read_only(ledger_url, False)
    row = stack.wait_status(sent.id, "completed", timeout=40)
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [sent.id]


class Letter(BaseModel):
    text: str


@job(name="review2.letter", schema=Letter)
def letter(payload: Letter, ctx: JobContext) -> None:
    pass


def test_g_a_secret_publish_onto_a_read_only_ledger_logs_no_key_material(
    pg_db: str, postgres: PostgresServer
) -> None:
    """A secret publish meets a read-only PostgreSQL: the error, logged with its causes,
    names no statement value. Before the fix the driver error it chained printed the
    statement's parameters: the ciphertext and the wrapped data key as bytes."""
    questpie = Questpie(
        Celery("review2", broker="memory://"), ledger_url=pg_db, jobs=[letter], secret="x" * 40
    )
    questpie.migrate()
    postgres.set_read_only(pg_db, True)
    try:
        with pytest.raises(QuestpieError) as raised:
            questpie.queue.review2_letter.publish(
                {"text": "top secret"}, idempotency_key="k", secret_payload=True
            )
        shown = "".join(traceback.format_exception(raised.value))
        assert "read-only" in shown  # the driver's reason is there, no statement value
        assert "secret_wrapped_key" not in shown or "parameters hidden" in shown
        assert "b'" not in shown
    finally:
        postgres.set_read_only(pg_db, False)
        questpie.close()
