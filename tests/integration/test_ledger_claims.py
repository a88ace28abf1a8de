"""Claims, leases and outcomes: the ledger's operations on one row as a publisher, a
worker's fence and a relay use them, on both dialects (no broker, no worker)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.options import RunOptions, StoredOptions
from questpie_celery.ledger import LEASE_EXPIRED, Ledger
from questpie_celery.ops.receipts import DispatchDetail
from tests.support.ledgers import JOB, claimed, due_now, new_row, row_of
from tests.support.waiting import wait_until


def test_insert_is_insert_or_nothing(ledger: Ledger) -> None:
    new = new_row()
    assert ledger.dispatches.insert(new) is True
    assert ledger.dispatches.insert(new) is False
    assert ledger.dispatches.insert(new_row(new.id, payload={"tag": "changed"})) is False
    row = row_of(ledger, new.id)
    assert (row.status, row.attempt, row.payload) == ("pending", 0, {"tag": "x"})
    assert (row.job_name, row.idempotency_key, row.claim_token) == (JOB, "k", None)
    assert row.options == StoredOptions(run=RunOptions(retry_limit=2))
    assert row.created_at.tzinfo is not None
    assert ledger.dispatches.exists(new.id) and not ledger.dispatches.exists(random_dispatch_id())
    assert [r.id for r in ledger.dispatches.get_many([new.id, random_dispatch_id()])] == [new.id]


def test_an_insert_made_again_counts_the_row_under_its_id_as_its_own(ledger: Ledger) -> None:
    """After a shared statement that failed, perhaps after writing the row: the row found
    under its id is this publish's (else an unkeyed policy row would be taken for a
    refusal, answered None, and run)."""
    new = new_row()
    assert ledger.dispatches.insert(new, again=True) is True  # not written before: inserted now
    assert ledger.dispatches.insert(new, again=True) is True  # written before: counted as ours
    assert ledger.dispatches.insert(new) is False
    assert ledger.dispatches.insert(new_row(), again=True) is True


def test_mark_queued_records_broker_acceptance(ledger: Ledger) -> None:
    new = new_row()
    ledger.dispatches.insert(new)
    ledger.dispatches.mark_queued([new.id], 3600)
    row = row_of(ledger, new.id)
    assert row.status == "queued"
    assert row.queued_at is not None
    # A fast worker may have claimed the row already: acceptance never undoes that.
    other, _token = claimed(ledger)
    ledger.dispatches.mark_queued([other], 3600)
    assert row_of(ledger, other).status == "active"
    assert row_of(ledger, other).queued_at is not None


def test_a_late_acceptance_mark_leaves_a_requeued_dispatch_due(ledger: Ledger) -> None:
    """The first send's mark is batched (a quarter of a second in a publisher); the run
    failed and an operator requeued it before the mark landed. The mark must not take the
    requeued row (pending again) for sent: that put its relay's send off by
    `redeliver_after`, an hour by default. (Found as a CI flake of the requeue test.)"""
    new = new_row()
    assert ledger.dispatches.insert(new)
    claim = ledger.claims.claim(new.id, JOB, 1, 60)
    assert claim.token is not None
    assert ledger.claims.finish(new.id, claim.token, "failed", "RuntimeError")
    assert ledger.views.requeue(new.id)
    due = row_of(ledger, new.id).next_send_at
    ledger.dispatches.mark_queued([new.id], 3600, accepted_ago=0.3)
    row = row_of(ledger, new.id)
    assert (row.status, row.next_send_at) == ("pending", due)


def test_an_acceptance_mark_that_lands_after_the_run_keeps_the_times_in_order(
    ledger: Ledger,
) -> None:
    """The publisher's acceptance mark is batched, off the publish path: a fast worker
    may claim and finish the dispatch before it lands. The claim records the acceptance
    (the delivery proves it), so the late mark changes nothing: never a `queued_at` after
    the run, and a completed row has nothing due."""
    new = new_row()
    assert ledger.dispatches.insert(new)
    claim = ledger.claims.claim(new.id, JOB, 1, 60)
    assert claim.token is not None
    assert ledger.claims.finish(new.id, claim.token, "completed", None)
    ledger.dispatches.mark_queued([new.id], 3600, accepted_ago=0.01)
    row = row_of(ledger, new.id)
    assert row.queued_at is not None and row.started_at is not None
    assert row.finished_at is not None
    assert row.created_at <= row.queued_at <= row.started_at <= row.finished_at
    assert row.next_send_at is None
    shown = DispatchDetail.of(row)
    assert (shown.next_send_at, shown.send_count) == (None, None)
    # A mark that lands first dates the acceptance from the publisher's measure of it:
    # when the broker took the message, not when the batch was written.
    waiting = new_row()
    assert ledger.dispatches.insert(waiting)
    # Past the 0.2 s the mark dates back, or it would date from the row's creation, in
    # the same millisecond as `before` on a fast machine.
    created = row_of(ledger, waiting.id).created_at
    wait_until(
        lambda: ledger.now() > created + timedelta(seconds=0.2),
        "the database's clock to pass 0.2 s after the row's creation",
    )
    before = ledger.now()
    ledger.dispatches.mark_queued([waiting.id], 3600, accepted_ago=0.2)
    marked = row_of(ledger, waiting.id)
    assert marked.queued_at is not None
    assert marked.created_at <= marked.queued_at < before
    assert DispatchDetail.of(marked).send_count == 0


def test_claim_fences_every_kind_of_duplicate(ledger: Ledger) -> None:
    new = new_row()
    ledger.dispatches.insert(new)
    assert ledger.claims.claim(random_dispatch_id(), JOB, 1, 60).outcome == "unknown"
    first = ledger.claims.claim(new.id, JOB, 1, 60)
    assert first.outcome == "claimed"
    assert first.row is not None and first.row.attempt == 1 and first.token
    assert first.row.claim_token == first.token
    # A second delivery of the same attempt meets a live claim.
    assert ledger.claims.claim(new.id, JOB, 1, 60).outcome == "busy"
    # A delivery meant for an attempt the row has not reached is not claimable either.
    assert ledger.claims.claim(new.id, JOB, 3, 60).outcome == "stale"
    assert ledger.claims.finish(new.id, first.token, "completed", None) is True
    assert ledger.claims.claim(new.id, JOB, 1, 60).outcome == "done"
    assert ledger.claims.claim(new.id, JOB, 2, 60).outcome == "done"


def test_a_delivery_that_ended_unrun_moves_only_a_row_still_waiting_for_its_claim(
    ledger: Ledger,
) -> None:
    waiting = new_row(status="queued", send_in=3600)
    assert ledger.dispatches.insert(waiting)
    far_off = row_of(ledger, waiting.id).next_send_at
    # Another job's delivery, or one for an attempt the row is not at, moves nothing.
    assert ledger.claims.send_unclaimed_now(waiting.id, "some-other-job", 1, horizon=60) is False
    assert ledger.claims.send_unclaimed_now(waiting.id, JOB, 2, horizon=60) is False
    assert ledger.claims.end_unclaimed(waiting.id, JOB, 2, "Revoked") is None
    assert row_of(ledger, waiting.id).next_send_at == far_off
    # Its own delivery makes it due now, for the relay.
    assert ledger.claims.send_unclaimed_now(waiting.id, JOB, 1, horizon=60) is True
    now = row_of(ledger, waiting.id)
    assert now.status == "queued" and now.next_send_at is not None
    assert far_off is not None and now.next_send_at < far_off
    # A row that was claimed is the lease's business: neither moves it.
    claimed_id, token = claimed(ledger)
    assert ledger.claims.send_unclaimed_now(claimed_id, JOB, 1, horizon=60) is False
    assert ledger.claims.end_unclaimed(claimed_id, JOB, 1, "Revoked") is None
    assert row_of(ledger, claimed_id).claim_token == token
    # A revoked one ends failed, its error saying why.
    ended = ledger.claims.end_unclaimed(waiting.id, JOB, 1, "Revoked")
    assert ended is not None and (ended.status, ended.last_error) == ("failed", "Revoked")
    assert ended.finished_at is not None and ended.attempt == 0


def test_a_lost_early_copy_leaves_a_far_off_row_to_its_own_next_send(ledger: Ledger) -> None:
    """The delivery that ended unrun was an early copy of a row that starts in an hour:
    making it due now would have the relay hand the broker an hour-long ETA."""
    start = ledger.now() + timedelta(hours=1)
    later = new_row(status="queued", run_after=start, next_send_at=start - timedelta(minutes=1))
    assert ledger.dispatches.insert(later)
    before = row_of(ledger, later.id).next_send_at
    assert ledger.claims.send_unclaimed_now(later.id, JOB, 1, horizon=60) is True
    assert row_of(ledger, later.id).next_send_at == before
    # Within the horizon, it is due now.
    soon = new_row(status="queued", run_after=ledger.now() + timedelta(seconds=30), send_in=3600)
    assert ledger.dispatches.insert(soon)
    far_off = row_of(ledger, soon.id).next_send_at
    assert ledger.claims.send_unclaimed_now(soon.id, JOB, 1, horizon=60) is True
    moved = row_of(ledger, soon.id).next_send_at
    assert far_off is not None and moved is not None and moved < far_off


def test_a_claim_naming_another_job_is_unknown_and_touches_nothing(ledger: Ledger) -> None:
    new = new_row()
    ledger.dispatches.insert(new)
    before = row_of(ledger, new.id)
    claim = ledger.claims.claim(new.id, "some-other-job", 1, 60)
    assert (claim.outcome, claim.row, claim.token) == ("unknown", None, None)
    assert row_of(ledger, new.id) == before
    # The right job still claims it, as attempt 1.
    right = ledger.claims.claim(new.id, JOB, 1, 60)
    assert right.outcome == "claimed" and right.row is not None and right.row.attempt == 1
    # ... and on an active row, another job's claim is still unknown (not busy).
    active = row_of(ledger, new.id)
    assert ledger.claims.claim(new.id, "some-other-job", 1, 60).outcome == "unknown"
    assert row_of(ledger, new.id) == active


def test_only_the_token_holder_records_outcomes(ledger: Ledger) -> None:
    dispatch_id, token = claimed(ledger)
    assert ledger.claims.finish(dispatch_id, "not-the-token", "completed", None) is False
    assert ledger.claims.finish(dispatch_id, "not-the-token", "failed", "X") is False
    assert (
        ledger.claims.retry(dispatch_id, "not-the-token", retry_in=1, relay_in=2, error="X")
        is False
    )
    assert ledger.claims.renew(dispatch_id, "not-the-token", 60) is False
    assert row_of(ledger, dispatch_id).status == "active"
    assert ledger.claims.renew(dispatch_id, token, 60) is True
    assert ledger.claims.finish(dispatch_id, token, "failed", "RuntimeError") is True
    row = row_of(ledger, dispatch_id)
    assert (row.status, row.last_error) == ("failed", "RuntimeError")
    assert row.finished_at is not None and row.lease_expires_at is None
    # The token stays on the row, so a holder can read back whether its write landed ...
    assert row.claim_token == token
    # ... but a finished row can no longer be changed with it.
    assert ledger.claims.finish(dispatch_id, token, "completed", None) is False
    assert ledger.claims.renew(dispatch_id, token, 60) is False
    assert ledger.claims.retry(dispatch_id, token, retry_in=1, relay_in=2, error="X") is False
    assert row_of(ledger, dispatch_id).status == "failed"


def test_finish_twice_reads_back_whether_our_write_landed(ledger: Ledger) -> None:
    dispatch_id, token = claimed(ledger)
    assert ledger.claims.finish(dispatch_id, token, "completed", None) is True
    finished = row_of(ledger, dispatch_id)
    # Run again (as after a dropped connection): the row carries our token in `completed`.
    assert ledger.claims.finish(dispatch_id, token, "completed", None) is True
    # Another token, or another outcome, did not land.
    assert ledger.claims.finish(dispatch_id, "another-token", "completed", None) is False
    assert ledger.claims.finish(dispatch_id, token, "failed", "X") is False
    assert row_of(ledger, dispatch_id) == finished


def test_retry_twice_reads_back_too(ledger: Ledger) -> None:
    dispatch_id, token = claimed(ledger)
    assert ledger.claims.retry(dispatch_id, token, retry_in=5, relay_in=10, error="E") is True
    assert ledger.claims.retry(dispatch_id, token, retry_in=5, relay_in=10, error="E") is True
    assert ledger.claims.retry(dispatch_id, "another", retry_in=5, relay_in=10, error="E") is False


def test_retry_releases_the_claim_and_moves_the_attempt_on(ledger: Ledger) -> None:
    dispatch_id, first = claimed(ledger)
    assert (
        ledger.claims.retry(dispatch_id, first, retry_in=5, relay_in=10, error="RuntimeError")
        is True
    )
    row = row_of(ledger, dispatch_id)
    assert (row.status, row.attempt, row.last_error) == ("retry", 1, "RuntimeError")
    assert row.lease_expires_at is None
    assert row.run_after > datetime.now(UTC)
    assert row.next_send_at is not None and row.next_send_at > row.run_after
    # The old delivery (attempt 1) is stale now; the retry's delivery claims attempt 2,
    # once it is due.
    assert ledger.claims.claim(dispatch_id, JOB, 1, 60).outcome == "stale"
    assert ledger.claims.claim(dispatch_id, JOB, 2, 60).outcome == "early"
    due_now(ledger, dispatch_id)
    second = ledger.claims.claim(dispatch_id, JOB, 2, 60)
    assert second.outcome == "claimed"
    assert second.row is not None and second.row.attempt == 2
    assert second.token is not None and second.token != first
    # The first worker's token is dead.
    assert ledger.claims.finish(dispatch_id, first, "completed", None) is False
    assert ledger.claims.renew(dispatch_id, first, 60) is False
    assert ledger.claims.finish(dispatch_id, second.token, "completed", None) is True


def test_lease_expiry_is_visible_and_ends_the_claim(ledger: Ledger) -> None:
    dispatch_id, token = claimed(ledger, lease=0.2)
    # Polled: the expiry is a persistent fact once reached.
    [expired] = wait_until(
        lambda: [r for r in ledger.claims.expired() if r.id == dispatch_id], "the lease to lapse"
    )
    assert expired.lease_expires_at is not None
    assert expired.lease_expires_at < datetime.now(UTC)
    assert ledger.claims.lapse(expired, retry_in=None, relay_in=0) is True
    row = row_of(ledger, dispatch_id)
    assert (row.status, row.last_error, row.claim_token) == ("failed", LEASE_EXPIRED, None)
    # The relay cleared the token: the late holder's write, read back, did not land.
    assert ledger.claims.finish(dispatch_id, token, "completed", None) is False
    assert ledger.claims.lapse(expired, retry_in=None, relay_in=0) is False  # once only


# --- never before the row is due ----------------------------------------------------------


def test_a_claim_before_the_row_is_due_is_early_and_touches_nothing(ledger: Ledger) -> None:
    start = ledger.now() + timedelta(seconds=600)
    new = new_row(run_after=start, next_send_at=start - timedelta(seconds=60))
    assert ledger.dispatches.insert(new)
    before = row_of(ledger, new.id)
    early = ledger.claims.claim(new.id, JOB, 1, 60)
    assert early.outcome == "early" and early.token is None
    assert 590 < early.due_in <= 600
    assert row_of(ledger, new.id) == before
    # Its relay time already comes before its start: nothing to change.
    assert ledger.claims.send_when_due(new.id, JOB, 1) is False
    assert row_of(ledger, new.id) == before
    # Other reasons come first: another job's id is unknown, another attempt stale.
    assert ledger.claims.claim(new.id, "other-job", 1, 60).outcome == "unknown"
    assert ledger.claims.claim(new.id, JOB, 2, 60).outcome == "stale"
    # Eager mode runs it at once, as Celery's eager mode does.
    assert ledger.claims.claim(new.id, JOB, 1, 60, any_time=True).outcome == "claimed"


@pytest.mark.parametrize("concurrency", [None, 2], ids=["unlimited", "seated"])
def test_a_row_due_between_the_claim_and_its_read_back_is_claimed(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, concurrency: int | None
) -> None:
    """A delivery a hair early (a debounced burst's message: its countdown is the
    publisher's, its start the database's) finds the row not due; by the read that says
    why, it is. That is neither stale (dropped, the row left to the relay for an hour)
    nor, with a concurrency limit and every seat free, blocked: the claim goes again."""
    start = ledger.now() + timedelta(seconds=0.3)
    new = new_row(run_after=start)
    assert ledger.dispatches.insert(new)
    read_back = ledger.claims._sql.get_and_now
    first = ledger._first

    def slow_read_back(stmt: Any, params: Any) -> Any:
        if stmt is read_back:
            # The scenario: a read-back slow enough (0.5 s) that the row, due 0.3 s after
            # its insert, comes due between the claim and this read.
            time.sleep(0.5)
        return first(stmt, params)

    monkeypatch.setattr(ledger, "_first", slow_read_back)
    claim = ledger.claims.claim(new.id, JOB, 1, 60, concurrency=concurrency)
    assert claim.outcome == "claimed"
    row = row_of(ledger, new.id)
    assert (row.status, row.attempt) == ("active", 1)
    assert (row.seat is not None) == (concurrency is not None)


def test_an_early_delivery_of_a_retry_makes_the_relay_send_it_when_due(ledger: Ledger) -> None:
    dispatch_id, token = claimed(ledger)
    # A retry sent at once with its countdown: the relay looks only long after it is due.
    assert ledger.claims.retry(dispatch_id, token, retry_in=600, relay_in=600 + 3600, error="E")
    waiting = row_of(ledger, dispatch_id)
    assert waiting.next_send_at is not None and waiting.next_send_at > waiting.run_after
    early = ledger.claims.claim(dispatch_id, JOB, 2, 60)
    assert early.outcome == "early" and 590 < early.due_in <= 600
    assert ledger.claims.send_when_due(dispatch_id, JOB, 2) is True
    row = row_of(ledger, dispatch_id)
    assert row.next_send_at == row.run_after  # due for the relay at its start, no later
    assert (row.status, row.attempt, row.claim_token) == ("retry", 1, token)
    assert ledger.claims.send_when_due(dispatch_id, JOB, 3) is False  # not the attempt it waits for
    due_now(ledger, dispatch_id)  # once due, the delivery claims
    assert ledger.claims.claim(dispatch_id, JOB, 2, 60).outcome == "claimed"


def test_the_acceptance_mark_after_a_dropped_early_delivery_keeps_it_due_at_start(
    ledger: Ledger,
) -> None:
    """The publisher's acceptance mark is batched: it may come after a worker dropped an
    early delivery (maybe the very message accepted) and made the row due at its start."""
    start = ledger.now() + timedelta(seconds=20)
    dropped, untouched = new_row(run_after=start, send_in=30), new_row(run_after=start, send_in=30)
    assert ledger.dispatches.insert(dropped) and ledger.dispatches.insert(untouched)
    assert ledger.claims.claim(dropped.id, JOB, 1, 60).outcome == "early"
    assert ledger.claims.send_when_due(dropped.id, JOB, 1) is True
    ledger.dispatches.mark_queued([dropped.id, untouched.id], redeliver_in=3600)
    row = row_of(ledger, dropped.id)
    assert (row.status, row.next_send_at) == ("queued", row.run_after)
    other = row_of(ledger, untouched.id)
    assert other.status == "queued" and other.next_send_at is not None
    assert other.next_send_at > other.run_after + timedelta(seconds=3000)
