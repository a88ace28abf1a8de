"""Queue policies and singleton keys with real workers, PostgreSQL, and Redis or RabbitMQ.

Runs are held open with gates, never timed with sleeps: a gated run stays `active`,
and a run its slot keeps from starting stays `parked`, for as long as the gate is
closed. Order is read from the start and end rows the handlers record.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from celery.result import AsyncResult
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, reject, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, func, select, text

from questpie_celery import JobContext, Questpie, job
from questpie_celery.cli.commands import main
from questpie_celery.jobs.ids import MAX_DISPATCH_ID_BYTES, unstorable_id
from questpie_celery.ledger import dispatch_table, policy_table
from questpie_celery.signals import publish_suppressed
from questpie_celery.worker.fence import shown_id
from tests.integration.conftest import StackFactory
from tests.support import jobapp, routeapp
from tests.support.brokers import capture, deliver, queue_depth
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

BROKERS = ["redis", "rabbitmq"]


def slot() -> str:
    return f"slot-{uuid.uuid4().hex[:10]}"


def idle() -> str:
    """A queue no worker reads: what is published there stays there."""
    return f"idle-{uuid.uuid4().hex[:8]}"


Span = tuple[datetime, datetime, str, int]


def spans(stack: Stack, t: str) -> list[Span]:
    """(start, end, dispatch id, attempt) of every finished run of tag `t`, by start.

    Ties (SQLite records whole seconds) go by the order the start rows were written.
    """
    starts = {(r["dispatch_id"], r["attempt"]): (r["ran_at"], r["id"]) for r in stack.runs(t)}
    found = sorted(
        (starts[(r["dispatch_id"], r["attempt"])], r["ran_at"], r["dispatch_id"], r["attempt"])
        for r in stack.runs(t, phase="end")
    )
    return [(start, end, dispatch_id, attempt) for (start, _), end, dispatch_id, attempt in found]


def assert_no_overlap(found: list[Span]) -> None:
    for (_, end, before, _), (start, _, after, _) in itertools.pairwise(found):
        assert start >= end, f"runs {before} and {after} of one slot overlapped"


def slot_rows(stack: Stack, job_name: str, key: str) -> int:
    with stack.ledger.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(dispatch_table)
                .where(dispatch_table.c.job_name == job_name, dispatch_table.c.slot == key)
            ).scalar_one()
        )


def move_to_worker(stack: Stack, queue: str, count: int = 1) -> None:
    """Hand the messages waiting in an idle queue to the worker's queue."""
    for _ in range(count):
        deliver(stack, capture(stack, queue))


@pytest.fixture
def suppressed() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()

    def receiver(sender: str, **kwargs: Any) -> None:
        with lock:
            seen.append({"sender": sender, **kwargs})

    publish_suppressed.connect(receiver, weak=False)
    yield seen
    publish_suppressed.disconnect(receiver)


# --- publish-time policies ------------------------------------------------------------------


def test_exclusive_eight_concurrent_publishers_one_accepted(
    stack: Stack, suppressed: list[dict[str, Any]]
) -> None:
    t, key = tag(), slot()
    gate = stack.gate()
    client = stack.questpie.queue.policy_exclusive
    barrier = threading.Barrier(8)
    results: list[str | None] = []
    lock = threading.Lock()

    def publish() -> None:
        barrier.wait()
        dispatch_id = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
        with lock:
            results.append(dispatch_id)

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = [r for r in results if r is not None]
    assert len(results) == 8
    assert len(accepted) == 1
    assert slot_rows(stack, "policy.exclusive", key) == 1
    mine = [s for s in suppressed if s["singleton_key"] == key]
    assert len(mine) == 7
    assert {(s["sender"], s["job_name"], s["policy"]) for s in mine} == {
        ("policy.exclusive", "policy.exclusive", "exclusive")
    }
    # While it runs (the gate holds it active) the slot stays taken ...
    stack.wait_status(accepted[0], "active")
    assert client.publish({"tag": t}, singleton_key=key) is None
    gate.open()
    # ... and once it finished, it is free again.
    stack.wait_status(accepted[0], "completed")
    again = client.publish({"tag": t}, singleton_key=key)
    assert again is not None
    stack.wait_status(again, "completed")
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted([accepted[0], again])


