"""Concurrency and rate limits per group, enforced by the ledger for every worker:
real prefork workers (two of them), PostgreSQL or SQLite, Redis or RabbitMQ.

What ran, and when, is read from the start and end rows the handlers record; a run held
open by a gate stays active for as long as the test wants.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import inspect, text, update
from sqlalchemy.exc import IntegrityError

from questpie_celery.cli.commands import main
from questpie_celery.jobs.limits import Limits
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import SCHEMA_VERSION, Claim, Ledger, NewDispatch, dispatch_table
from questpie_celery.ledger.errors import Reruns, SlotTaken
from questpie_celery.send.broker import Sender
from questpie_celery.send.outbox import Outbox
from questpie_celery.worker.slots import Slots
from tests.integration.conftest import StackFactory
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


def group() -> str:
    return f"tenant-{uuid.uuid4().hex[:8]}"


def most_at_once(stack: Stack, t: str, dispatch_ids: set[str] | None = None) -> int:
    """The most runs of tag `t` (of `dispatch_ids`, when given) that were running at one
    instant, from their recorded starts and ends."""
    starts = {(r["dispatch_id"], r["attempt"]): r["ran_at"] for r in stack.runs(t)}
    events: list[tuple[datetime, int]] = []
    for end in stack.runs(t, phase="end"):
        if dispatch_ids is not None and end["dispatch_id"] not in dispatch_ids:
            continue
        # An end sorts before a start at the same instant: they did not overlap.
        events += [(starts[(end["dispatch_id"], end["attempt"])], 1), (end["ran_at"], -1)]
    running = peak = 0
    for _, step in sorted(events):
        running += step
        peak = max(peak, running)
    return peak


def most_starts_within(starts: list[datetime], window: float) -> int:
    """The most of `starts` inside any window of `window` seconds."""
    ordered = sorted(starts)
    return max(
        (
            sum(1 for later in ordered[i:] if later - first < timedelta(seconds=window))
            for i, first in enumerate(ordered)
        ),
        default=0,
    )


@pytest.fixture(scope="module")
def two_workers(stack: Stack) -> Stack:
    """The module's stack with a second prefork worker: four pool processes in all."""
    if not stack.extra_workers:
        stack.start_worker()
    return stack


def test_concurrency_limit_holds_per_group_across_two_workers(two_workers: Stack) -> None:
    stack = two_workers
    t = tag()
    client = stack.questpie.queue.limit_concurrency
    groups = [group(), group()]
    ids = {
        g: [client.publish({"tag": t, "sleep": 0.4}, group_key=g) for _ in range(5)] for g in groups
    }
    for dispatch_id in itertools.chain(*ids.values()):
        assert dispatch_id is not None
        row = stack.wait_status(dispatch_id, "completed", timeout=60)
        # Waiting for a seat is not an attempt: each ran once, first time.
        assert row.attempt == 1
        assert row.waiting_for is None
    for g in groups:
        assert most_at_once(stack, t, set(map(str, ids[g]))) <= 2
    # One group at its limit never held the other back: four ran at once somewhere.
    assert most_at_once(stack, t) > 2
    assert len(stack.runs(t)) == 10  # every run started exactly once


def test_waiting_runs_say_why_and_go_by_priority_then_age(two_workers: Stack) -> None:
    stack = two_workers
    t, g = tag(), group()
    client = stack.questpie.queue.limit_one
    gate = stack.gate()
    first = client.publish({"tag": t, "gate": str(gate)}, group_key=g)
    assert first is not None
    stack.wait_status(first, "active")
    low = client.publish({"tag": t}, group_key=g, priority=1)
    older = client.publish({"tag": t}, group_key=g, priority=5)
    newer = client.publish({"tag": t}, group_key=g, priority=5)
    other = client.publish({"tag": t}, group_key=group())  # another tenant: not held back
    assert low and older and newer and other
    stack.wait_status(other, "completed")
    for dispatch_id in (low, older, newer):
        parked = stack.wait_status(dispatch_id, "parked")
        assert parked.waiting_for == "concurrency"
        status = stack.questpie.queue.get_status(dispatch_id)
        assert status is not None
        assert status.waiting_for == "concurrency" and status.group_key == g
    counts = {(c.job_name, c.group_key): c for c in stack.ledger.limits.group_counts()}
    assert counts[("limit.one", g)].running == 1
    assert counts[("limit.one", g)].waiting_for_concurrency == 3
    listing = CliRunner().invoke(
        main, ["dispatches", "groups", "--ledger-url", stack.env["QP_TEST_LEDGER"]]
    )
    assert listing.exit_code == 0, listing.output
    assert g in listing.output and "limit.one" in listing.output
    gate.open()
    for dispatch_id in (first, low, older, newer):
        stack.wait_status(dispatch_id, "completed")
    started = [r["dispatch_id"] for r in stack.runs(t) if r["dispatch_id"] != other]
    assert started == [first, older, newer, low]
    assert most_at_once(stack, t, {first, low, older, newer}) == 1


