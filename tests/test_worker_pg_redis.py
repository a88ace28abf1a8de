"""End to end on the production parts: PostgreSQL ledger, Redis broker, a prefork worker."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta

import redis
from celery.result import AsyncResult

from questpie_celery import derive_dispatch_id
from tests.conftest import Stack, tag


def test_unkeyed_publish_runs_once_without_a_ledger_row(pg_redis: Stack) -> None:
    t = tag()
    rows_before = pg_redis.dispatch_count()
    dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t})
    assert dispatch_id is not None
    runs = pg_redis.wait_runs(t, 1)
    assert [(r["dispatch_id"], r["attempt"], r["idempotency_key"]) for r in runs] == [
        (dispatch_id, 1, None)
    ]
    assert pg_redis.ledger.get(dispatch_id) is None
    assert pg_redis.dispatch_count() == rows_before


def test_repeated_key_returns_the_same_id_and_runs_once(pg_redis: Stack) -> None:
    t = tag()
    queue = pg_redis.questpie.queue
    first = queue.record.publish({"tag": t}, idempotency_key=f"welcome:{t}")
    again = queue["record"].publish({"tag": t + "-changed"}, idempotency_key=f"welcome:{t}")
    assert first == again == derive_dispatch_id("record", f"welcome:{t}")
    pg_redis.wait_status(first, "completed")
    # Much later, after completion, the key still answers with its id and runs nothing.
    assert queue.record.publish({"tag": t}, idempotency_key=f"welcome:{t}") == first
    runs = pg_redis.wait_runs(t, 1)
    assert len(runs) == 1
    assert runs[0]["idempotency_key"] == f"welcome:{t}"
    assert pg_redis.runs(t + "-changed") == []  # the first accepted payload won


def test_eight_concurrent_publishers_one_row_one_run(pg_redis: Stack) -> None:
    t = tag()
    key = f"concurrent:{t}"
    barrier = threading.Barrier(8)
    results: list[str | None] = []
    lock = threading.Lock()

    def publish() -> None:
        barrier.wait()
        dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t}, idempotency_key=key)
        with lock:
            results.append(dispatch_id)

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert set(results) == {derive_dispatch_id("record", key)}
    row = pg_redis.wait_status(results[0], "completed")
    assert row.attempt == 1
    assert len(pg_redis.wait_runs(t, 1)) == 1
    with pg_redis.engine.connect() as conn:
        count = conn.exec_driver_sql(
            "SELECT count(*) FROM questpie_queue_dispatch WHERE idempotency_key = %(k)s",
            {"k": key},
        ).scalar_one()
    assert count == 1


def _capture_message(pg_redis: Stack, t: str, queue: str) -> tuple[str, bytes]:
    """Publish a keyed dispatch to a queue no worker reads and take its raw message."""
    client = redis.Redis.from_url(pg_redis.env["QP_TEST_BROKER"])
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "sleep": 0.5}, idempotency_key=f"bytes:{t}", queue=queue
    )
    assert dispatch_id is not None
    raw = client.rpop(queue)
    assert isinstance(raw, bytes)
    return dispatch_id, raw


def test_message_delivered_twice_byte_for_byte_runs_once(pg_redis: Stack) -> None:
    t = tag()
    client = redis.Redis.from_url(pg_redis.env["QP_TEST_BROKER"])
    dispatch_id, raw = _capture_message(pg_redis, t, f"capture-{t}")
    # The same bytes, twice, to the queue the worker consumes: two real deliveries,
    # the second while the first may still run (0.5 s handler).
    client.lpush("celery", raw)
    client.lpush("celery", raw)
    pg_redis.wait_status(dispatch_id, "completed")
    runs = pg_redis.wait_runs(t, 1)
    assert len(runs) == 1
    # And a third copy after completion is acknowledged without running.
    client.lpush("celery", raw)
    time.sleep(1.5)
    assert len(pg_redis.runs(t)) == 1
    assert client.llen("celery") == 0
    # The skipped deliveries did not overwrite the real result.
    result = AsyncResult(dispatch_id, app=pg_redis.celery_app)
    assert result.get(timeout=10) == t
    assert "skipped (done)" in pg_redis.worker.log()


def test_message_carries_payload_and_questpie_header(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id, raw = _capture_message(pg_redis, t, f"capture-{t}")
    message = json.loads(raw)
    headers = message["headers"]
    assert headers["task"] == "record"
    assert headers["id"] == dispatch_id
    assert headers["questpie"]["ledgered"] is True
    assert headers["questpie"]["attempt"] == 1
    assert message["content-type"] == "application/json"


def test_retries_count_attempts_and_complete(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"retry:{t}", retry_limit=3
    )
    assert dispatch_id is not None
    row = pg_redis.wait_status(dispatch_id, "completed")
    assert row.attempt == 3
    assert [r["attempt"] for r in pg_redis.wait_runs(t, 3)] == [1, 2, 3]


def test_retries_exhausted_records_failed(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "fail_times": 10}, idempotency_key=f"exhaust:{t}", retry_limit=1
    )
    assert dispatch_id is not None
    row = pg_redis.wait_status(dispatch_id, "failed")
    assert (row.attempt, row.last_error) == (2, "RuntimeError")
    assert [r["attempt"] for r in pg_redis.wait_runs(t, 2)] == [1, 2]
    # A failed key keeps its id for good and does not run again.
    again = pg_redis.questpie.queue.record.publish({"tag": t}, idempotency_key=f"exhaust:{t}")
    assert again == dispatch_id
    time.sleep(1)
    assert len(pg_redis.runs(t)) == 2


def test_default_retry_limit_is_two(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "fail_times": 10}, idempotency_key=f"default:{t}"
    )
    assert dispatch_id is not None
    pg_redis.wait_status(dispatch_id, "failed")
    assert [r["attempt"] for r in pg_redis.wait_runs(t, 3)] == [1, 2, 3]


def test_retry_delay_is_respected(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"delay:{t}", retry_delay=2
    )
    assert dispatch_id is not None
    pg_redis.wait_status(dispatch_id, "completed")
    first, second = pg_redis.wait_runs(t, 2)
    assert second["ran_at"] - first["ran_at"] >= timedelta(seconds=1.9)


def test_permanent_failure_is_not_retried(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "permanent": True}, idempotency_key=f"perm:{t}", retry_limit=5
    )
    assert dispatch_id is not None
    row = pg_redis.wait_status(dispatch_id, "failed")
    assert (row.attempt, row.last_error) == (1, "PermanentFailure")
    assert len(pg_redis.wait_runs(t, 1)) == 1


def test_unledgered_retries_use_celery_retries(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish({"tag": t, "fail_times": 1}, retry_limit=1)
    runs = pg_redis.wait_runs(t, 2)
    assert [(r["dispatch_id"], r["attempt"]) for r in runs] == [(dispatch_id, 1), (dispatch_id, 2)]


def test_async_handler_and_job_option_defaults(pg_redis: Stack) -> None:
    t = tag()
    # record.async declares retry_limit=1: two runs, then failed.
    dispatch_id = pg_redis.questpie.queue.record_async.publish(
        {"tag": t, "fail_times": 5}, idempotency_key=f"async:{t}"
    )
    assert dispatch_id is not None
    pg_redis.wait_status(dispatch_id, "failed")
    assert [r["attempt"] for r in pg_redis.wait_runs(t, 2)] == [1, 2]


def test_call_time_option_wins_over_job_option(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record_async.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"async-win:{t}", retry_limit=2
    )
    assert dispatch_id is not None
    pg_redis.wait_status(dispatch_id, "completed")
    assert [r["attempt"] for r in pg_redis.wait_runs(t, 3)] == [1, 2, 3]


def test_start_after_delays_the_first_run(pg_redis: Stack) -> None:
    t = tag()
    published = datetime.now(UTC)
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"later:{t}", start_after=2
    )
    assert dispatch_id is not None
    [run] = pg_redis.wait_runs(t, 1)
    assert run["ran_at"] >= published + timedelta(seconds=1.9)
    iso = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    t2 = tag()
    pg_redis.questpie.queue.record.publish({"tag": t2}, start_after=iso)
    assert len(pg_redis.wait_runs(t2, 1)) == 1


def test_plain_celery_calls_run_unledgered(pg_redis: Stack) -> None:
    t = tag()
    pg_redis.celery_app.send_task("record", args=[{"tag": t}])
    task = pg_redis.questpie.tasks["record"]
    result = task.delay({"tag": t})
    assert result.get(timeout=20) == t
    runs = pg_redis.wait_runs(t, 2)
    assert len(runs) == 2
    assert all(r["attempt"] == 1 and r["idempotency_key"] is None for r in runs)


def test_bad_messages_fail_without_killing_the_worker(pg_redis: Stack) -> None:
    app = pg_redis.celery_app
    app.send_task("no-such-job", args=[{"tag": "x"}])
    bad = app.send_task("record", args=[{"tag": ["not", "a", "string"]}])
    assert bad.get(timeout=20, propagate=False) is not None
    assert bad.state == "FAILURE"
    assert "PayloadValidationError" in str(bad.result.__class__.__name__) or "payload" in str(
        bad.result
    )
    # The worker is alive and still serves work.
    t = tag()
    pg_redis.questpie.queue.record.publish({"tag": t})
    assert len(pg_redis.wait_runs(t, 1)) == 1
    assert pg_redis.worker.alive()
    assert "no-such-job" in pg_redis.worker.log()


def test_expire_in_seconds_caps_a_run(pg_redis: Stack) -> None:
    """On prefork, expire_in_seconds is the run's soft time limit: a failed attempt."""
    t = tag()
    dispatch_id = pg_redis.questpie.queue.record.publish(
        {"tag": t, "sleep": 30}, idempotency_key=f"expire:{t}", expire_in_seconds=2,
        retry_limit=0,
    )  # fmt: skip
    assert dispatch_id is not None
    row = pg_redis.wait_status(dispatch_id, "failed", timeout=25)
    assert (row.attempt, row.last_error) == (1, "SoftTimeLimitExceeded")
    assert row.finished_at is not None and row.started_at is not None
    assert row.finished_at - row.started_at < timedelta(seconds=30)