def test_policy_applies_per_singleton_key_and_to_the_whole_job(stack: Stack) -> None:
    client = stack.questpie.queue.policy_exclusive
    t, queue = tag(), idle()
    first, second = slot(), slot()
    a = client.publish({"tag": t}, singleton_key=first, queue=queue)
    b = client.publish({"tag": t}, singleton_key=second, queue=queue)
    assert a is not None and b is not None and a != b
    assert client.publish({"tag": t}, singleton_key=first, queue=queue) is None
    assert client.publish({"tag": t}, singleton_key=second, queue=queue) is None
    # Without a singleton key the slot is the job as a whole: one more, then no more.
    whole = client.publish({"tag": t}, queue=queue)
    assert whole is not None
    assert client.publish({"tag": t}, queue=queue) is None
    assert queue_depth(stack, queue) == 3
    # Let them run, which frees the job's whole-job slot for the tests that use it.
    move_to_worker(stack, queue, 3)
    for dispatch_id in (a, b, whole):
        assert stack.wait_status(dispatch_id, "completed").attempt == 1
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted([a, b, whole])


def test_known_idempotency_key_is_answered_before_the_policy(stack: Stack) -> None:
    # A key and a singleton key do not go together: this is the job's whole-job slot.
    client = stack.questpie.queue.policy_short
    t, queue = tag(), idle()
    key = f"short:{t}"
    dispatch_id = client.publish({"tag": t}, idempotency_key=key, queue=queue)
    assert dispatch_id is not None
    try:
        # The slot's one waiting place is taken by that dispatch, yet its key answers ...
        assert client.publish({"tag": t}, idempotency_key=key, queue=queue) == dispatch_id
        # ... while another key, or none, is refused by the policy.
        assert client.publish({"tag": t}, idempotency_key=key + "-other", queue=queue) is None
        assert client.publish({"tag": t}, queue=queue) is None
        assert queue_depth(stack, queue) == 1
    finally:
        # Let it run: that frees the whole-job slot for the other tests.
        move_to_worker(stack, queue)
    stack.wait_status(dispatch_id, "completed")
    assert len(stack.runs(t)) == 1


def test_short_allows_one_queued_and_any_number_active(stack: Stack) -> None:
    client = stack.questpie.queue.policy_short
    t, key, queue = tag(), slot(), idle()
    gates = [stack.gate(), stack.gate()]
    running = client.publish({"tag": t, "gate": str(gates[0])}, singleton_key=key)
    assert running is not None
    stack.wait_status(running, "active")
    waiting = client.publish({"tag": t, "gate": str(gates[1])}, singleton_key=key, queue=queue)
    assert waiting is not None  # the active run does not count as waiting
    assert client.publish({"tag": t}, singleton_key=key) is None  # one waits already
    # The waiting one starts while the first still runs: two active at once.
    move_to_worker(stack, queue)
    stack.wait_status(waiting, "active")
    assert stack.row(running).status == "active"
    # Nothing waits now, so one more is accepted.
    third = client.publish({"tag": t}, singleton_key=key, queue=queue)
    assert third is not None
    assert client.publish({"tag": t}, singleton_key=key) is None
    for gate in gates:
        gate.open()
    stack.wait_status(running, "completed")
    stack.wait_status(waiting, "completed")
    assert client.publish({"tag": t}, singleton_key=key) is None  # `third` still waits
    move_to_worker(stack, queue)
    stack.wait_status(third, "completed")
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted([running, waiting, third])


def test_stately_one_queued_one_active_and_the_parked_run_follows(stack: Stack) -> None:
    client = stack.questpie.queue.policy_stately
    t, key = tag(), slot()
    gate = stack.gate()
    first = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert first is not None
    stack.wait_status(first, "active")
    second = client.publish({"tag": t}, singleton_key=key)
    assert second is not None
    row = stack.wait_status(second, "parked")  # delivered, but the slot is busy
    assert row.attempt == 0  # waiting for a slot is not an attempt
    assert [r["dispatch_id"] for r in stack.runs(t)] == [first]
    assert client.publish({"tag": t}, singleton_key=key) is None  # one waits already
    gate.open()
    stack.wait_status(first, "completed")
    assert stack.wait_status(second, "completed").attempt == 1
    found = spans(stack, t)
    assert [(s[2], s[3]) for s in found] == [(first, 1), (second, 1)]
    assert_no_overlap(found)


