"""End to end on the production parts: PostgreSQL ledger, Redis or RabbitMQ, a prefork worker."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from questpie_celery import LedgerSchemaError, derive_dispatch_id
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import NewDispatch
from tests.integration.conftest import StackFactory
from tests.support.brokers import capture, deliver, queue_depth
from tests.support.jobapp import Work
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


def test_unkeyed_publish_runs_once_without_a_ledger_row(stack: Stack) -> None:
    t = tag()
    rows_before = stack.dispatch_count()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t})
    assert dispatch_id is not None
    [end] = stack.wait_ends(t, 1)
    assert (end["dispatch_id"], end["attempt"], end["idempotency_key"]) == (dispatch_id, 1, None)
    assert stack.questpie.queue.get_status(dispatch_id) is None
    assert stack.dispatch_count() == rows_before


def test_repeated_key_returns_the_same_id_and_runs_once(stack: Stack) -> None:
    t = tag()
    queue = stack.questpie.queue
    first = queue.record.publish({"tag": t}, idempotency_key=f"welcome:{t}")
    again = queue["record"].publish({"tag": t + "-changed"}, idempotency_key=f"welcome:{t}")
    assert first == again == derive_dispatch_id("record", f"welcome:{t}")
    stack.wait_status(first, "completed")
    # Much later, after completion, the key still answers with its id and runs nothing.
    assert queue.record.publish({"tag": t}, idempotency_key=f"welcome:{t}") == first
    # A completed dispatch is final: every run it had is recorded by now.
    runs = stack.runs(t)
    assert len(runs) == 1
    assert runs[0]["idempotency_key"] == f"welcome:{t}"
    assert stack.runs(t + "-changed") == []  # the first accepted payload won


def test_eight_concurrent_publishers_one_row_one_run(stack: Stack) -> None:
    t = tag()
    key = f"concurrent:{t}"
    barrier = threading.Barrier(8)
    results: list[str | None] = []
    lock = threading.Lock()

    def publish() -> None:
        barrier.wait()
        dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=key)
        with lock:
            results.append(dispatch_id)

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [derive_dispatch_id("record", key)] * 8
    row = stack.wait_status(derive_dispatch_id("record", key), "completed")
    assert (row.attempt, row.idempotency_key) == (1, key)
    assert len(stack.runs(t)) == 1


def test_message_delivered_three_times_runs_once_and_keeps_its_result(stack: Stack) -> None:
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"  # no worker reads it: the message waits there
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=f"bytes:{t}", queue=idle
    )
    assert dispatch_id is not None
    message = capture(stack, idle)
    # Two copies to the worker's queue: the second meets a live claim (the gate holds the
    # first run open) and is dropped.
    deliver(stack, message, copies=2)
    stack.wait_status(dispatch_id, "active")
    gate.open()
    stack.wait_status(dispatch_id, "completed")
    assert len(stack.runs(t)) == 1
    # A third copy after completion is acknowledged without running.
    deliver(stack, message, copies=1)
    stack.wait_log(dispatch_id, "skipped (done)")
    assert len(stack.runs(t)) == 1
    if stack.broker == "redis":  # the one stack with a result backend
        assert AsyncResult(dispatch_id, app=stack.celery_app).get(timeout=10) == t


def test_message_carries_payload_and_questpie_header(stack: Stack) -> None:
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"hdr:{t}", queue=idle
    )
    message = capture(stack, idle)
    assert message.headers["task"] == "record"
    assert message.headers["id"] == dispatch_id
    assert message.headers["questpie"]["ledgered"] is True
    assert message.headers["questpie"]["attempt"] == 1
    assert message.content_type == "application/json"
    assert message.decode()[0] == [{"tag": t, **_defaults()}]


def _defaults() -> dict[str, object]:
    return {k: v for k, v in Work(tag="x").model_dump().items() if k != "tag"}


def test_retries_count_attempts_and_complete(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"retry:{t}", retry_limit=3
    )
    assert dispatch_id is not None
    assert stack.wait_status(dispatch_id, "completed").attempt == 3
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2, 3]


def test_retries_exhausted_records_failed_and_the_key_stays_spent(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 10}, idempotency_key=f"exhaust:{t}", retry_limit=1
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed")
    assert (row.attempt, row.last_error) == (2, "RuntimeError")
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]
    # A failed key keeps its id for good; publishing it again sends nothing at all.
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    again = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"exhaust:{t}", queue=idle
    )
    assert again == dispatch_id
    assert queue_depth(stack, idle) == 0


def test_default_retry_limit_is_two(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 10}, idempotency_key=f"default:{t}"
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "failed")
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2, 3]


def test_retry_delay_and_backoff_are_respected(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"delay:{t}", retry_delay=1, retry_backoff=True
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed")
    first, second, third = stack.runs(t)
    # Backoff: retry 1 waits max(1, 1) * 2**0 = 1 s, retry 2 waits 2 s.
    assert second["ran_at"] - first["ran_at"] >= timedelta(seconds=0.9)
    assert third["ran_at"] - second["ran_at"] >= timedelta(seconds=1.9)


def test_permanent_failure_is_not_retried(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "permanent": True}, idempotency_key=f"perm:{t}", retry_limit=5
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed")
    assert (row.attempt, row.last_error) == (1, "PermanentFailure")
    assert len(stack.runs(t)) == 1


def test_unledgered_retries_use_celery_retries(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t, "fail_times": 1}, retry_limit=1)
    ends = stack.wait_ends(t, 1)
    assert [(r["dispatch_id"], r["attempt"]) for r in ends] == [(dispatch_id, 2)]
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]


def test_async_handler_and_job_option_defaults(stack: Stack) -> None:
    t = tag()
    # record.async declares retry_limit=1: two runs, then failed.
    dispatch_id = stack.questpie.queue.record_async.publish(
        {"tag": t, "fail_times": 5}, idempotency_key=f"async:{t}"
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "failed")
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]


def test_call_time_option_wins_over_job_option(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record_async.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"async-win:{t}", retry_limit=2
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed")
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2, 3]


def test_start_after_delays_the_first_run(stack: Stack) -> None:
    t = tag()
    before = datetime.now(UTC)
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"later:{t}", start_after=2
    )
    after = datetime.now(UTC)
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "completed")
    assert len(stack.runs(t)) == 1
    # Its start is two seconds after the publish, and its claim did not come before it.
    assert row.run_after is not None and row.started_at is not None
    assert before + timedelta(seconds=2) <= row.run_after <= after + timedelta(seconds=2)
    assert row.run_after <= row.started_at
    t2 = tag()
    iso = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    stack.questpie.queue.record.publish({"tag": t2}, start_after=iso)
    assert len(stack.wait_ends(t2, 1)) == 1


def test_plain_celery_calls_run_unledgered(stack: Stack) -> None:
    t = tag()
    stack.celery_app.send_task("record", args=[{"tag": t}])
    stack.questpie.tasks["record"].delay({"tag": t})
    ends = stack.wait_ends(t, 2)
    assert len(ends) == 2
    assert all(r["attempt"] == 1 and r["idempotency_key"] is None for r in ends)
    assert all(stack.questpie.queue.get_status(r["dispatch_id"]) is None for r in ends)


def test_a_jobs_task_is_one_attribute_away_for_plain_calls_and_canvas(stack: Stack) -> None:
    """`.task` of a job is its Celery task: `.delay`, `.apply_async`, chains, groups, and
    (on the stack with a result backend) a chord whose header is questpie jobs, one of
    them a policy job whose plain call the worker takes into the ledger."""
    t = tag()
    record = stack.questpie.queue.record.task
    short = stack.questpie.queue.policy_short.task
    record.delay({"tag": f"{t}-delay"})
    record.apply_async(args=[{"tag": f"{t}-apply"}], priority=3)
    chain(record.si({"tag": f"{t}-chain1"}), record.si({"tag": f"{t}-chain2"})).apply_async()
    group(record.s({"tag": f"{t}-group{n}"}) for n in range(2)).apply_async()
    tags = ["delay", "apply", "chain1", "chain2", "group0", "group1"]
    for name in tags:
        assert len(stack.wait_ends(f"{t}-{name}", 1)) == 1, name
    if stack.broker != "redis":
        return  # the RabbitMQ stack stores no results: a chord needs a result backend
    header = [record.s({"tag": f"{t}-h{n}"}) for n in range(2)] + [short.s({"tag": f"{t}-h2"})]
    result = chord(header)(stack.celery_app.tasks["tests.gather"].s())
    # record returns its tag; a policy job's handler here returns nothing.
    assert result.get(timeout=60) == [None, f"{t}-h0", f"{t}-h1"]  # sorted by gather
    [taken_in] = stack.runs(f"{t}-h2")
    status = stack.questpie.queue.get_status(taken_in["dispatch_id"])
    assert status is not None and status.status == "completed"  # through the ledger
    assert all(stack.questpie.queue.get_status(r["dispatch_id"]) is None
               for n in range(2) for r in stack.runs(f"{t}-h{n}"))  # fmt: skip


def test_bad_messages_fail_without_killing_the_worker(stack: Stack) -> None:
    app = stack.celery_app
    app.send_task("no-such-job", args=[{"tag": "x"}])
    bad = app.send_task("record", args=[{"tag": ["not", "a", "string"]}])
    stack.wait_log(bad.id, "PayloadValidationError")
    # The worker is alive and still serves work.
    t = tag()
    stack.questpie.queue.record.publish({"tag": t})
    assert len(stack.wait_ends(t, 1)) == 1
    assert stack.worker.alive()
    assert "no-such-job" in stack.worker.log()


def test_expire_in_seconds_caps_a_run(stack: Stack) -> None:
    """On prefork, expire_in_seconds is the run's soft time limit: a failed attempt."""
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "sleep": 30}, idempotency_key=f"expire:{t}", expire_in_seconds=2,
        retry_limit=0,
    )  # fmt: skip
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed", timeout=25)
    assert (row.attempt, row.last_error) == (1, "SoftTimeLimitExceeded")
    assert row.finished_at is not None and row.started_at is not None
    # The limit cut the handler's 30 s sleep short: it never reached its end.
    assert len(stack.runs(t)) == 1 and stack.runs(t, phase="end") == []


