"""Debounce and throttle, end to end: the ledger's burst and window statements on
PostgreSQL and SQLite, concurrent publishers (processes and threads), and real prefork
workers running what the bursts and windows let through.

Timings are the jobs' own (tests/support/jobapp.py): `debounce.record` waits 1 s of quiet
and at most 3 s from a burst's first publish; `debounce.singleton` waits 0.5 s under the
singleton policy; `throttle.record` accepts one dispatch per 2 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, select, update
from sqlalchemy.orm import Session

from questpie_celery import Questpie, QueuePolicy
from questpie_celery.errors import PublishOptionsError
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import Ledger, NewDispatch, dispatch_table
from questpie_celery.ledger.schema import throttle_table
from questpie_celery.ledger.statements import db_time
from questpie_celery.signals import publish_suppressed
from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.aio import run
from tests.support.brokers import capture
from tests.support.faultproxy import FaultProxy
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


def new_row(
    job: str = "debounced", payload: dict[str, Any] | None = None, **kw: Any
) -> NewDispatch:
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
    burst, inserted = ledger.debounce.join(first, key="", debounce=5.0, most=50.0)
    assert (burst, inserted) == (first.id, True)
    started = row_of(ledger, burst)
    assert started.debounce_key == "" and started.status == "pending"
    # Its start by the database's clock, its relay's first look after it.
    assert started.run_after - started.created_at == pytest.approx(
        timedelta(seconds=5), abs=timedelta(seconds=1)
    )
    wait_until(
        lambda: ledger.now() > started.created_at,
        "the database's clock to move past the burst's first publish",
    )
    second = new_row(payload={"n": 2})
    assert ledger.debounce.join(second, key="", debounce=5.0, most=50.0) == (burst, False)
    pushed = row_of(ledger, burst)
    assert pushed.payload == {"n": 2}
    assert pushed.run_after > started.run_after
    assert pushed.next_send_at == pushed.run_after
    assert ledger.get(second.id) is None  # no second row
    # Another key is another burst; another job too.
    other, fresh = ledger.debounce.join(new_row(payload={"n": 3}), key="k", debounce=5.0, most=50.0)
    assert fresh and other != burst
    elsewhere, fresh = ledger.debounce.join(new_row("other"), key="", debounce=5.0, most=50.0)
    assert fresh and elsewhere not in (burst, other)


def test_a_burst_never_starts_later_than_its_most_after_the_first_publish(ledger: Ledger) -> None:
    burst, _ = ledger.debounce.join(new_row(), key="", debounce=30.0, most=2.0)
    created = row_of(ledger, burst).created_at
    # The insert's start is the quiet period (the most is the push-back's bound) ...
    assert row_of(ledger, burst).run_after - created == pytest.approx(
        timedelta(seconds=30), abs=timedelta(seconds=1)
    )
    # ... and every publish after it caps the start at the burst's first plus the most.
    assert (
        ledger.debounce.join(new_row(payload={"n": 9}), key="", debounce=30.0, most=2.0)[0] == burst
    )
    row = row_of(ledger, burst)
    assert row.run_after - created == pytest.approx(
        timedelta(seconds=2), abs=timedelta(milliseconds=50)
    )
    assert row.payload == {"n": 9}


def test_a_claimed_run_leaves_its_burst(ledger: Ledger) -> None:
    burst, _ = ledger.debounce.join(new_row(), key="", debounce=0.01, most=0.1)
    start = row_of(ledger, burst).run_after
    wait_until(lambda: ledger.now() >= start, "the burst's start, by the database's clock")
    claim = ledger.claims.claim(burst, "debounced", 1, lease_seconds=30)
    assert claim.outcome == "claimed", claim
    assert row_of(ledger, burst).debounce_key is None
    later, inserted = ledger.debounce.join(new_row(), key="", debounce=1.0, most=10.0)
    assert inserted and later != burst


def test_a_parked_burst_keeps_its_relay_time(ledger: Ledger) -> None:
    burst, _ = ledger.debounce.join(new_row(), key="", debounce=5.0, most=50.0)
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == burst)
            .values(status="parked", next_send_at=None)
        )
    assert ledger.debounce.join(new_row(payload={"n": 4}), key="", debounce=5.0, most=50.0) == (
        burst,
        False,
    )
    row = row_of(ledger, burst)
    assert row.payload == {"n": 4} and row.next_send_at is None


def test_a_push_never_brings_the_relays_next_send_forward(ledger: Ledger) -> None:
    """Review find: a stream of publishes past the burst's longest start set the relay's
    next send back to that (past) start at every push, undoing the relay's backoff: while
    no worker was free, the relay sent the burst again at every pass until it gave up on
    it, and the burst, with every publish that returned its id, was lost."""
    burst, _ = ledger.debounce.join(new_row(send_in=30.0), key="", debounce=0.2, most=0.2)
    ledger.dispatches.mark_queued([burst], redeliver_in=3600)  # its message is in the broker
    queued = row_of(ledger, burst)
    wait_until(
        lambda: ledger.now() > queued.run_after,
        "the database's clock to pass the burst's longest start",
    )
    assert ledger.debounce.join(new_row(payload={"n": 1}), key="", debounce=0.2, most=0.2) == (
        burst,
        False,
    )
    pushed = row_of(ledger, burst)
    assert pushed.payload == {"n": 1} and pushed.run_after == queued.run_after  # capped
    assert pushed.next_send_at == queued.next_send_at  # an hour off, as the relay left it
    assert (
        ledger.relay.take_due(10, max_sends=25, first_backoff=1, max_backoff=1, accepted_backoff=1)
        == []
    )
    # A later start still brings the relay's look along with it.
    later, _ = ledger.debounce.join(new_row(), key="later", debounce=0.5, most=50.0)
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == later)
            .values(next_send_at=db_time())
        )
    ledger.debounce.join(new_row(), key="later", debounce=30.0, most=50.0)
    moved = row_of(ledger, later)
    assert moved.next_send_at == moved.run_after


def test_an_early_delivery_gives_the_relay_its_sends_back(ledger: Ledger) -> None:
    """A delivery that came before the row's start reached a worker: the relay's budget of
    sends that found none starts again, so a burst pushed back by a long stream, whose
    early deliveries are dropped one after another, is never given up on."""
    burst, _ = ledger.debounce.join(new_row(), key="", debounce=30.0, most=300.0)
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == burst)
            .values(send_count=24, next_send_at=db_time(3600))
        )
    assert ledger.claims.claim(burst, "debounced", 1, 30).outcome == "early"
    assert ledger.claims.send_when_due(burst, "debounced", 1) is True
    row = row_of(ledger, burst)
    assert (row.send_count, row.next_send_at) == (0, row.run_after)


def test_a_debounced_row_under_a_taken_slot_is_refused(ledger: Ledger) -> None:
    exclusive = QueuePolicy("exclusive")
    held = new_row(singleton_key="s", policy=exclusive)
    assert ledger.dispatches.insert(held)  # a dispatch of the slot, not of a burst
    refused = new_row(singleton_key="s", policy=exclusive)
    assert ledger.debounce.join(refused, key="s", debounce=1.0, most=10.0) == (None, False)
    assert ledger.get(refused.id) is None


def test_one_window_per_key_measured_from_the_accepted_one(ledger: Ledger) -> None:
    first = new_row("throttled")
    assert ledger.throttle.insert(first, key="", window=0.5) == "accepted"
    closed = new_row("throttled")
    assert ledger.throttle.insert(closed, key="", window=0.5) == "closed"
    assert ledger.get(closed.id) is None  # rolled back with the window refused
    # Another key of the job has its own window.
    assert ledger.throttle.insert(new_row("throttled"), key="k", window=0.5) == "accepted"
    with ledger.engine.connect() as conn:
        opens = conn.execute(
            select(throttle_table.c.open_at).where(
                throttle_table.c.job_name == "throttled", throttle_table.c.throttle_key == ""
            )
        ).scalar_one()
    wait_until(lambda: ledger.now() >= opens, "the window to open, by the database's clock")
    again = new_row("throttled")
    assert ledger.throttle.insert(again, key="", window=0.5) == "accepted"
    with ledger.engine.connect() as conn:
        windows = conn.execute(
            select(throttle_table.c.throttle_key, throttle_table.c.dispatch_id).where(
                throttle_table.c.job_name == "throttled"
            )
        ).all()
    assert sorted(windows) == sorted(
        [("", again.id), ("k", windows[[w[0] for w in windows].index("k")][1])]
    )
    # A window open again an hour ago is pruned, one still closed is not.
    assert ledger.throttle.prune_windows(older_than=3600) == 0
    assert ledger.throttle.prune_windows(older_than=-3600) == 2


def test_a_known_key_takes_no_window(ledger: Ledger) -> None:
    keyed = NewDispatch(
        id="11111111-2222-5333-8444-555555555555",
        job_name="throttled",
        payload={},
        options=StoredOptions(),
        idempotency_key="k1",
    )
    assert ledger.throttle.insert(keyed, key="", window=60) == "accepted"
    assert ledger.throttle.insert(keyed, key="", window=60) == "not inserted"


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
    before_last = stack.ledger.now()
    last = stack.questpie.queue["debounce.record"].publish({"tag": t, "seq": "last"}, **BURST)
    for process in publishers:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert last is not None
    assert len(ids) == 50 and set(ids) == {last}
    (run,) = stack.wait_runs(t, 1, timeout=20)
    assert run["dispatch_id"] == last and run["note"] == "last"
    # Not before the quiet period after the last publish: it pushed the start back to
    # two seconds after it (by the database's clock), and the claim came no earlier.
    row = stack.wait_status(last, "completed")
    assert row.run_after is not None and row.started_at is not None
    assert row.run_after >= before_last + timedelta(seconds=BURST["debounce_seconds"])
    assert row.started_at >= row.run_after
    stack.wait_settled(last)  # every message of the burst taken, every delivery of it ended
    assert len(stack.runs(t)) == 1  # once, and only once


def test_a_stream_that_never_pauses_still_runs_by_its_most(stack: Stack) -> None:
    """On Redis and on RabbitMQ: the burst's first message arrives early (its start was
    pushed back), waits in the worker for the start, and claims then. The stream (a
    publish every 0.2 s, well inside the second of quiet) goes on until the first burst
    has run and a second one has begun: a start pushed back for as long as the stream
    lasts would never come."""
    t = tag()
    client = stack.questpie.queue["debounce.record"]  # 1 s of quiet, at most 3 s
    ids: list[str | None] = []

    def ran_while_streaming() -> bool:
        if stack.runs(t) and len(set(ids)) >= 2:
            return True
        ids.append(client.publish({"tag": t, "seq": str(len(ids))}))
        return False

    # The stream itself: a publish every 0.2 s (the interval) until the first burst ran.
    wait_until(
        ran_while_streaming,
        "a burst of a stream that never paused to run",
        60,
        0.2,
        explain=lambda: f"published {ids}",
    )
    assert None not in ids
    bursts = list(dict.fromkeys(ids))  # in order
    first = stack.wait_status(bursts[0], "completed")
    # Its start never past its most (3 s after its first publish, by the database's
    # clock), and its claim not before its start.
    assert first.run_after is not None and first.started_at is not None
    assert first.run_after <= first.created_at + timedelta(seconds=3)
    assert first.started_at >= first.run_after
    (run,) = [r for r in stack.runs(t) if r["dispatch_id"] == bursts[0]]
    # The payload of a publish of the first burst, a late one (the latest before its start).
    seq = int(run["note"])
    assert ids[seq] == bursts[0] and ids[seq + 1] != bursts[0]
    assert first.attempt == 1


#: A throttle window longer than any test here lasts.
LONG_WINDOW = 3600.0


def throttle_window(stack: Stack, job_name: str, key: str) -> tuple[str, Any]:
    """The throttle window of `job_name` and `key`: the dispatch that took it last, and
    when it opens again."""
    w = throttle_table.c
    with stack.ledger.engine.connect() as conn:
        taken_by, opens = conn.execute(
            select(w.dispatch_id, w.open_at).where(w.job_name == job_name, w.throttle_key == key)
        ).one()
    return taken_by, opens


def test_concurrent_throttled_publishes_accept_one_per_window(pg_redis: Stack) -> None:
    stack = pg_redis
    t = tag()
    client = stack.questpie.queue["throttle.record"]  # one per 2 s
    key = f"k-{uuid.uuid4().hex[:8]}"
    suppressed: list[dict[str, Any]] = []

    def heard(sender: Any, **kw: Any) -> None:
        suppressed.append(kw)

    publish_suppressed.connect(heard, weak=False)
    threads, start = 8, threading.Barrier(8)
    answers: list[str | None] = []
    lock = threading.Lock()

    def publish() -> None:
        start.wait(timeout=30)
        # A window no publish of the test outlasts, however slow the machine: one of the
        # 24 takes it, and every other one falls inside it.
        got = [
            client.publish({"tag": t}, singleton_key=key, throttle_seconds=LONG_WINDOW)
            for _ in range(3)
        ]
        with lock:
            answers.extend(got)

    try:
        workers = [threading.Thread(target=publish) for _ in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(timeout=30)
    finally:
        publish_suppressed.disconnect(heard)
    accepted = [a for a in answers if a is not None]
    assert len(answers) == 24 and len(accepted) == 1
    assert len(suppressed) == 23
    assert {s["policy"] for s in suppressed} == {"throttle"}
    assert {s["singleton_key"] for s in suppressed} == {key}
    stack.wait_status(accepted[0], "completed")
    # A suppressed publish wrote nothing: one row of the job's key.
    with stack.ledger.engine.connect() as conn:
        rows = conn.execute(
            select(dispatch_table.c.id).where(
                dispatch_table.c.job_name == "throttle.record",
                dispatch_table.c.singleton_key == key,
            )
        ).all()
    assert [r.id for r in rows] == accepted
    # Another key has a window of its own (the job's 2 s), taken while this one's is
    # closed; it opens again once its time has come, by the database's clock.
    other = key + "-other"
    first = client.publish({"tag": t}, singleton_key=other)
    assert first is not None
    taken_by, opens = throttle_window(stack, "throttle.record", other)
    assert taken_by == first
    wait_until(lambda: stack.ledger.now() >= opens, "the other key's window to open")
    again = client.publish({"tag": t}, singleton_key=other, throttle_seconds=LONG_WINDOW)
    assert again is not None and again != first
    # ... and the publish that took it again closed it again.
    assert client.publish({"tag": t}, singleton_key=other) is None
    stack.wait_status(again, "completed")
    assert len(stack.wait_runs(t, 3)) == 3


def test_a_debounced_singleton_job_gathers_a_burst_while_its_run_holds_the_slot(
    pg_redis: Stack,
) -> None:
    stack = pg_redis
    t = tag()
    client = stack.questpie.queue["debounce.singleton"]  # 0.5 s of quiet, one run at once
    gate = stack.gate()
    held = client.publish({"tag": t, "gate": str(gate)})
    assert held is not None
    stack.wait_status(held, "active")
    # The run left its burst: a publish now starts the next one, which waits for the slot.
    burst = client.publish({"tag": t, "sleep": 0.0})
    assert burst is not None and burst != held
    stack.wait_status(burst, "parked")
    # A parked burst still gathers: its payload replaced, its id the same.
    assert client.publish({"tag": t, "sleep": 0.01}) == burst
    assert stack.row(burst).payload == {**stack.row(burst).payload, "sleep": 0.01}
    gate.open()
    stack.wait_status(held, "completed")
    stack.wait_status(burst, "completed")
    ends = stack.wait_ends(t, 2)
    assert [e["dispatch_id"] for e in ends] == [held, burst]


def test_a_parked_burst_whose_start_moved_far_off_waits_in_the_ledger(pg_redis: Stack) -> None:
    """Review find: a parked burst keeps gathering, and its start moves with it; when its
    slot frees it is handed on, but a start further off than the broker ETA horizon (60 s)
    waits in the ledger for the relay, as a far-off publish does, not as an ETA a worker
    holds (Redis redelivers one past its visibility timeout; RabbitMQ closes the channel
    past its consumer timeout)."""
    stack = pg_redis
    t = tag()
    client = stack.questpie.queue["debounce.singleton"]
    gate = stack.gate()
    held = client.publish({"tag": t, "gate": str(gate)})
    assert held is not None
    stack.wait_status(held, "active")
    burst = client.publish({"tag": t})
    assert burst is not None
    stack.wait_status(burst, "parked")
    assert client.publish({"tag": t}, debounce_seconds=600, debounce_max_seconds=6000) == burst
    gate.open()
    stack.wait_status(held, "completed")
    row = stack.wait_status(burst, "queued")
    assert row.next_send_at is not None and row.run_after is not None
    # The relay's time: the start less the horizon, give or take the hosts' clocks.
    relay_ahead = (row.run_after - row.next_send_at).total_seconds()
    assert 55 < relay_ahead < 65, relay_ahead
    scheduled = stack.celery_app.control.inspect(timeout=2).scheduled() or {}
    held_ids = [e["request"]["id"] for entries in scheduled.values() for e in entries]
    assert burst not in held_ids
    assert stack.questpie.queue.cancel(burst) is True  # the job's slot, free for the next test


@pytest.mark.parametrize(("broker", "ledger"), [("redis", "postgresql"), ("filesystem", "sqlite")])
def test_a_stream_past_the_longest_start_while_no_worker_is_free_runs_once_later(
    make_stack: StackFactory, broker: str, ledger: str
) -> None:
    """Review find: the queue's one worker process is busy while a steady stream of
    debounced publishes goes on past the burst's longest start. Each burst must run once
    the worker is free, as a plain dispatch does; before the fix each publish brought the
    relay's next send back to the past start, the relay sent the burst at every pass, and
    after its 25 sends recorded it failed: the burst and every publish of it lost."""
    stack = make_stack(broker, ledger=ledger, concurrency=1, env={"QP_TEST_RELAY": "0.2"})
    t = tag()
    gate = stack.gate()
    busy = stack.questpie.queue.record.publish(
        {"tag": t + "-busy", "gate": str(gate)}, idempotency_key=t + "-busy"
    )
    assert busy is not None
    stack.wait_status(busy, "active")
    client = stack.questpie.queue["debounce.record"]
    ids: list[str | None] = []
    began = time.monotonic()
    while time.monotonic() - began < 10.0:  # the scenario: a steady stream for 10 s
        ids.append(
            client.publish(
                {"tag": t, "seq": str(len(ids))}, debounce_seconds=0.5, debounce_max_seconds=0.5
            )
        )
        time.sleep(0.3)  # the stream's rhythm
    bursts = list(dict.fromkeys(ids))
    assert None not in bursts and ids.count(bursts[0]) >= 3, ids
    gate.open()
    for dispatch_id in bursts:
        assert dispatch_id is not None
        row = stack.wait_status(dispatch_id, "completed", timeout=60)
        assert row.last_error is None and row.attempt == 1
    runs = [r["dispatch_id"] for r in stack.wait_runs(t, len(bursts))]
    assert sorted(runs) == sorted(bursts)  # each once


def test_publish_many_debounces_each_item_by_its_own_key(pg_redis: Stack) -> None:
    stack = pg_redis
    t = tag()
    client = stack.questpie.queue["debounce.record"]
    ids = client.publish_many(
        [{"tag": t, "seq": str(n)} for n in range(6)],
        singleton_keys=["a", "b", "a", None, "b", "a"],
    )
    assert None not in ids
    a, b, whole = ids[0], ids[1], ids[3]
    assert ids == [a, b, a, whole, b, a] and len({a, b, whole}) == 3
    runs = {r["dispatch_id"]: r["note"] for r in stack.wait_runs(t, 3)}
    assert runs == {a: "5", b: "4", whole: "3"}  # each burst's latest payload
    throttled = stack.questpie.queue["throttle.record"]
    k = uuid.uuid4().hex
    got = throttled.publish_many([{"tag": t}] * 4, singleton_keys=[k, k, k + "x", k])
    assert got[0] is not None and got[2] is not None and got[1] is None and got[3] is None


def test_apublish_debounces_and_throttles_without_the_batcher(pg_redis: Stack) -> None:
    stack = pg_redis
    t, k = tag(), uuid.uuid4().hex
    debounced = stack.questpie.queue["debounce.record"]
    throttled = stack.questpie.queue["throttle.record"]

    async def body() -> tuple[list[str | None], list[str | None], list[str | None]]:
        burst = await asyncio.gather(
            *(debounced.apublish({"tag": t, "seq": str(n)}, singleton_key=k) for n in range(5))
        )
        windows = await asyncio.gather(
            *(throttled.apublish({"tag": t}, singleton_key=k) for _ in range(5))
        )
        many = await throttled.apublish_many([{"tag": t}] * 2, singleton_keys=[k + "m", k + "m"])
        return list(burst), list(windows), many

    burst, windows, many = run(stack.questpie, body)
    assert len(set(burst)) == 1 and None not in burst
    assert sum(w is not None for w in windows) == 1
    assert many[0] is not None and many[1] is None
    (ran,) = [r for r in stack.wait_runs(t, 3) if r["dispatch_id"] == burst[0]]
    assert ran["job_name"] == "debounce.record"


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"debounce_seconds": 1.0, "idempotency_key": "k"}, "idempotency_key"),
        ({"debounce_seconds": 1.0, "secret_payload": True}, "secret_payload"),
        ({"debounce_seconds": 1.0, "start_after": 5}, "start_after"),
        ({"debounce_seconds": 1.0, "debounce_max_seconds": 0.5}, "at least"),
        ({"debounce_seconds": 0}, "above 0"),
        ({"throttle_seconds": -1}, "above 0"),
        ({"debounce_seconds": 1.0, "throttle_seconds": 1.0}, "both"),
    ],
)
def test_refused_combinations_write_nothing(
    pg_redis: Stack, options: dict[str, Any], words: str
) -> None:
    stack = pg_redis
    before = stack.dispatch_count()
    with pytest.raises(PublishOptionsError, match=words) as refused:
        stack.questpie.queue["record"].publish({"tag": tag()}, **options)
    assert isinstance(refused.value, ValueError)
    shared = {name: value for name, value in options.items() if name != "idempotency_key"}
    keys = ["k"] if "idempotency_key" in options else None
    with pytest.raises(PublishOptionsError, match=words):
        stack.questpie.queue["record"].publish_many(
            [{"tag": tag()}], idempotency_keys=keys, **shared
        )
    assert stack.dispatch_count() == before


@pytest.fixture
def caller_engine(pg_redis: Stack) -> Iterator[Engine]:
    """An engine of the caller's own on the stack's ledger database."""
    engine = create_engine(pg_redis.env["QP_TEST_LEDGER"])
    yield engine
    engine.dispose()


def test_throttle_refuses_a_callers_transaction(pg_redis: Stack, caller_engine: Engine) -> None:
    stack = pg_redis
    before = stack.dispatch_count()
    with (
        Session(caller_engine) as session,
        pytest.raises(PublishOptionsError, match="transaction"),
    ):
        stack.questpie.queue["throttle.record"].publish({"tag": tag()}, session=session)
    assert stack.dispatch_count() == before


def test_a_debounced_publish_in_a_callers_transaction_joins_its_burst_at_commit(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    stack = pg_redis
    t, k = tag(), uuid.uuid4().hex
    client = stack.questpie.queue["debounce.record"]
    with Session(caller_engine) as session:
        first = client.publish({"tag": t, "seq": "1"}, singleton_key=k, session=session)
        assert client.publish({"tag": t, "seq": "2"}, singleton_key=k, session=session) == first
        session.commit()
    assert client.publish({"tag": t, "seq": "3"}, singleton_key=k) == first
    (run_,) = stack.wait_runs(t, 1)
    assert run_["dispatch_id"] == first and run_["note"] == "3"


def test_a_publish_in_a_long_callers_transaction_starts_its_quiet_period_at_the_publish(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    """Review find: PostgreSQL's now() is the time the transaction began, so a debounced
    publish in a caller's transaction open for a while set the burst's start long past,
    earlier than a publish a moment before had set it: the burst ran at the commit. Its
    quiet period counts from the publish's own statement."""
    stack = pg_redis
    t, k = tag(), uuid.uuid4().hex
    client = stack.questpie.queue["debounce.record"]
    options: dict[str, Any] = {"debounce_seconds": 5.0, "debounce_max_seconds": 50.0}
    with Session(caller_engine) as session:
        session.execute(select(1))  # the caller's transaction is open ...
        time.sleep(6.0)  # ... doing its own work: the scenario, a transaction open for long
        burst = client.publish({"tag": t, "seq": "1"}, singleton_key=k, **options)
        assert burst is not None
        first = stack.row(burst)
        before = first.run_after
        wait_until(
            lambda: stack.ledger.now() > first.created_at,
            "the database's clock to move past the first publish",
        )
        published = stack.ledger.now()  # the database's clock, just before the publish
        again = client.publish({"tag": t, "seq": "2"}, singleton_key=k, session=session, **options)
        assert again == burst
        session.commit()
    row = stack.row(burst)
    assert row.payload == {"tag": t, "seq": "2"}
    assert row.run_after is not None and before is not None
    assert row.run_after > before  # later, never earlier
    # Its quiet period counts from the publish, not from the transaction's start.
    assert row.run_after >= published + timedelta(seconds=options["debounce_seconds"])
    (ran,) = stack.wait_runs(t, 1, timeout=20)
    assert ran["note"] == "2"