def test_a_plain_celery_call_of_a_limited_job_counts_against_the_job(two_workers: Stack) -> None:
    stack = two_workers
    t = tag()
    client = stack.questpie.queue.limit_one
    gate = stack.gate()
    held = client.publish({"tag": t, "gate": str(gate)})  # the job as a whole: one at once
    assert held is not None
    stack.wait_status(held, "active")
    plain = stack.celery_app.tasks["limit.one"].delay({"tag": t})
    parked = stack.wait_status(plain.id, "parked")  # taken into the ledger, and held back
    assert parked.waiting_for == "concurrency" and parked.group_key is None
    gate.open()
    stack.wait_status(held, "completed")
    stack.wait_status(plain.id, "completed")
    assert most_at_once(stack, t) == 1


def test_a_killed_workers_seat_frees_within_its_lease(
    make_stack: object,
) -> None:
    stack = make_stack(  # type: ignore[operator]
        "redis", env={"QP_TEST_LEASE": "2", "QP_TEST_RELAY": "0.5"}
    )
    t, g = tag(), group()
    client = stack.questpie.queue.limit_one
    gate = stack.gate()
    held = client.publish({"tag": t, "gate": str(gate)}, group_key=g)
    assert held is not None
    stack.wait_status(held, "active")
    waiting = client.publish({"tag": t}, group_key=g)
    assert waiting is not None
    stack.wait_status(waiting, "parked")
    pid = stack.wait_runs(t, 1)[0]["pid"]
    os.kill(pid, signal.SIGKILL)  # the pool process holding the seat dies mid-run
    # Its lease lapses, the relay ends the attempt (no retries left), the seat frees, and
    # the waiting run goes.
    stack.wait_status(held, "failed", timeout=30)
    stack.wait_status(waiting, "completed", timeout=30)
    gate.open()


def test_rate_limit_holds_per_group_across_two_workers(two_workers: Stack) -> None:
    stack = two_workers
    t = tag()
    client = stack.questpie.queue.limit_rate
    busy, other = group(), group()
    ids = [client.publish({"tag": t}, group_key=busy) for _ in range(10)]
    others = [client.publish({"tag": t}, group_key=other) for _ in range(3)]
    for dispatch_id in [*ids, *others]:
        assert dispatch_id is not None
        row = stack.wait_status(dispatch_id, "completed", timeout=60)
        assert row.attempt == 1  # waiting for a window is not an attempt
    starts = [r["ran_at"] for r in stack.runs(t) if r["dispatch_id"] in set(ids)]
    assert len(starts) == 10
    # Four a second, measured when each took its start (the handler records a moment
    # later, so a little under the window).
    assert most_starts_within(starts, 0.9) <= 4
    # The other group started at once, not behind the busy one: all three before the
    # busy group's backlog was through (its last start, windows later).
    other_starts = [r["ran_at"] for r in stack.runs(t) if r["dispatch_id"] in set(others)]
    assert len(other_starts) == 3
    assert max(other_starts) < max(starts), (sorted(starts), sorted(other_starts))


def test_concurrency_limit_on_sqlite_with_two_workers(sqlite_fs: Stack) -> None:
    stack = sqlite_fs
    if not stack.extra_workers:
        stack.start_worker()
    t, g = tag(), group()
    client = stack.questpie.queue.limit_concurrency
    ids = [client.publish({"tag": t, "sleep": 0.3}, group_key=g) for _ in range(6)]
    for dispatch_id in ids:
        assert dispatch_id is not None
        assert stack.wait_status(dispatch_id, "completed", timeout=60).attempt == 1
    assert most_at_once(stack, t) <= 2