def test_a_run_past_its_time_limits_never_overlaps_its_retry_on_prefork(
    make_stack: StackFactory,
) -> None:
    """A singleton run with `expire_in_seconds=2` and a 3 s lease that ignores its soft
    time limit: its claim is renewed until the pool kills it at the hard limit (30 s
    later), so its lease lapses only then, and attempt 2 starts once attempt 1's process
    is gone."""
    stack = make_stack("redis", env={"QP_TEST_LEASE": "3"})
    t = tag()
    dispatch_id = stack.questpie.queue["policy.singleton.overrun"].publish(
        {"tag": t, "sleep": 120, "hang_attempts": 1}, idempotency_key=f"overrun:{t}"
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "completed", timeout=150)
    assert row.attempt == 2
    first, second = stack.runs(t)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert second["note"] == "alone", second["note"]  # attempt 1's process had stopped
    ticks = [r["ran_at"] for r in stack.runs(t, phase="tick") if r["attempt"] == 1]
    assert ticks and max(ticks) < second["ran_at"]
    assert [r["attempt"] for r in stack.runs(t, phase="end")] == [2]  # 1 was killed


def test_a_run_the_pool_never_kills_ends_before_its_claim_lapses(
    make_stack: StackFactory,
) -> None:
    """The worker's main process stalls while a run overruns (stopped here; a main process
    in its broker reconnect loop runs no timers either): the pool kills nothing at the hard
    limit. The pool process ends the run itself once its claim is no longer renewed, so the
    retry another worker starts never overlaps it and the handler completes once."""
    stack = make_stack("redis", env={"QP_TEST_LEASE": "3"})
    stack.start_worker()
    t = tag()
    dispatch_id = stack.questpie.queue["policy.singleton.overrun"].publish(
        {"tag": t, "sleep": 60, "hang_attempts": 1}, idempotency_key=f"stalled:{t}"
    )
    assert dispatch_id is not None
    (first,) = stack.wait_runs(t, 1)
    with open(f"/proc/{first['pid']}/stat") as stat:
        main = int(stat.read().rsplit(")", 1)[1].split()[1])  # the pool process's parent
    os.kill(main, signal.SIGSTOP)
    try:
        row = stack.wait_status(dispatch_id, "completed", timeout=150)
    finally:
        os.kill(main, signal.SIGCONT)
    assert row.attempt == 2
    first, second = stack.runs(t)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert second["note"] == "alone", second["note"]  # attempt 1's process had stopped
    assert [r["attempt"] for r in stack.runs(t, phase="end")] == [2]
    stack.wait_log(dispatch_id, "its pool process ends itself")


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_worker_drops_the_time_limits_of_finished_runs(
    make_stack: StackFactory, broker: str, tmp_path: Path
) -> None:
    # Every ledgered message carries time limits; the pool schedules each run's soft limit
    # on the main process's event-loop timer and cancels it when the run ends, and kombu
    # would keep the cancelled entry until its time (15 minutes later by default).
    report = tmp_path / "cancelled-timers"
    stack = make_stack(
        broker, env={"QP_TEST_TIMER_FILE": str(report), "QP_TEST_PURGE": "3"}, concurrency=1
    )
    t = tag()
    ids = stack.questpie.queue.record.publish_many(
        [{"tag": t}] * 150, idempotency_keys=[f"{t}-{n}" for n in range(150)]
    )
    assert None not in ids
    stack.wait_ends(t, 150, timeout=60)
    seen: list[tuple[int, int]] = []

    def purged() -> bool:
        if report.exists():
            now, most = (int(n) for n in report.read_text().split())
            seen.append((now, most))
            return now == 0 and most > 0
        return False

    wait_until(
        purged,
        "the worker's timer to hold no cancelled entry, having held some",
        15,
        0.2,
        explain=lambda: f"(cancelled entries now, most held) seen: {seen}",
    )
    # The finished runs' entries were there, and then, purged, none are.
    assert seen and seen[-1][0] == 0 and seen[-1][1] >= 20, seen