# --- a reply lost on a dropped connection ----------------------------------------------------


def test_a_new_burst_whose_insert_reply_is_lost_is_read_back_and_sent(
    proxy: FaultProxy, via_proxy: StackFactory
) -> None:
    stack = via_proxy("redis", start_worker=False)
    proxy.arm(b"INSERT INTO questpie_queue_dispatch")
    first = stack.questpie.queue["debounce.record"].publish({"tag": tag(), "seq": "1"})
    assert proxy.fired.is_set(), "the publish sent no insert"
    with stack.ledger.engine.connect() as conn:
        written = conn.execute(select(dispatch_table.c.id)).scalars().all()
    assert written == [first]
    assert capture(stack, stack.queue_name).headers["id"] == first
    # The burst goes on: the next publish joins it.
    assert stack.questpie.queue["debounce.record"].publish({"tag": tag(), "seq": "2"}) == first


def test_a_throttle_whose_commit_reply_is_lost_is_read_back_through_its_window(
    proxy: FaultProxy, via_proxy: StackFactory
) -> None:
    stack = via_proxy("redis", start_worker=False)
    client = stack.questpie.queue["throttle.record"]
    # A first throttled publish reads (and records) the job's policy: the next one's
    # transaction is the only one to commit.
    assert client.publish({"tag": tag()}, singleton_key="before") is not None
    proxy.arm(b"Q\x00\x00\x00\x0bCOMMIT\x00")  # the message, not "BEGIN ... READ COMMITTED"
    accepted = client.publish({"tag": tag()})
    assert proxy.fired.is_set(), "the throttle's transaction never committed"
    assert accepted is not None
    with stack.ledger.engine.connect() as conn:
        written = conn.execute(select(dispatch_table.c.id)).scalars().all()
        windows = (
            conn.execute(
                select(throttle_table.c.dispatch_id).where(throttle_table.c.throttle_key == "")
            )
            .scalars()
            .all()
        )
    assert accepted in written and len(written) == 2 and windows == [accepted]
    assert {capture(stack, stack.queue_name).headers["id"] for _ in range(2)} == set(written)
    assert client.publish({"tag": tag()}) is None  # and the window holds