def test_singleton_runs_never_overlap_and_none_is_lost(stack: Stack) -> None:
    client = stack.questpie.queue.policy_singleton
    t, key = tag(), slot()
    gate = stack.gate()
    holder = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert holder is not None
    stack.wait_status(holder, "active")
    # Each run takes a moment, so overlapping runs would show in the start/end rows.
    others = [client.publish({"tag": t, "sleep": 0.2}, singleton_key=key) for _ in range(5)]
    assert all(dispatch_id is not None for dispatch_id in others)  # waiting: unlimited
    ids = [holder, *(d for d in others if d is not None)]
    for dispatch_id in ids[1:]:
        assert stack.wait_status(dispatch_id, "parked").attempt == 0
        stack.wait_log(dispatch_id, "parked")
    gate.open()
    for dispatch_id in ids:
        assert stack.wait_status(dispatch_id, "completed", timeout=60).attempt == 1
    found = spans(stack, t)
    assert sorted(s[2] for s in found) == sorted(ids)
    assert len(stack.runs(t)) == len(ids)
    assert_no_overlap(found)
    assert found[0][2] == holder


def test_singleton_retry_keeps_the_slot(stack: Stack) -> None:
    client = stack.questpie.queue.policy_singleton
    t, key = tag(), slot()
    gate = stack.gate()
    failing = client.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1, "fail_times": 1},
        singleton_key=key,
        retry_delay=1,
    )
    assert failing is not None
    stack.wait_status(failing, "active")
    after = client.publish({"tag": t}, singleton_key=key)
    assert after is not None
    stack.wait_status(after, "parked")
    gate.open()
    assert stack.wait_status(failing, "completed").attempt == 2
    stack.wait_status(after, "completed")
    # The retry ran before the next run of the slot started.
    starts = [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)]
    assert starts == [(failing, 1), (failing, 2), (after, 1)]
    found = spans(stack, t)
    assert [(s[2], s[3]) for s in found] == [(failing, 2), (after, 1)]
    assert_no_overlap(found)