def wait_for_file(path: Path, timeout: float = 30.0) -> None:
    wait_until(path.exists, f"{path} to appear", timeout, 0.05)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_pool_process_lost_before_its_claim_runs_its_dispatch_at_once(
    make_stack: StackFactory, broker: str, tmp_path: Path
) -> None:
    """A pool process killed (as by the OOM killer) after Celery acknowledged its message
    and before its claim: the worker's main process hears of it, and the relay sends the
    dispatch again within seconds, not after `redeliver_after` (an hour, the default)."""
    held = tmp_path / "held"
    held.mkdir()
    stack = make_stack(broker, env={"QP_TEST_HOLD_DIR": str(held)})
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"lost:{t}")
    assert dispatch_id is not None
    wait_for_file(held / dispatch_id)  # its delivery waits just before the claim
    assert stack.row(dispatch_id).status in ("pending", "queued")
    os.kill(int((held / dispatch_id).read_text()), signal.SIGKILL)
    row = stack.wait_status(dispatch_id, "completed", timeout=30)
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [dispatch_id]


def test_a_dispatch_revoked_before_it_ran_fails_at_once_and_never_runs(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """Celery drops a revoked message (acknowledged, never run): the dispatch is recorded
    failed (`Revoked`) there and then, not left queued for the relay to send it again."""
    held = tmp_path / "held"
    held.mkdir()
    stack = make_stack("redis", env={"QP_TEST_HOLD_DIR": str(held)}, concurrency=1)
    t1, t2 = tag(), tag()
    first = stack.questpie.queue.record.publish({"tag": t1}, idempotency_key=f"busy:{t1}")
    assert first is not None
    wait_for_file(held / first)  # the one pool process is busy
    second = stack.questpie.queue.record.publish({"tag": t2}, idempotency_key=f"revoke:{t2}")
    assert second is not None
    replies = stack.celery_app.control.revoke(second, reply=True, timeout=10)
    assert replies, "the worker did not answer the revoke"
    (held / f"{first}.go").touch()
    row = stack.wait_status(second, "failed", timeout=30)
    assert (row.attempt, row.last_error) == (0, "Revoked")
    assert stack.wait_status(first, "completed").attempt == 1
    assert stack.runs(t2) == []


@pytest.mark.parametrize("job_name", ["record", "policy.singleton"])
def test_a_plain_call_under_an_id_no_row_can_have_that_ends_unrun_leaves_the_relay_working(
    make_stack: StackFactory, job_name: str
) -> None:
    """A plain call whose task id holds a NUL (which PostgreSQL text cannot store) expires
    on arrival: Celery drops it unrun, and no row can have its id, so there is nothing to
    move on. The worker's relay goes on with its passes, and sends what is due."""
    stack = make_stack("redis")
    t = tag()
    expired = datetime.now(UTC) - timedelta(seconds=5)
    stack.celery_app.send_task(job_name, args=[{"tag": t}], task_id="plain\0call", expires=expired)
    wait_until(lambda: "Discarding revoked task" in stack.worker.log(), "the expired call dropped")
    # A row only the relay sends (as after a broker outage at its publish).
    due = derive_dispatch_id("record", t)
    new = NewDispatch(
        id=due, job_name="record", idempotency_key=t, payload={"tag": t}, options=StoredOptions()
    )
    assert stack.ledger.dispatches.insert(new)
    assert stack.wait_status(due, "completed").attempt == 1
    assert "relay pass failed" not in stack.worker.log()
    assert [r["dispatch_id"] for r in stack.runs(t)] == [due]


def test_a_worker_started_before_migrate_waits_and_then_runs_everything_once(
    make_stack: StackFactory,
) -> None:
    """Before `migrate`, a ledger counts as unreachable: deliveries wait for it (saying
    what to run), an unkeyed standard publish is sent, a keyed one raises. After
    `migrate`, with the same worker, every message runs, once."""
    stack = make_stack("redis", migrate=False)
    t = tag()
    unkeyed = stack.questpie.queue.record.publish({"tag": t})
    assert unkeyed is not None
    with pytest.raises(LedgerSchemaError, match="run `questpie-celery migrate`"):
        stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"early:{t}")
    plain = stack.celery_app.send_task("record", args=[{"tag": t}]).id
    policy = stack.celery_app.send_task("policy.singleton", args=[{"tag": t}]).id
    stack.wait_log(plain, "the ledger is not migrated")
    stack.wait_log(plain, "questpie-celery migrate")
    stack.questpie.migrate()
    keyed = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"late:{t}")
    expected = {unkeyed, plain, policy, keyed}
    ends = stack.wait_ends(t, len(expected), timeout=120)
    assert sorted(r["dispatch_id"] for r in ends) == sorted(expected)
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted(expected)
    assert stack.row(policy).status == "completed"
    assert stack.row(str(keyed)).status == "completed"