# --- the ledger alone, under contention --------------------------------------------------


def _rows(ledger: Ledger, job: str, grp: str, count: int) -> list[str]:
    ids = [f"{job}-{uuid.uuid4().hex}" for _ in range(count)]
    for dispatch_id in ids:
        assert ledger.dispatches.insert(
            NewDispatch(
                id=dispatch_id,
                job_name=job,
                payload={},
                options=StoredOptions(),
                group_key=grp,
                status="queued",
            )
        )
    return ids


def test_concurrent_claims_never_take_more_seats_than_the_limit(ledger: Ledger) -> None:
    job = f"limited-{uuid.uuid4().hex[:6]}"
    ids = _rows(ledger, job, "g", 12)
    barrier = threading.Barrier(len(ids))
    outcomes: dict[str, str] = {}

    def claim(dispatch_id: str) -> None:
        barrier.wait()
        outcomes[dispatch_id] = ledger.claims.claim(dispatch_id, job, 1, 30, concurrency=3).outcome

    threads = [threading.Thread(target=claim, args=(i,)) for i in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [i for i, outcome in outcomes.items() if outcome == "claimed"]
    assert len(claimed) == 3
    assert {outcome for i, outcome in outcomes.items() if i not in claimed} == {"blocked"}
    seats = sorted(ledger.get(i).seat for i in claimed)  # type: ignore[union-attr]
    assert seats == [0, 1, 2]
    # A run that ends frees its seat: the next claim takes that one.
    finished = ledger.get(claimed[1])
    assert finished is not None and finished.claim_token is not None
    assert ledger.claims.finish(finished.id, finished.claim_token, "completed", None)
    waiting = next(i for i in ids if i not in claimed)
    again = ledger.claims.claim(waiting, job, 1, 30, concurrency=3)
    assert again.outcome == "claimed" and again.row is not None
    assert again.row.seat == finished.seat


def test_concurrent_starts_take_at_most_the_rate(ledger: Ledger) -> None:
    job = f"rated-{uuid.uuid4().hex[:6]}"
    barrier = threading.Barrier(10)
    taken: list[float | None] = []
    lock = threading.Lock()

    def start() -> None:
        barrier.wait()
        answer = ledger.limits.take_permit(job, "g", 3, 60.0)
        with lock:
            taken.append(answer)

    threads = [threading.Thread(target=start) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert taken.count(None) == 3
    # Those refused learn how long until a start frees: about the window.
    assert all(answer is not None and 0 <= answer <= 60 for answer in taken if answer is not None)
    assert ledger.limits.take_permit(job, "other", 3, 60.0) is None  # another group: its own


def test_migrating_a_version_5_ledger_adds_the_limits(ledger: Ledger) -> None:
    """A ledger made before version 6 had no groups, seats, waits or permits."""
    kept = _rows(ledger, "old-job", "g", 1)[0]
    with ledger.engine.begin() as conn:
        conn.execute(text("DROP INDEX questpie_limit_seat"))
        conn.execute(text("DROP INDEX questpie_limit_waiting"))
        conn.execute(text("DROP TABLE questpie_rate_permit"))
        for table, column in (
            ("questpie_queue_dispatch", "group_key"),
            ("questpie_queue_dispatch", "seat"),
            ("questpie_queue_dispatch", "waiting_for"),
            ("questpie_schedule", "group_key"),
        ):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
    assert ledger.migration.migrate() == SCHEMA_VERSION
    assert ledger.migration.migrate() == SCHEMA_VERSION
    inspector = inspect(ledger.engine)
    columns = {c["name"] for c in inspector.get_columns("questpie_queue_dispatch")}
    assert {"group_key", "seat", "waiting_for"} <= columns
    assert "questpie_rate_permit" in inspector.get_table_names()
    indexes = {i["name"] for i in inspector.get_indexes("questpie_queue_dispatch")}
    assert {"questpie_limit_seat", "questpie_limit_waiting"} <= indexes
    old = ledger.get(kept)
    assert old is not None and old.group_key is None  # the old row came through
    claim = ledger.claims.claim(kept, "old-job", 1, 30, concurrency=1)
    assert claim.outcome == "claimed" and claim.row is not None and claim.row.seat == 0
    assert ledger.limits.take_permit("old-job", "", 1, 1.0) is None


def test_a_groups_free_seat_is_found_whatever_the_other_groups_hold(ledger: Ledger) -> None:
    """The seat search looks at the run's own group only (it once saw seats of every
    group, and found none free where one was)."""
    job = f"limited-{uuid.uuid4().hex[:6]}"
    busy = _rows(ledger, job, "a", 2)
    for dispatch_id in busy:
        assert ledger.claims.claim(dispatch_id, job, 1, 30, concurrency=3).outcome == "claimed"
    first, second, third = _rows(ledger, job, "b", 3)
    assert ledger.claims.claim(first, job, 1, 30, concurrency=2).row.seat == 0  # type: ignore[union-attr]
    claimed = ledger.claims.claim(second, job, 1, 30, concurrency=2)
    assert claimed.outcome == "claimed" and claimed.row is not None and claimed.row.seat == 1
    assert ledger.claims.claim(third, job, 1, 30, concurrency=2).outcome == "blocked"


# --- what a hostile review found, each a test that failed first ----------------------------


@pytest.fixture
def outbox(ledger: Ledger) -> Iterator[Outbox]:
    """A real outbox sending over kombu's in-memory transport (no worker reads it)."""
    made = Outbox(ledger, Sender(Celery("limits", broker="memory://")), redeliver_after=60.0)
    yield made
    made.close()


def _claimed(ledger: Ledger, dispatch_id: str, job: str, **kwargs: Any) -> Claim:
    claim = ledger.claims.claim(dispatch_id, job, kwargs.pop("attempt", 1), 30, **kwargs)
    assert claim.outcome == "claimed" and claim.token is not None and claim.row is not None
    return claim


def test_the_relay_reaches_a_group_with_room_behind_a_hundred_full_ones(
    ledger: Ledger, outbox: Outbox
) -> None:
    job = f"limited-{uuid.uuid4().hex[:6]}"
    for i in range(101):
        holder, waiter = _rows(ledger, job, f"a{i:03d}", 2)
        claim = _claimed(ledger, holder, job, concurrency=1)
        assert ledger.claims.claim(waiter, job, 1, 30, concurrency=1).outcome == "blocked"
        assert ledger.slots.park(waiter, job, 1, "concurrency")
    # The last group's holder ended, and its worker died before it could hand on.
    assert claim.token is not None
    assert ledger.claims.finish(holder, claim.token, "completed", None)
    slots = Slots(ledger, outbox, lambda _: Limits(concurrency=1), lambda: [job])
    assert slots.send_all_waiting() == 1
    assert ledger.get(waiter).status == "queued"  # type: ignore[union-attr]


def test_a_run_refused_again_at_its_time_keeps_its_place_in_the_queue(ledger: Ledger) -> None:
    job = f"rated-{uuid.uuid4().hex[:6]}"
    assert ledger.limits.take_permit(job, "g", 1, 3600.0) is None  # the window's one start
    waits: dict[str, float] = {}
    # In the order they came (SQLite's clock may give them one millisecond: then by id).
    ids = sorted(_rows(ledger, job, "g", 3), key=lambda i: (ledger.get(i).created_at, i))  # type: ignore[union-attr]
    for dispatch_id in ids:
        claim = _claimed(ledger, dispatch_id, job)
        assert ledger.limits.take_permit(job, "g", 1, 3600.0) is not None
        assert claim.row is not None and claim.token is not None
        waits[dispatch_id] = ledger.limits.rate_wait(job, "g", 1, 3600.0, claim.row)
        assert ledger.limits.wait_for_rate(dispatch_id, claim.token, retry_in=0.0, relay_in=60.0)
    first, second, third = ids
    assert waits[first] < waits[second] < waits[third]  # first come, first served
    # The first one's time comes, but a newcomer took the start a moment before: it waits
    # again, and still goes before the two that came after it.
    again = _claimed(ledger, first, job)
    assert again.row is not None
    assert ledger.limits.rate_wait(job, "g", 1, 3600.0, again.row) < waits[second]


def test_a_claim_without_a_limit_never_meets_the_seat_index(ledger: Ledger) -> None:
    """The job's concurrency_limit was removed (or this worker's code has none yet)."""
    job = f"was-limited-{uuid.uuid4().hex[:6]}"
    waiting, running = _rows(ledger, job, "g", 2)
    # Under the old code: `waiting` took seat 0 and was set back for its rate window (its
    # seat column still 0), then `running` took seat 0 and awaits its retry, holding it.
    claim = _claimed(ledger, waiting, job, concurrency=1)
    assert claim.token is not None
    assert ledger.limits.wait_for_rate(waiting, claim.token, retry_in=0.0, relay_in=60.0)
    held = _claimed(ledger, running, job, concurrency=1)
    assert held.token is not None
    assert ledger.claims.retry(running, held.token, retry_in=600.0, relay_in=600.0, error="Boom")
    got = ledger.claims.claim(waiting, job, 1, 30)
    assert got.outcome == "claimed" and got.row is not None and got.row.seat is None


def test_a_seat_conflict_is_told_apart_from_a_policy_slot_on_both_dialects(
    ledger: Ledger,
) -> None:
    job = f"limited-{uuid.uuid4().hex[:6]}"
    first, second = _rows(ledger, job, "g", 2)
    assert _claimed(ledger, first, job, concurrency=1).row.seat == 0  # type: ignore[union-attr]
    with ledger.engine.begin() as conn, pytest.raises(IntegrityError) as met:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == second)
            .values(status="active", seat=0, group_key="g")
        )
    with pytest.raises(SlotTaken) as taken, Reruns(after_rollback=False).attempts().__next__():
        raise met.value
    assert taken.value.seat