def test_standard_job_ignores_singleton_key_and_warns_once(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    # A Questpie of its own: the warning is once per instance, and this one is fresh.
    celery_app, questpie = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    name = f"standard-{uuid.uuid4().hex[:8]}"

    @questpie.job(name=name, schema=jobapp.Work)
    def plain(payload: jobapp.Work, ctx: JobContext) -> None:
        del payload, ctx

    t, key, queue = tag(), slot(), idle()
    try:
        with caplog.at_level(logging.WARNING, logger="questpie_celery"):
            ids = [questpie.queue[name].publish({"tag": t}, singleton_key=key, queue=queue)]
            ids.append(questpie.queue[name].publish({"tag": t}, singleton_key=key, queue=queue))
            ran = [questpie.queue.record.publish({"tag": t}, singleton_key=key) for _ in range(2)]
        # Both accepted, as plain messages without a ledger row: the key changed nothing.
        assert all(ids) and ids[0] != ids[1]
        assert queue_depth(stack, queue) == 2
        assert all(stack.ledger.get(str(i)) is None for i in [*ids, *ran])
        ends = stack.wait_ends(t, 2)
        assert sorted(r["dispatch_id"] for r in ends) == sorted(str(i) for i in ran)
        warnings = [
            r.getMessage()
            for r in caplog.records
            if "singleton_key has no effect" in r.getMessage() and name in r.getMessage()
        ]
        assert warnings == [
            f"job {name} has the standard queue policy: singleton_key has no effect"
        ]
    finally:
        questpie.close()
        celery_app.close()


def _policy_questpie(ledger_url: str, name: str, policy: str | None) -> Questpie:
    """A Questpie (in-memory broker, no worker) with one job `name` declaring `policy`."""
    options: Any = {"queue_policy": policy} if policy else {}

    @job(name=name, schema=jobapp.Work, options=options)
    def handler(payload: jobapp.Work, ctx: JobContext) -> None:
        del payload, ctx

    _, questpie = jobapp.build(broker="memory://", ledger=ledger_url)
    questpie.register(handler)
    questpie.migrate()
    return questpie


def test_first_recorded_policy_wins_and_policy_set_changes_it(
    pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"policy-race-{uuid.uuid4().hex[:6]}"
    exclusive = _policy_questpie(pg_db, name, "exclusive")
    short = _policy_questpie(pg_db, name, "short")
    try:
        assert exclusive.queue[name].publish({"tag": "a"}) is not None
        with caplog.at_level(logging.WARNING, logger="questpie_celery"):
            # Recorded exclusive: the second publish of the whole-job slot is refused.
            assert short.queue[name].publish({"tag": "b"}) is None
        assert any(
            f"job {name} declares queue_policy=short but the ledger records exclusive"
            in r.getMessage()
            for r in caplog.records
        )
        engine = create_engine(pg_db)
        with engine.connect() as conn:
            recorded = conn.execute(
                select(policy_table.c.policy).where(policy_table.c.job_name == name)
            ).scalar_one()
        engine.dispose()
        assert recorded == "exclusive"
        assert short.get_policy(name) == "exclusive"
        result = CliRunner().invoke(main, ["policy", "set", name, "stately", "--ledger-url", pg_db])
        assert result.exit_code == 0, result.output
        assert exclusive.get_policy(name) == "stately"
        shown = CliRunner().invoke(main, ["policy", "show", name, "--ledger-url", pg_db])
        assert shown.exit_code == 0, shown.output
        assert shown.output.strip() == f"{name}: stately"
        unknown = CliRunner().invoke(main, ["policy", "show", name + "-x", "--ledger-url", pg_db])
        assert unknown.output.strip() == f"{name}-x: standard (none recorded)"
        exclusive.set_policy(name, "singleton")
        assert short.get_policy(name) == "singleton"
    finally:
        exclusive.close()
        short.close()


def test_publish_time_policy_counts_only_while_none_is_recorded(pg_db: str) -> None:
    name = f"policy-late-{uuid.uuid4().hex[:6]}"
    questpie = _policy_questpie(pg_db, name, None)
    try:
        client = questpie.queue[name]
        assert questpie.get_policy(name) is None
        assert client.publish({"tag": "a"}, queue_policy="exclusive") is not None
        assert questpie.get_policy(name) == "exclusive"
        assert client.publish({"tag": "b"}, queue_policy="exclusive") is None
        # Recorded now: a different publish-time policy (or none) changes nothing.
        assert client.publish({"tag": "c"}, queue_policy="standard") is None
        assert client.publish({"tag": "d"}) is None
        assert questpie.get_policy(name) == "exclusive"
    finally:
        questpie.close()


# --- plain Celery calls of policy jobs ------------------------------------------------------


def test_plain_calls_of_an_exclusive_job_go_through_its_policy(stack: Stack) -> None:
    t = tag()
    gate = stack.gate()
    holder = stack.questpie.queue.policy_exclusive.publish({"tag": t, "gate": str(gate)})
    assert holder is not None
    stack.wait_status(holder, "active")
    by_delay, by_send_task = tag(), tag()
    delayed = stack.questpie.tasks["policy.exclusive"].delay({"tag": by_delay})
    sent = stack.celery_app.send_task("policy.exclusive", args=[{"tag": by_send_task}])
    for delivery in (delayed, sent):
        stack.wait_log(delivery.id, "suppressed by its exclusive queue policy")
    gate.open()
    stack.wait_status(holder, "completed")
    # Both deliveries were consumed and ignored while the slot was taken: they never run.
    assert stack.runs(by_delay) == [] and stack.runs(by_send_task) == []
    assert stack.questpie.queue.get_status(delayed.id) is None
    assert stack.questpie.queue.get_status(sent.id) is None
    # With the slot free, a plain delay() runs once, under a ledger row of its task id.
    free = tag()
    plain = stack.questpie.tasks["policy.exclusive"].delay({"tag": free})
    row = stack.wait_status(plain.id, "completed")
    assert (row.job_name, row.policy, row.slot, row.attempt) == (
        "policy.exclusive",
        "exclusive",
        "",
        1,
    )
    status = stack.questpie.queue.get_status(plain.id)
    assert status is not None and status.status == "completed"
    assert [(r["dispatch_id"], r["attempt"]) for r in stack.runs(free)] == [(plain.id, 1)]
    assert [r["dispatch_id"] for r in stack.runs(free, phase="end")] == [plain.id]


def test_plain_calls_of_a_singleton_job_park_and_follow(stack: Stack) -> None:
    t = tag()
    gate = stack.gate()
    holder = stack.questpie.queue.policy_singleton.publish({"tag": t, "gate": str(gate)})
    assert holder is not None
    stack.wait_status(holder, "active")
    task = stack.questpie.tasks["policy.singleton"]
    delayed = [task.delay({"tag": t, "sleep": 0.2}) for _ in range(2)]
    for result in delayed:
        assert stack.wait_status(result.id, "parked").attempt == 0
    assert [r["dispatch_id"] for r in stack.runs(t)] == [holder]
    gate.open()
    for dispatch_id in (holder, *(r.id for r in delayed)):
        assert stack.wait_status(dispatch_id, "completed").attempt == 1
    found = spans(stack, t)
    assert sorted(s[2] for s in found) == sorted([holder, *(r.id for r in delayed)])
    assert len(stack.runs(t)) == 3
    assert found[0][2] == holder
    assert_no_overlap(found)


def test_canvas_chain_of_a_singleton_job_runs_each_step_through_the_ledger(
    stack: Stack,
) -> None:
    t = tag()
    task = stack.questpie.tasks["policy.singleton"]
    result = (task.si({"tag": t, "sleep": 0.1}) | task.si({"tag": t, "sleep": 0.1})).apply_async()
    ends = stack.wait_ends(t, 2)
    assert len(ends) == 2
    first, second = (r["dispatch_id"] for r in stack.runs(t))
    assert first != second
    assert (first, second) == (result.parent.id, result.id)
    for dispatch_id in (first, second):
        row = stack.wait_status(dispatch_id, "completed")
        assert (row.job_name, row.policy, row.attempt) == ("policy.singleton", "singleton", 1)
    assert_no_overlap(spans(stack, t))


def test_plain_message_delivered_twice_runs_once(stack: Stack) -> None:
    """policy.short limits only waiting runs; only the fence keeps a copy from running."""
    t, queue = tag(), idle()
    gate = stack.gate()
    result = stack.questpie.tasks["policy.short"].apply_async(
        args=[{"tag": t, "gate": str(gate)}], queue=queue
    )
    message = capture(stack, queue)
    assert message.headers["id"] == result.id
    assert "questpie" not in message.headers  # a plain Celery message
    deliver(stack, message, copies=2)
    stack.wait_status(result.id, "active")
    stack.wait_log(result.id, "skipped (busy)")
    gate.open()
    assert stack.wait_status(result.id, "completed").attempt == 1
    # Once completed, a further copy is acknowledged without running.
    deliver(stack, message)
    stack.wait_log(result.id, "skipped (done)")
    assert [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)] == [(result.id, 1)]
    assert len(stack.runs(t, phase="end")) == 1


#: Task ids a plain call may carry: any text (unicode, punctuation, whitespace, NUL), and
#: long ones around the longest the ledger stores (`MAX_DISPATCH_ID_BYTES`).
#: (stack, task id) pairs a test of plain calls has used.
_TASK_IDS_USED: set[tuple[int, str]] = set()

task_ids = st.one_of(
    st.text(min_size=1, max_size=60),
    st.text(st.characters(codec="utf-8"), min_size=300, max_size=1400),
)


@given(task_id=task_ids)
@example(task_id="custom-" + "x" * 40)  # longer than a UUID: the width the ledger had
@example(task_id="order 42 / retry\t#3 \n(ünïcödé) 🚀 '\";--")
@example(task_id="x" * MAX_DISPATCH_ID_BYTES)
@example(task_id="a\0b")  # PostgreSQL text cannot hold NUL
@example(task_id="\r")  # a log read back with universal newlines lost it
@example(task_id="é" * MAX_DISPATCH_ID_BYTES)  # twice the bytes the ledger stores
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
def test_a_plain_call_under_any_task_id_runs_once_or_is_refused_out_loud(
    stack: Stack, task_id: str
) -> None:
    # An id met before on this stack (an explicit example also drawn, or a failure replayed
    # from Hypothesis's database) names a dispatch that already ran: a different test.
    assume((id(stack), task_id) not in _TASK_IDS_USED)
    _TASK_IDS_USED.add((id(stack), task_id))
    t, queue = tag(), idle()
    try:
        stack.questpie.tasks["policy.short"].apply_async(
            args=[{"tag": t}], task_id=task_id, queue=queue
        )
    except Exception:
        # Celery or the broker refused the id: not a call anyone could make. (RabbitMQ
        # carries the id as a property of at most 255 bytes.)
        reject()
    message = capture(stack, queue)
    deliver(stack, message)
    name = "policy.short"
    if unstorable_id(task_id) is None:
        row = stack.wait_status(task_id, "completed")
        assert (row.job_name, row.attempt) == (name, 1)
        deliver(stack, message)  # the broker delivers it again: it does not run again
        wait_until(
            lambda: (
                f"dispatch {task_id} of job {name}: delivery for attempt 1 skipped (done)"
                in stack.worker.log()
            ),
            "the copy to be skipped",
        )
        assert [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)] == [(task_id, 1)]
        return
    # Refused where it is taken in, with the reason; and Celery's result of the call says
    # so, rather than the call vanishing.
    wait_until(
        lambda: (
            "which cannot be a dispatch id" in stack.worker.log()
            and f"job {name} has task id {shown_id(task_id)}" in stack.worker.log()
        ),
        "the refusal to be logged",
    )
    if stack.celery_app.conf.result_backend:
        result = AsyncResult(task_id, app=stack.celery_app)
        wait_until(lambda: result.state == "FAILURE", "the call's result to say it failed")
        assert type(result.result).__name__ == "DispatchIdError"
    assert stack.runs(t) == []