def _make_version_4(stack: Stack) -> None:
    """Turn the stack's ledger back into what schema version 4 made: ids of 36 characters."""
    with stack.ledger.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM questpie_schema_version WHERE version >= 5")
        for table, column in (
            ("questpie_queue_dispatch", "id"),
            ("questpie_schedule", "last_dispatch_id"),
        ):
            conn.exec_driver_sql(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(36)")


def test_a_plain_calls_long_task_id_waits_for_the_ledger_to_be_migrated_to_wide_ids(
    make_stack: StackFactory,
) -> None:
    """A worker upgraded before `migrate` ran meets a ledger of schema version 4, whose
    dispatch ids hold 36 characters. A plain call of a policy job under a longer task id
    waits for `migrate`, as on an unmigrated ledger, rather than failing unrun; after it,
    the call runs once."""
    stack = make_stack("redis", start_worker=False)
    _make_version_4(stack)
    stack.worker.start()
    t = tag()
    long_id = f"order-{t}-" + "x" * 40
    stack.celery_app.send_task("policy.singleton", args=[{"tag": t}], task_id=long_id)
    stack.wait_log(long_id, "the ledger is not migrated")
    assert stack.ledger.get(long_id) is None
    assert not any("raised unexpected" in line for line in stack.worker.log_about(long_id))
    stack.questpie.migrate()
    assert stack.wait_status(long_id, "completed", timeout=90).attempt == 1
    assert [r["attempt"] for r in stack.runs(t)] == [1]