def test_a_run_waiting_for_its_rate_window_is_not_listed_as_stuck(ledger: Ledger) -> None:
    job = f"rated-{uuid.uuid4().hex[:6]}"
    [dispatch_id] = _rows(ledger, job, "g", 1)
    claim = _claimed(ledger, dispatch_id, job)
    assert claim.token is not None
    with ledger.engine.begin() as conn:  # its delivery came ten minutes ago
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(queued_at=datetime.now(UTC) - timedelta(minutes=10))
        )
    # ... and it waits another fifty for a start of its "N/h" limit.
    assert ledger.limits.wait_for_rate(dispatch_id, claim.token, retry_in=3000.0, relay_in=3060.0)
    assert [
        c for c in ledger.views.stuck_counts(grace=60.0, redeliver_after=300.0) if c[1] == job
    ] == []


def test_a_park_tried_again_after_it_landed_still_looks_for_a_free_seat(
    ledger: Ledger, outbox: Outbox
) -> None:
    """The park's first try landed and its reply (or the look after it) was lost; the
    delivery's wait for the ledger runs the step again, whose park then matches nothing."""
    job = f"limited-{uuid.uuid4().hex[:6]}"
    holder, waiter = _rows(ledger, job, "g", 2)
    claim = _claimed(ledger, holder, job, concurrency=1)
    assert ledger.claims.claim(waiter, job, 1, 30, concurrency=1).outcome == "blocked"
    assert ledger.slots.park(waiter, job, 1, "concurrency")  # the first try
    assert claim.token is not None  # the holder ends meanwhile, finding nobody parked yet
    assert ledger.claims.finish(holder, claim.token, "completed", None)
    Slots(ledger, outbox, lambda _: Limits(concurrency=1), lambda: [job]).park(
        waiter, job, 1, for_seat=True
    )
    assert ledger.get(waiter).status == "queued"  # type: ignore[union-attr]