# --- dead workers ---------------------------------------------------------------------------


@pytest.mark.parametrize("broker", BROKERS)
def test_killed_worker_frees_its_slot_when_the_lease_expires(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, env={"QP_TEST_LEASE": "2"})
    client = stack.questpie.queue.policy_singleton
    t, key = tag(), slot()
    gate = stack.gate()  # never opened: attempt 1 hangs until its worker is killed
    stuck = client.publish({"tag": t, "gate": str(gate), "gate_attempts": 1}, singleton_key=key)
    assert stuck is not None
    stack.wait_status(stuck, "active")
    waiting = client.publish({"tag": t}, singleton_key=key)
    assert waiting is not None
    stack.wait_status(waiting, "parked")
    stack.worker.kill()  # SIGKILL mid-run: nothing gets to release the slot
    assert stack.row(stuck).status == "active"
    stack.start_worker()
    # The lease lapses; a relay ends attempt 1 as failed and retries it. The retry
    # holds the slot, completes, and hands it on to the parked run.
    assert stack.wait_status(stuck, "completed", timeout=60).attempt == 2
    assert stack.wait_status(waiting, "completed", timeout=30).attempt == 1
    stack.wait_log(stuck, "lease expired on attempt 1")
    starts = [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)]
    assert starts == [(stuck, 1), (stuck, 2), (waiting, 1)]
    found = spans(stack, t)
    assert [(s[2], s[3]) for s in found] == [(stuck, 2), (waiting, 1)]
    assert_no_overlap(found)