# --- the embedded default and a pooler -------------------------------------------------------


def test_a_burst_and_a_window_on_sqlite_with_a_real_worker(sqlite_fs: Stack) -> None:
    stack = sqlite_fs
    t = tag()
    debounced = stack.questpie.queue["debounce.record"]
    ids = [debounced.publish({"tag": t, "seq": str(n)}) for n in range(10)]
    assert len(set(ids)) == 1 and ids[0] is not None
    throttled = stack.questpie.queue["throttle.record"]
    k = uuid.uuid4().hex
    windows = [throttled.publish({"tag": t}, singleton_key=k) for _ in range(5)]
    assert windows[0] is not None and windows[1:] == [None] * 4
    runs = stack.wait_runs(t, 2)
    assert {r["dispatch_id"] for r in runs} == {ids[0], windows[0]}
    (burst,) = [r for r in runs if r["dispatch_id"] == ids[0]]
    assert burst["note"] == "9"
    stack.wait_status(ids[0], "completed")
    stack.wait_status(windows[0], "completed")
    stack.wait_settled(ids[0], windows[0])  # every message taken, every delivery ended
    assert len(stack.runs(t)) == 2


def test_the_statements_carry_a_pooled_ledgers_settings(pooled_stack: Stack) -> None:
    ledger = pooled_stack.ledger  # through PgBouncer in transaction mode, pooled=True
    key = uuid.uuid4().hex
    burst, inserted = ledger.debounce.join(new_row(payload={"n": 1}), key=key, debounce=30, most=60)
    assert inserted
    assert ledger.debounce.join(new_row(payload={"n": 2}), key=key, debounce=30, most=60) == (
        burst,
        False,
    )
    assert row_of(ledger, burst).payload == {"n": 2}
    assert ledger.throttle.insert(new_row("throttled"), key=key, window=30) == "accepted"
    assert ledger.throttle.insert(new_row("throttled"), key=key, window=30) == "closed"


def test_a_debounced_publish_on_a_bare_connection_is_sent_by_the_relay(
    pg_redis: Stack, caller_engine: Engine
) -> None:
    stack = pg_redis
    t, k = tag(), uuid.uuid4().hex
    client = stack.questpie.queue["debounce.record"]
    with caller_engine.begin() as conn:
        first = client.publish({"tag": t, "seq": "1"}, singleton_key=k, connection=conn)
        assert first is not None
        assert client.publish({"tag": t, "seq": "2"}, singleton_key=k, connection=conn) == first
    # No commit hook: the relay sends it once due (woken by the commit, due after 1 s).
    (ran,) = stack.wait_runs(t, 1, timeout=20)
    assert ran["dispatch_id"] == first and ran["note"] == "2"
