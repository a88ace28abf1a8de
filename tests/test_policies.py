"""Queue policies and singleton keys with real workers, PostgreSQL and Redis."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from questpie_celery import JobContext, Questpie, job
from questpie_celery.cli import main
from questpie_celery.ledger import dispatch_table, policy_table
from questpie_celery.signals import publish_suppressed
from tests import jobapp
from tests.conftest import Stack, tag
from tests.services import Worker

IDLE = "policy-idle"  # no worker consumes it: what is published there stays queued


def slot() -> str:
    return f"slot-{uuid.uuid4().hex[:10]}"


def intervals(stack: Stack, t: str) -> list[tuple[Any, Any, str]]:
    """(start, end, dispatch id) of every finished run of tag `t`, in start order."""
    rows = stack.runs(t)
    starts: dict[tuple[str, int], Any] = {}
    spans = []
    for row in rows:
        key = (row["dispatch_id"], row["attempt"])
        if row["phase"] == "start":
            starts[key] = row["ran_at"]
        else:
            spans.append((starts[key], row["ran_at"], row["dispatch_id"]))
    return sorted(spans)


def wait_until(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def slot_rows(stack: Stack, job_name: str, key: str) -> int:
    with stack.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(dispatch_table)
                .where(dispatch_table.c.job_name == job_name, dispatch_table.c.slot == key)
            ).scalar_one()
        )


@pytest.fixture
def suppressed() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: str, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    publish_suppressed.connect(receiver, weak=False)
    yield seen
    publish_suppressed.disconnect(receiver)


def test_exclusive_eight_concurrent_publishers_one_accepted(
    pg_redis: Stack, suppressed: list[dict[str, Any]]
) -> None:
    t, key = tag(), slot()
    client = pg_redis.questpie.queue.policy_exclusive
    barrier = threading.Barrier(8)
    results: list[str | None] = []

    def publish() -> None:
        barrier.wait()
        results.append(client.publish({"tag": t, "sleep": 0.5}, singleton_key=key))

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    accepted = [r for r in results if r is not None]
    assert len(results) == 8
    assert len(accepted) == 1
    assert slot_rows(pg_redis, "policy.exclusive", key) == 1
    assert len([s for s in suppressed if s["singleton_key"] == key]) == 7
    assert {s["policy"] for s in suppressed if s["singleton_key"] == key} == {"exclusive"}
    # While it runs (active) the slot stays taken; once it finished, it is free again.
    pg_redis.wait_status(accepted[0], "active")
    assert client.publish({"tag": t}, singleton_key=key) is None
    pg_redis.wait_status(accepted[0], "completed")
    again = client.publish({"tag": t}, singleton_key=key)
    assert again is not None
    pg_redis.wait_status(again, "completed")


def test_policy_applies_per_singleton_key_and_to_the_whole_job(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_exclusive
    t = tag()
    first, second = slot(), slot()
    assert client.publish({"tag": t}, singleton_key=first, queue=IDLE) is not None
    assert client.publish({"tag": t}, singleton_key=second, queue=IDLE) is not None
    assert client.publish({"tag": t}, singleton_key=first, queue=IDLE) is None


def test_known_idempotency_key_is_answered_before_the_policy(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_short
    t = tag()
    key = f"short:{t}"
    dispatch_id = client.publish({"tag": t}, idempotency_key=key, queue=IDLE)
    assert dispatch_id is not None
    # The job's whole-job slot is taken by that dispatch, yet its key still answers.
    assert client.publish({"tag": t}, idempotency_key=key, queue=IDLE) == dispatch_id
    assert client.publish({"tag": t}, idempotency_key=key + "-other", queue=IDLE) is None
    # Leave the whole-job slot free for other tests: run it out of the idle queue.
    pg_redis.questpie.dispatcher.send_row(pg_redis.ledger.get(dispatch_id), attempt=1)


def test_short_allows_one_queued_and_any_number_active(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_short
    t, key = tag(), slot()
    running = client.publish({"tag": t, "sleep": 2}, singleton_key=key)
    assert running is not None
    pg_redis.wait_status(running, "active")
    waiting = client.publish({"tag": t}, singleton_key=key, queue=IDLE)
    assert waiting is not None  # the active run does not count as queued
    assert client.publish({"tag": t}, singleton_key=key) is None  # one queued already
    pg_redis.wait_status(running, "completed")
    assert client.publish({"tag": t}, singleton_key=key) is None  # still queued


def test_stately_one_queued_one_active_and_the_parked_run_follows(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_stately
    t, key = tag(), slot()
    first = client.publish({"tag": t, "sleep": 2}, singleton_key=key)
    assert first is not None
    pg_redis.wait_status(first, "active")
    second = client.publish({"tag": t, "sleep": 0.2}, singleton_key=key)
    assert second is not None
    row = pg_redis.wait_status(second, "parked")  # delivered, but the slot is busy
    assert row.attempt == 0  # waiting for a slot is not an attempt
    assert client.publish({"tag": t}, singleton_key=key) is None
    pg_redis.wait_status(first, "completed")
    assert pg_redis.wait_status(second, "completed").attempt == 1
    (_, a_end, a_id), (b_start, _, b_id) = intervals(pg_redis, t)
    assert (a_id, b_id) == (first, second)
    assert b_start >= a_end


def test_singleton_runs_never_overlap_and_none_is_lost(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_singleton
    t, key = tag(), slot()
    ids = [client.publish({"tag": t, "sleep": 0.3}, singleton_key=key) for _ in range(6)]
    assert all(dispatch_id is not None for dispatch_id in ids)  # queued: unlimited
    for dispatch_id in ids:
        assert dispatch_id is not None
        assert pg_redis.wait_status(dispatch_id, "completed", timeout=60).attempt == 1
    spans = intervals(pg_redis, t)
    assert sorted(span[2] for span in spans) == sorted(ids)
    for (_, end, _), (start, _, _) in itertools.pairwise(spans):
        assert start >= end, "two singleton runs overlapped"
    assert "parked" in pg_redis.worker.log()


def test_singleton_retry_keeps_the_slot(pg_redis: Stack) -> None:
    client = pg_redis.questpie.queue.policy_singleton
    t, key = tag(), slot()
    failing = client.publish(
        {"tag": t, "sleep": 0.3, "fail_times": 1}, singleton_key=key, retry_delay=1
    )
    assert failing is not None
    pg_redis.wait_status(failing, "active")
    after = client.publish({"tag": t, "sleep": 0.1}, singleton_key=key)
    assert after is not None
    assert pg_redis.wait_status(failing, "completed").attempt == 2
    pg_redis.wait_status(after, "completed")
    spans = intervals(pg_redis, t)
    # The retry ran before the next run of the slot started.
    assert [span[2] for span in spans] == [failing, after]


def test_standard_job_ignores_singleton_key_and_warns_once(
    pg_redis: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    t, key = tag(), slot()
    with caplog.at_level(logging.WARNING, logger="questpie_celery"):
        first = pg_redis.questpie.queue.record.publish({"tag": t}, singleton_key=key)
        second = pg_redis.questpie.queue.record.publish({"tag": t}, singleton_key=key)
    assert first is not None and second is not None
    assert len(pg_redis.wait_runs(t, 2)) == 2
    warnings = [r for r in caplog.records if "singleton_key has no effect" in r.getMessage()]
    assert len(warnings) == 1


def test_first_recorded_policy_wins_and_policy_set_changes_it(
    pg_unit_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"policy-race-{uuid.uuid4().hex[:6]}"

    def make(policy: Any) -> Questpie:
        @job(name=name, schema=jobapp.Work, options={"queue_policy": policy})
        def handler(payload: jobapp.Work, ctx: JobContext) -> None:
            del payload, ctx

        _, questpie = jobapp.build(broker="memory://", ledger=pg_unit_url)
        questpie.register(handler)
        questpie.migrate()
        return questpie

    exclusive = make("exclusive")
    assert exclusive.queue[name].publish({"tag": "a"}) is not None
    short = make("short")
    with caplog.at_level(logging.WARNING, logger="questpie_celery"):
        short.queue[name].publish({"tag": "b"})
    assert any("declares queue_policy=short" in r.getMessage() for r in caplog.records)
    with short.engine.connect() as conn:
        recorded = conn.execute(
            select(policy_table.c.policy).where(policy_table.c.job_name == name)
        ).scalar_one()
    assert recorded == "exclusive"
    result = CliRunner().invoke(
        main, ["policy", "set", name, "stately", "--ledger-url", pg_unit_url]
    )
    assert result.exit_code == 0, result.output
    assert exclusive.ledger.get_policy(name) == "stately"
    shown = CliRunner().invoke(main, ["policy", "show", name, "--ledger-url", pg_unit_url])
    assert "stately" in shown.output
    exclusive.close()
    short.close()


def test_publish_time_policy_counts_only_while_none_is_recorded(pg_unit_url: str) -> None:
    name = f"policy-late-{uuid.uuid4().hex[:6]}"

    @job(name=name, schema=jobapp.Work)
    def handler(payload: jobapp.Work, ctx: JobContext) -> None:
        del payload, ctx

    _, questpie = jobapp.build(broker="memory://", ledger=pg_unit_url)
    questpie.register(handler)
    questpie.migrate()
    client = questpie.queue[name]
    assert client.publish({"tag": "a"}, queue_policy="exclusive") is not None
    assert client.publish({"tag": "b"}, queue_policy="exclusive") is None
    # Recorded now: a different publish-time policy changes nothing.
    assert client.publish({"tag": "c"}, queue_policy="standard") is None
    questpie.close()


def test_killed_worker_frees_its_slot_when_the_lease_expires(
    pg_redis: Stack, pg_url: str, redis_url: str
) -> None:
    queue = f"kill-{uuid.uuid4().hex[:6]}"
    env = {"QP_TEST_BROKER": redis_url, "QP_TEST_LEDGER": pg_url, "QP_TEST_LEASE": "2"}
    first_worker = Worker(env, queues=queue).start()
    client = pg_redis.questpie.queue.policy_singleton
    t, key = tag(), slot()
    stuck = client.publish(
        {"tag": t, "hang_attempts": 1, "sleep": 0.2}, singleton_key=key, queue=queue
    )
    assert stuck is not None
    pg_redis.wait_status(stuck, "active")
    waiting = client.publish({"tag": t, "sleep": 0.2}, singleton_key=key, queue=queue)
    assert waiting is not None
    pg_redis.wait_status(waiting, "parked")
    first_worker.kill()  # SIGKILL mid-run: nothing gets to release the slot
    second_worker = Worker(env, queues=queue).start()
    try:
        # The lease lapses, a relay ends attempt 1 as failed and retries it; the retry
        # holds the slot, completes, and hands it on to the parked run.
        assert pg_redis.wait_status(stuck, "completed", timeout=60).attempt == 2
        assert pg_redis.wait_status(waiting, "completed", timeout=30).attempt == 1
    finally:
        second_worker.stop()
    spans = intervals(pg_redis, t)
    assert [span[2] for span in spans] == [stuck, waiting]
    assert [r["attempt"] for r in pg_redis.runs(t) if r["dispatch_id"] == stuck] == [1, 2, 2]


def test_policies_hold_on_sqlite_too(sqlite_fs: Stack) -> None:
    client = sqlite_fs.questpie.queue.policy_exclusive
    t, key = tag(), slot()
    first = client.publish({"tag": t, "sleep": 0.5}, singleton_key=key)
    assert first is not None
    assert client.publish({"tag": t}, singleton_key=key) is None
    sqlite_fs.wait_status(first, "completed")
    stately = sqlite_fs.questpie.queue.policy_stately
    a = stately.publish({"tag": t, "sleep": 1}, singleton_key=key)
    assert a is not None
    sqlite_fs.wait_status(a, "active")
    b = stately.publish({"tag": t, "sleep": 0.1}, singleton_key=key)
    assert b is not None
    sqlite_fs.wait_status(b, "completed")
    spans = intervals(sqlite_fs, t)
    assert [span[2] for span in spans] == [first, a, b]
    assert spans[2][0] >= spans[1][1]