@pytest.mark.parametrize("broker", BROKERS)
def test_far_future_row_does_not_hide_parked_runs_from_the_relay(
    make_stack: StackFactory, broker: str
) -> None:
    """The relay sends a parked run whose slot is free even if a delayed row waits there.

    The state to recover from is "the holder's end was recorded, the hand-on never
    happened". It is made real: a transaction of the test locks the parked row, so the
    worker that completes the holder blocks in its hand-on (after its terminal write);
    then that worker is SIGKILLed, the blocked statement's backend terminated, and the
    lock released. Only a relay can now send the parked run.
    """
    stack = make_stack(broker)
    client = stack.questpie.queue.policy_singleton
    t, later, key = tag(), tag(), slot()
    delayed = client.publish({"tag": later}, singleton_key=key, start_after=3600)
    assert delayed is not None
    assert stack.row(delayed).status == "pending"
    gate = stack.gate()
    holder = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert holder is not None
    stack.wait_status(holder, "active")
    parked = client.publish({"tag": t}, singleton_key=key)
    assert parked is not None
    stack.wait_status(parked, "parked")

    engine = create_engine(stack.env["QP_TEST_LEDGER"])
    try:
        with engine.connect() as locker, engine.connect() as observer:
            observer.execution_options(isolation_level="AUTOCOMMIT")
            locker.execute(
                select(dispatch_table.c.id).where(dispatch_table.c.id == parked).with_for_update()
            )
            me = locker.execute(text("SELECT pg_backend_pid()")).scalar_one()

            def blocked() -> list[int]:
                found = observer.execute(
                    text("SELECT pid FROM pg_stat_activity WHERE :me = ANY(pg_blocking_pids(pid))"),
                    {"me": me},
                )
                return [int(pid) for pid in found.scalars()]

            gate.open()
            stack.wait_status(holder, "completed")
            wait_until(lambda: bool(blocked()), "a hand-on waits on the parked row")
            stack.worker.kill()  # the worker dies inside its hand-on
            for pid in blocked():
                observer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            wait_until(lambda: not blocked(), "the dead worker's statements are gone")
            locker.rollback()
        assert stack.row(holder).status == "completed"
        assert stack.row(parked).status == "parked"  # the hand-on never happened
        assert stack.row(delayed).status == "pending"
        assert stack.row(delayed).run_after > datetime.now(UTC)
    finally:
        engine.dispose()

    stack.start_worker()
    # A few relay intervals (2 s each) after the new worker is ready.
    row = stack.wait_status(parked, "completed", timeout=15)
    assert row.attempt == 1
    found = spans(stack, t)
    assert [(s[2], s[3]) for s in found] == [(holder, 1), (parked, 1)]
    assert_no_overlap(found)
    assert stack.row(delayed).status == "pending"  # its own time has not come
    assert stack.runs(later) == []