def test_a_lowered_limit_holds_at_the_claim_while_runs_above_it_finish(ledger: Ledger) -> None:
    job = f"lowered-{uuid.uuid4().hex[:6]}"
    ids = _rows(ledger, job, "g", 4)
    held = [_claimed(ledger, dispatch_id, job, concurrency=3) for dispatch_id in ids[:3]]
    first = held[0]
    assert first.token is not None and first.row is not None and first.row.seat == 0
    assert ledger.claims.finish(ids[0], first.token, "completed", None)  # seat 0 frees
    # The new code's limit is 1: two runs still hold seats 1 and 2, so seat 0 stays free.
    assert ledger.claims.claim(ids[3], job, 1, 30, concurrency=1).outcome == "blocked"
    # Under the old limit it would have gone, to seat 0.
    again = ledger.claims.claim(ids[3], job, 1, 30, concurrency=3)
    assert again.row is not None and again.row.seat == 0


def test_the_relay_reaches_its_own_job_behind_a_hundred_it_does_not_run(
    ledger: Ledger, outbox: Outbox
) -> None:
    """Jobs of another app on the same ledger (or gone from the code) with parked runs."""
    mine = f"zz-mine-{uuid.uuid4().hex[:6]}"
    for i in range(100):
        foreign = f"aa-foreign-{i:03d}"
        [waiter] = _rows(ledger, foreign, "g", 1)
        assert ledger.slots.park(waiter, foreign, 1, "concurrency")
    holder, waiter = _rows(ledger, mine, "g", 2)
    claim = _claimed(ledger, holder, mine, concurrency=1)
    assert ledger.claims.claim(waiter, mine, 1, 30, concurrency=1).outcome == "blocked"
    assert ledger.slots.park(waiter, mine, 1, "concurrency")
    assert claim.token is not None  # the holder ends, and its worker dies before handing on
    assert ledger.claims.finish(holder, claim.token, "completed", None)
    ours = {mine: Limits(concurrency=1)}
    Slots(ledger, outbox, ours.get, lambda: list(ours)).send_all_waiting()
    assert ledger.get(waiter).status == "queued"  # type: ignore[union-attr]


