"""Debounce and throttle, end to end: the ledger's burst and window statements on
PostgreSQL and SQLite, concurrent publishers (processes and threads), and real prefork
workers running what the bursts and windows let through.

Timings are the jobs' own (tests/support/jobapp.py): `debounce.record` waits 1 s of quiet
and at most 3 s from a burst's first publish; `debounce.singleton` waits 0.5 s under the
singleton policy; `throttle.record` accepts one dispatch per 2 s.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from questpie_celery import Questpie, QueuePolicy
from questpie_celery.errors import PublishOptionsError
from questpie_celery.ledger import Ledger, NewDispatch, dispatch_table
from questpie_celery.ledger.schema import throttle_table
from questpie_celery.options import StoredOptions
from questpie_celery.signals import publish_suppressed
from tests.support import jobapp
from tests.support.stack import Stack, tag


def new_row(job: str = "debounced", payload: dict[str, Any] | None = None, **kw: Any) -> NewDispatch:
    return NewDispatch(
        id=str(uuid.uuid4()),
        job_name=job,
        payload=payload if payload is not None else {"n": 0},
        options=StoredOptions(),
        **kw,
    )


def row_of(ledger: Ledger, dispatch_id: str) -> Any:
    row = ledger.get(dispatch_id)
    assert row is not None
    return row


# --- the ledger's statements, on both dialects ---------------------------------------------


def test_a_burst_is_one_row_with_the_latest_payload_and_a_later_start(ledger: Ledger) -> None:
    first = new_row(payload={"n": 1})
    burst, inserted = ledger.debounce(first, key="", debounce=5.0, most=50.0)
    assert (burst, inserted) == (first.id, True)
    started = row_of(ledger, burst)
    assert started.debounce_key == "" and started.status == "pending"
    # Its start by the database's clock, its relay's first look after it.
    assert started.run_after - started.created_at == pytest.approx(timedelta(seconds=5), abs=timedelta(seconds=1))
    time.sleep(0.2)
    second = new_row(payload={"n": 2})
    assert ledger.debounce(second, key="", debounce=5.0, most=50.0) == (burst, False)
    pushed = row_of(ledger, burst)
    assert pushed.payload == {"n": 2}
    assert pushed.run_after > started.run_after
    assert pushed.next_send_at == pushed.run_after
    assert ledger.get(second.id) is None  # no second row
    # Another key is another burst; another job too.
    other, fresh = ledger.debounce(new_row(payload={"n": 3}), key="k", debounce=5.0, most=50.0)
    assert fresh and other != burst
    elsewhere, fresh = ledger.debounce(new_row("other"), key="", debounce=5.0, most=50.0)
    assert fresh and elsewhere not in (burst, other)


def test_a_burst_never_starts_later_than_its_most_after_the_first_publish(ledger: Ledger) -> None:
    burst, _ = ledger.debounce(new_row(), key="", debounce=30.0, most=2.0)
    created = row_of(ledger, burst).created_at
    # The insert's start is the quiet period (the most is the push-back's bound) ...
    assert row_of(ledger, burst).run_after - created == pytest.approx(timedelta(seconds=30), abs=timedelta(seconds=1))
    # ... and every publish after it caps the start at the burst's first plus the most.
    assert ledger.debounce(new_row(payload={"n": 9}), key="", debounce=30.0, most=2.0)[0] == burst
    row = row_of(ledger, burst)
    assert row.run_after - created == pytest.approx(timedelta(seconds=2), abs=timedelta(milliseconds=50))
    assert row.payload == {"n": 9}


def test_a_claimed_run_leaves_its_burst(ledger: Ledger) -> None:
    burst, _ = ledger.debounce(new_row(), key="", debounce=0.01, most=0.1)
    time.sleep(0.1)
    claim = ledger.claim(burst, "debounced", 1, lease_seconds=30)
    assert claim.outcome == "claimed", claim
    assert row_of(ledger, burst).debounce_key is None
    later, inserted = ledger.debounce(new_row(), key="", debounce=1.0, most=10.0)
    assert inserted and later != burst


def test_a_parked_burst_keeps_its_relay_time(ledger: Ledger) -> None:
    burst, _ = ledger.debounce(new_row(), key="", debounce=5.0, most=50.0)
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table).where(dispatch_table.c.id == burst).values(status="parked", next_send_at=None)
        )
    assert ledger.debounce(new_row(payload={"n": 4}), key="", debounce=5.0, most=50.0) == (burst, False)
    row = row_of(ledger, burst)
    assert row.payload == {"n": 4} and row.next_send_at is None


def test_a_debounced_row_under_a_taken_slot_is_refused(ledger: Ledger) -> None:
    exclusive = QueuePolicy("exclusive")
    held = new_row(singleton_key="s", policy=exclusive)
    assert ledger.insert(held)  # a dispatch of the slot, not of a burst
    refused = new_row(singleton_key="s", policy=exclusive)
    assert ledger.debounce(refused, key="s", debounce=1.0, most=10.0) == (None, False)
    assert ledger.get(refused.id) is None


def test_one_window_per_key_measured_from_the_accepted_one(ledger: Ledger) -> None:
    first = new_row("throttled")
    assert ledger.throttle(first, key="", window=0.5) == "accepted"
    closed = new_row("throttled")
    assert ledger.throttle(closed, key="", window=0.5) == "closed"
    assert ledger.get(closed.id) is None  # rolled back with the window refused
    assert ledger.throttle(new_row("throttled"), key="k", window=0.5) == "accepted"  # its own key
    time.sleep(0.6)
    again = new_row("throttled")
    assert ledger.throttle(again, key="", window=0.5) == "accepted"
    with ledger.engine.connect() as conn:
        windows = conn.execute(
            select(throttle_table.c.throttle_key, throttle_table.c.dispatch_id).where(throttle_table.c.job_name == "throttled")
        ).all()
    assert sorted(windows) == sorted([("", again.id), ("k", windows[[w[0] for w in windows].index("k")][1])])
    # A window open again an hour ago is pruned, one still closed is not.
    assert ledger.prune_throttle_windows(older_than=3600) == 0
    assert ledger.prune_throttle_windows(older_than=-3600) == 2


def test_a_known_key_takes_no_window(ledger: Ledger) -> None:
    keyed = NewDispatch(id="11111111-2222-5333-8444-555555555555", job_name="throttled", payload={}, options=StoredOptions(), idempotency_key="k1")
    assert ledger.throttle(keyed, key="", window=60) == "accepted"
    assert ledger.throttle(keyed, key="", window=60) == "not inserted"


# --- real workers: PostgreSQL, Redis, a prefork worker ----------------------------------------


def _publisher(env: dict[str, str]) -> Questpie:
    _, questpie = jobapp.build(
        broker=env["QP_TEST_BROKER"],
        ledger=env["QP_TEST_LEDGER"],
        backend=env.get("QP_TEST_BACKEND"),
        queue=env["QP_TEST_QUEUE"],
    )
    return questpie


#: The burst test's quiet period (a publish's options over the job's): long enough that
#: four processes and the test's last publish fall inside it on a busy machine.
BURST: dict[str, Any] = {"debounce_seconds": 2.0, "debounce_max_seconds": 20.0}


def _publish_burst(
    env: dict[str, str], t: str, who: int, count: int, start: Any, answers: Any
) -> None:
    """In a process of its own: `count` debounced publishes as fast as it can, once every
    publisher is ready."""
    questpie = _publisher(env)
    client = questpie.queue["debounce.record"]
    questpie.queue.get_status(str(uuid.uuid4()))  # connected before the start
    start.wait(timeout=60)
    ids = [client.publish({"tag": t, "seq": f"{who}-{n}"}, **BURST) for n in range(count)]
    answers.put(ids)
    questpie.flush(timeout=10)


def test_a_burst_from_four_processes_runs_once_with_the_last_payload(pg_redis: Stack) -> None:
    stack = pg_redis
    t = tag()
    spawn = multiprocessing.get_context("spawn")
    start, answers = spawn.Barrier(5), spawn.Queue()
    counts = [13, 13, 12, 12]  # 50 in all
    publishers = [
        spawn.Process(target=_publish_burst, args=(stack.env, t, who, n, start, answers))
        for who, n in enumerate(counts)
    ]
    for process in publishers:
        process.start()
    start.wait(timeout=60)
    ids = [dispatch_id for _ in publishers for dispatch_id in answers.get(timeout=60)]
    # The last publish of the burst, after the four's: its payload wins.
    last = stack.questpie.queue["debounce.record"].publish({"tag": t, "seq": "last"}, **BURST)
    published = time.monotonic()
    for process in publishers:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert last is not None
    assert len(ids) == 50 and set(ids) == {last}
    (run,) = stack.wait_runs(t, 1, timeout=20)
    ran = time.monotonic()
    assert run["dispatch_id"] == last and run["note"] == "last"
    # Not before the quiet period after the last publish.
    assert ran - published >= 1.9
    stack.wait_status(last, "completed")
    time.sleep(1.5)
    assert len(stack.runs(t)) == 1  # once, and only once