# --- the embedded default -------------------------------------------------------------------


def test_policies_hold_on_sqlite_too(sqlite_fs: Stack) -> None:
    client = sqlite_fs.questpie.queue.policy_exclusive
    t, key = tag(), slot()
    gate = sqlite_fs.gate()
    first = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert first is not None
    sqlite_fs.wait_status(first, "active")
    assert client.publish({"tag": t}, singleton_key=key) is None
    gate.open()
    sqlite_fs.wait_status(first, "completed")
    stately = sqlite_fs.questpie.queue.policy_stately
    gate = sqlite_fs.gate()
    a = stately.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert a is not None
    sqlite_fs.wait_status(a, "active")
    b = stately.publish({"tag": t}, singleton_key=key)
    assert b is not None
    sqlite_fs.wait_status(b, "parked")
    assert stately.publish({"tag": t}, singleton_key=key) is None
    gate.open()
    sqlite_fs.wait_status(a, "completed")
    sqlite_fs.wait_status(b, "completed")
    found = spans(sqlite_fs, t)
    assert [s[2] for s in found] == [first, a, b]
    assert_no_overlap(found)


def test_policy_set_holds_plain_calls_made_right_after_it_returns(
    make_stack: StackFactory,
) -> None:
    """`policy set` returns once every process holds to the new policy: the pool
    processes of a worker that has just cached `record` as standard take three plain
    calls made right after it under `exclusive`, never two running at once."""
    stack = make_stack("redis")
    t = tag()
    changed = CliRunner().invoke(
        main, ["policy", "set", "record", "exclusive", "--ledger-url", stack.env["QP_TEST_LEDGER"]]
    )
    assert changed.exit_code == 0, changed.output
    assert "in force" in changed.output
    sent = [stack.celery_app.send_task("record", args=[{"tag": t, "sleep": 1}]).id for _ in "abc"]
    for dispatch_id in sent:  # each one ran, or its policy suppressed it
        wait_until(
            lambda d=dispatch_id: (
                any(r["dispatch_id"] == d for r in stack.runs(t, phase="end"))
                or "suppressed by its exclusive queue policy" in "".join(stack.worker.log_about(d))
            ),
            f"delivery {dispatch_id} handled",
        )
    found = spans(stack, t)
    assert found
    assert_no_overlap(found)


@pytest.mark.parametrize("broker", BROKERS)
def test_a_parked_plain_delivery_goes_back_by_its_exchange_and_routing_key(
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
