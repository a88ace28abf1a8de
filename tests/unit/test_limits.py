"""Flow-control limits without a worker: what a definition and a publish accept, what
reaches the rows, and the ledger's seats, waits and counts on SQLite."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel
from sqlalchemy import select, update

from questpie_celery import JobDefinitionError, PublishOptionsError, job
from questpie_celery.jobs.limits import NO_LIMITS, Limits, Rate
from questpie_celery.ledger import Ledger
from questpie_celery.ledger.schema import rate_permit_table
from questpie_celery.worker.slots import Slots
from tests.unit.helpers import IdleApp, new_dispatch, row_count


class Empty(BaseModel):
    pass


def _noop(payload: Empty, ctx: Any) -> None:
    return None


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency_limit": 0},
        {"concurrency_limit": 10_001},
        {"concurrency_limit": True},
        {"concurrency_limit": "2"},
        {"rate_limit": "5/d"},
        {"rate_limit": "0/s"},
        {"rate_limit": "1.5/s"},
        {"rate_limit": " 5/s"},
        {"rate_limit": 5},
    ],
)
def test_a_definition_with_a_bad_limit_is_refused(options: dict[str, Any]) -> None:
    name = next(iter(options))
    with pytest.raises(JobDefinitionError, match=name):
        job(name=f"bad-{uuid.uuid4().hex[:6]}", schema=Empty, options=options)(_noop)  # type: ignore[arg-type]


def test_limits_are_read_from_the_options() -> None:
    definition = job(
        name=f"limits-{uuid.uuid4().hex[:6]}",
        schema=Empty,
        options={"concurrency_limit": 3, "rate_limit": "100/m"},
    )(_noop)
    assert definition.limits == Limits(concurrency=3, rate=Rate(100, 60.0))
    assert definition.limits.active
    assert not job(name=f"plain-{uuid.uuid4().hex[:6]}", schema=Empty)(_noop).limits.active
    assert Rate.parse("7/h") == Rate(7, 3600.0)


@pytest.mark.parametrize("bad", ["", "x" * 513, "a\0b", 5])
def test_a_bad_group_key_is_refused_before_anything_is_written(idle: IdleApp, bad: Any) -> None:
    client = idle.questpie.queue.limit_one
    before = idle.written()
    with pytest.raises(PublishOptionsError, match="group_key"):
        client.publish({"tag": "x"}, group_key=bad)
    with pytest.raises(PublishOptionsError, match="item 1: group_key"):
        client.publish_many([{"tag": "x"}, {"tag": "y"}], group_keys=["ok", bad])
    assert idle.written() == before


def test_group_keys_must_match_the_payloads(idle: IdleApp) -> None:
    with pytest.raises(PublishOptionsError, match="group_keys has 1 entries for 2 payloads"):
        idle.questpie.queue.limit_one.publish_many([{"tag": "x"}, {"tag": "y"}], group_keys=["a"])
    with pytest.raises(TypeError, match="group_keys"):
        idle.questpie.queue.limit_one.publish_many([{"tag": "x"}], group_key="a")  # type: ignore[call-arg]


def test_every_dispatch_of_a_limited_job_has_a_row_with_its_group(idle: IdleApp) -> None:
    queue = idle.questpie.queue
    one = queue.limit_one.publish({"tag": "x"}, group_key="tenant-a")
    many = queue.limit_one.publish_many(
        [{"tag": "x"}, {"tag": "y"}, {"tag": "z"}], group_keys=["tenant-b", None, "tenant-c"]
    )

    async def publish_async() -> str | None:
        return await queue.limit_rate.apublish({"tag": "x"}, group_key="tenant-d")

    from_loop = asyncio.run(publish_async())
    unkeyed_unlimited = queue.record.publish({"tag": "x"}, group_key="ignored")
    found = {i: idle.ledger.get(i) for i in (one, *many, from_loop) if i is not None}
    assert [found[i].group_key for i in (one, *many, from_loop)] == [  # type: ignore[union-attr,index]
        "tenant-a",
        "tenant-b",
        None,
        "tenant-c",
        "tenant-d",
    ]
    # A job without limits keeps its unkeyed dispatches as plain messages: no row, no group.
    assert unkeyed_unlimited is not None and idle.ledger.get(unkeyed_unlimited) is None


def test_a_schedule_keeps_its_group_key(idle: IdleApp) -> None:
    idle.questpie.queue.limit_rate.schedule({"tag": "x"}, "*/5 * * * *", group_key="tenant-e")
    rows = [row for row, _ in idle.ledger.schedules.listed() if row.job_name == "limit.rate"]
    assert [row.group_key for row in rows] == ["tenant-e"]
    idle.questpie.queue.limit_rate.unschedule()


def test_a_worker_refuses_celerys_own_rate_limit_on_a_rate_limited_job(idle: IdleApp) -> None:
    task = idle.celery_app.tasks["limit.rate"]
    idle.questpie._check_rate_limits()  # none set: starts
    task.rate_limit = "10/s"
    try:
        with pytest.raises(JobDefinitionError, match=r"limit.rate.*Celery's own rate_limit"):
            idle.questpie._check_rate_limits()
    finally:
        task.rate_limit = None
    # A job without a questpie rate_limit keeps Celery's as it is.
    idle.celery_app.tasks["limit.one"].rate_limit = "10/s"
    try:
        idle.questpie._check_rate_limits()
    finally:
        idle.celery_app.tasks["limit.one"].rate_limit = None


def test_a_parked_run_is_sent_on_when_a_seat_frees_and_counted_meanwhile(ledger: Ledger) -> None:
    job_name = "limited"
    rows = [new_dispatch(job_name, group_key="g", status="queued") for _ in range(3)]
    for new in rows:
        assert ledger.dispatches.insert(new)
        # Waiting runs go first come, first served by their rows' creation time, which
        # SQLite's clock gives in milliseconds (rows of one millisecond go by id).
        time.sleep(0.002)
    first = ledger.claims.claim(rows[0].id, job_name, 1, 30, concurrency=1)
    assert first.outcome == "claimed" and first.token is not None
    blocked = ledger.claims.claim(rows[1].id, job_name, 1, 30, concurrency=1)
    assert (blocked.outcome, blocked.blocked_by) == ("blocked", "concurrency")
    assert ledger.slots.park(rows[1].id, job_name, 1, "concurrency")
    assert ledger.slots.park(rows[2].id, job_name, 1, "concurrency")
    [counts] = ledger.limits.group_counts()
    assert (counts.job_name, counts.group_key, counts.running) == (job_name, "g", 1)
    assert counts.waiting_for_concurrency == 2
    assert ledger.limits.seats_taken(job_name, "g") == 1
    assert ledger.claims.finish(rows[0].id, first.token, "completed", None)
    assert ledger.limits.seats_taken(job_name, "g") == 0
    sent = ledger.limits.unpark_first(job_name, "g", 60)
    assert sent is not None and sent.id == rows[1].id and sent.status == "queued"
    # On its way to the seat: counted, so a second hand-on does not send a second run.
    assert ledger.limits.seats_taken(job_name, "g") == 1
    again = ledger.claims.claim(sent.id, job_name, 1, 30, concurrency=1)
    assert again.outcome == "claimed" and again.row is not None
    assert again.row.waiting_for is None and again.row.seat == 0


def test_a_run_refused_a_start_waits_unrun_and_uncounted(ledger: Ledger) -> None:
    new = new_dispatch("rated", status="queued")
    assert ledger.dispatches.insert(new)
    assert ledger.limits.take_permit("rated", "", 1, 3600.0) is None
    claim = ledger.claims.claim(new.id, "rated", 1, 30)
    assert claim.outcome == "claimed" and claim.token is not None and claim.row is not None
    wait = ledger.limits.take_permit("rated", "", 1, 3600.0)
    assert wait is not None and 3500 < wait <= 3600
    back = ledger.limits.wait_for_rate(new.id, claim.token, retry_in=wait, relay_in=wait)
    assert back is not None
    assert (back.status, back.attempt, back.waiting_for, back.claim_token) == (
        "queued",
        0,
        "rate",
        None,
    )
    assert back.group_key is None  # "" in the column is no group
    # Its next delivery is early until the window comes.
    assert ledger.claims.claim(new.id, "rated", 1, 30).outcome == "early"
    assert row_count(ledger) == 1


def test_permits_unused_for_longer_than_any_window_are_pruned(ledger: Ledger) -> None:
    assert ledger.limits.take_permit("rated", "old", 2, 1.0) is None
    assert ledger.limits.take_permit("rated", "new", 2, 1.0) is None
    with ledger.engine.begin() as conn:
        conn.execute(
            update(rate_permit_table)
            .where(rate_permit_table.c.group_key == "new")
            .values(started_at=datetime.now(UTC))
        )
    # Only what is older than the age given goes: nothing used within the last minute...
    assert ledger.limits.prune_permits(older_than=60.0, limit=10) == 1  # old's unused one
    # ... and, told an age in the future, everything (in batches of `limit`).
    assert ledger.limits.prune_permits(older_than=-3600.0, limit=1) == 1
    assert ledger.limits.prune_permits(older_than=-3600.0, limit=10) == 2
    with ledger.engine.connect() as conn:
        assert conn.execute(select(rate_permit_table)).all() == []
    # A group whose permits went makes them again at its next start.
    assert ledger.limits.take_permit("rated", "old", 2, 1.0) is None


def test_a_lowered_limit_lets_waiting_runs_go_only_under_it_and_a_removed_one_lets_all_go(
    idle: IdleApp,
) -> None:
    ledger = idle.ledger
    job_name = f"lowered-{uuid.uuid4().hex[:6]}"
    group = f"g-{uuid.uuid4().hex[:6]}"
    rows = [new_dispatch(job_name, group_key=group, status="queued") for _ in range(5)]
    for new in rows:
        assert ledger.dispatches.insert(new)
    # Under the old code's limit of 3, three run and two park.
    held = [ledger.claims.claim(new.id, job_name, 1, 30, concurrency=3) for new in rows[:3]]
    assert all(claim.outcome == "claimed" for claim in held)
    for new in rows[3:]:
        assert ledger.claims.claim(new.id, job_name, 1, 30, concurrency=3).outcome == "blocked"
        assert ledger.slots.park(new.id, job_name, 1, "concurrency")
    # The new code (limit 1): two of three end, and still nothing goes.
    slots = Slots(
        ledger, idle.questpie._outbox, lambda _: Limits(concurrency=1), lambda: [job_name]
    )
    for claim in held[:2]:
        assert claim.row is not None and claim.token is not None
        assert ledger.claims.finish(claim.row.id, claim.token, "completed", None)
        slots.hand_on(claim.row)
    assert {ledger.get(new.id).status for new in rows[3:]} == {"parked"}  # type: ignore[union-attr]
    last = held[2]
    assert last.row is not None and last.token is not None
    assert ledger.claims.finish(last.row.id, last.token, "completed", None)
    slots.hand_on(last.row)
    statuses = [ledger.get(new.id).status for new in rows[3:]]  # type: ignore[union-attr]
    assert sorted(statuses) == ["parked", "queued"]  # one seat under the new limit: one goes
    # With no limit in code at all, the relay's pass lets every waiting run go.
    no_limit = Slots(ledger, idle.questpie._outbox, lambda _: NO_LIMITS, lambda: [job_name])
    assert no_limit.send_all_waiting() == 1
    assert {ledger.get(new.id).status for new in rows[3:]} == {"queued"}  # type: ignore[union-attr]


def test_a_run_awaiting_its_retry_keeps_its_seat_and_a_delayed_one_takes_none(
    ledger: Ledger,
) -> None:
    job_name = "limited"
    first, second = (new_dispatch(job_name, status="queued") for _ in range(2))
    later = new_dispatch(job_name, status="queued", run_after=datetime.now(UTC).replace(year=2100))
    for new in (first, second, later):
        assert ledger.dispatches.insert(new)
    # Not due: early, whatever the seats (it holds none and counts for nothing).
    assert ledger.claims.claim(later.id, job_name, 1, 30, concurrency=1).outcome == "early"
    claim = ledger.claims.claim(first.id, job_name, 1, 30, concurrency=1)
    assert claim.outcome == "claimed" and claim.token is not None
    assert ledger.claims.retry(first.id, claim.token, retry_in=0.0, relay_in=60.0, error="Boom")
    # Awaiting its retry, it holds the seat: another run of the group waits.
    blocked = ledger.claims.claim(second.id, job_name, 1, 30, concurrency=1)
    assert (blocked.outcome, blocked.blocked_by) == ("blocked", "concurrency")
    retried = ledger.claims.claim(first.id, job_name, 2, 30, concurrency=1)
    assert retried.outcome == "claimed" and retried.row is not None
    assert retried.row.seat == 0 and retried.row.attempt == 2