def test_a_retry_keeps_its_seat_when_a_worker_without_the_limit_claims_it(
    ledger: Ledger,
) -> None:
    """A rolling deploy: this worker's code has no limit yet."""
    job = f"deploying-{uuid.uuid4().hex[:6]}"
    running, other = _rows(ledger, job, "g", 2)
    held = _claimed(ledger, running, job, concurrency=1)
    assert held.token is not None
    assert ledger.claims.retry(running, held.token, retry_in=0.0, relay_in=60.0, error="Boom")
    plain = ledger.claims.claim(running, job, 2, 30)
    assert plain.outcome == "claimed" and plain.row is not None and plain.row.seat == 0
    assert ledger.claims.claim(other, job, 1, 30, concurrency=1).outcome == "blocked"


# --- a pool process that stood still past its lease -------------------------------------


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_run_whose_process_stood_still_past_its_lease_never_goes_on_beside_its_retry(
    make_stack: StackFactory, broker: str
) -> None:
    """The pool process running a limit-1 group's only seat is stopped (SIGSTOP: a paused
    VM, a debugger, a swap storm) past its lease. The relay ends the lapsed lease, the
    retry runs on the other pool process and the group's next run after it. Continued,
    the stopped process ends itself before its handler takes another step: it records
    no end and no outcome, and never two of the group's runs were in their body at once.
    Before, it ran its handler to the end beside the group's next run."""
    stack = make_stack(broker, env={"QP_TEST_LEASE": "6", "QP_TEST_RELAY": "0.5"})
    client = stack.questpie.queue.fenced_one
    t = tag()
    gate = stack.gate()
    first = client.publish({"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t)
    assert first is not None
    [started] = stack.wait_runs(t, 1)
    stopped = int(started["pid"])
    second = client.publish({"tag": t}, idempotency_key=f"{t}:next")
    assert second is not None
    os.kill(stopped, signal.SIGSTOP)
    try:
        gate.open()  # continued, the stopped run would go on to its end at once
        assert stack.wait_status(first, "completed", timeout=90).attempt == 2
        stack.wait_status(second, "completed", timeout=60)
    finally:
        os.kill(stopped, signal.SIGCONT)
    stack.wait_log(first, "stood still or lost its claim", timeout=30)
    wait_until(lambda: not _alive(stopped), "the stopped pool process to end")
    ends = [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t, phase="end")]
    assert ends == [(first, 2), (second, 1)], "the stopped run went on after it woke"
    assert most_at_once(stack, t) == 1
    row = stack.row(first)
    assert (row.status, row.attempt, row.last_error) == ("completed", 2, None)
    # Each claim's fencing token is larger than the one before it.
    notes = [(r["attempt"], r["note"]) for r in stack.runs(t) if r["dispatch_id"] == first]
    assert notes == [(1, "token=1"), (2, "token=2")]
