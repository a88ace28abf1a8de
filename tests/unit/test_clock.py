"""Ledger times come from the database's clock, in the statement that writes them.

On SQLite the database clock is this machine's, so each time is checked against the
database's `now` read just before and just after the statement, and against this
process's clock with a tolerance. Offsets (lease, retry_in, relay_in) are added in
the same statement, so their differences are exact to the millisecond SQLite keeps,
and a time with microseconds could not have come from SQLite's clock at all.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from questpie_celery.ledger import Ledger
from tests.unit.helpers import new_dispatch, sqlite_now

TICK = timedelta(milliseconds=2)  # SQLite keeps milliseconds; allow rounding
HOST_SKEW = timedelta(seconds=2)


def _between(value: datetime | None, low: datetime, high: datetime) -> None:
    assert value is not None
    assert value.tzinfo is not None
    assert low - TICK <= value <= high + TICK, (low, value, high)
    # SQLite's clock has milliseconds; a time taken from this process's clock would
    # carry microseconds (999 times in 1000).
    assert value.microsecond % 1000 == 0, value


@pytest.mark.parametrize("lease", [60.0, 0.25, 3600.0])
def test_claim_times_are_now_and_now_plus_the_lease(ledger: Ledger, lease: float) -> None:
    new = new_dispatch()
    assert ledger.dispatches.insert(new) is True
    before = sqlite_now(ledger)
    claim = ledger.claims.claim(new.id, new.job_name, 1, lease)
    after = sqlite_now(ledger)
    assert claim.outcome == "claimed" and claim.row is not None
    row = claim.row
    _between(row.started_at, before, after)
    assert row.started_at is not None and row.lease_expires_at is not None
    assert abs(row.lease_expires_at - (row.started_at + timedelta(seconds=lease))) <= TICK
    assert abs(row.started_at - datetime.now(UTC)) < HOST_SKEW
    # What was returned is what was stored.
    stored = ledger.get(new.id)
    assert stored is not None
    assert (stored.started_at, stored.lease_expires_at) == (row.started_at, row.lease_expires_at)


def test_renew_moves_the_lease_to_now_plus_the_lease(ledger: Ledger) -> None:
    new = new_dispatch()
    ledger.dispatches.insert(new)
    claim = ledger.claims.claim(new.id, new.job_name, 1, 0.5)
    assert claim.token is not None
    before = sqlite_now(ledger)
    assert ledger.claims.renew(new.id, claim.token, 120.0) is True
    after = sqlite_now(ledger)
    row = ledger.get(new.id)
    assert row is not None
    _between(row.lease_expires_at, before + timedelta(seconds=120), after + timedelta(seconds=120))


@pytest.mark.parametrize(("retry_in", "relay_in"), [(5.0, 3605.0), (0.0, 0.5), (7200.0, 7140.0)])
def test_retry_sets_run_after_to_now_plus_retry_in(
    ledger: Ledger, retry_in: float, relay_in: float
) -> None:
    new = new_dispatch()
    ledger.dispatches.insert(new)
    claim = ledger.claims.claim(new.id, new.job_name, 1, 60)
    assert claim.token is not None
    before = sqlite_now(ledger)
    assert ledger.claims.retry(new.id, claim.token, retry_in=retry_in, relay_in=relay_in, error="E")
    after = sqlite_now(ledger)
    row = ledger.get(new.id)
    assert row is not None
    assert row.status == "retry"
    retry_delta, relay_delta = timedelta(seconds=retry_in), timedelta(seconds=relay_in)
    _between(row.run_after, before + retry_delta, after + retry_delta)
    _between(row.next_send_at, before + relay_delta, after + relay_delta)
    assert row.next_send_at is not None
    # One statement, one instant: the two offsets differ by exactly their difference.
    assert abs((row.next_send_at - row.run_after) - (relay_delta - retry_delta)) <= TICK
    assert abs(row.run_after - (datetime.now(UTC) + retry_delta)) < HOST_SKEW
    assert row.lease_expires_at is None


def test_insert_times_are_the_databases_now(ledger: Ledger) -> None:
    new = new_dispatch(send_in=30.0)
    before = sqlite_now(ledger)
    assert ledger.dispatches.insert(new) is True
    after = sqlite_now(ledger)
    row = ledger.get(new.id)
    assert row is not None
    _between(row.created_at, before, after)
    assert row.run_after == row.created_at  # no start_after: due at once
    assert row.next_send_at is not None
    assert abs(row.next_send_at - (row.created_at + timedelta(seconds=30))) <= TICK
    assert row.queued_at is None and row.started_at is None


def test_given_absolute_times_are_kept(ledger: Ledger) -> None:
    at = datetime(2031, 5, 6, 7, 8, 9, 123000, tzinfo=UTC)
    new = new_dispatch(run_after=at, next_send_at=at - timedelta(minutes=1))
    ledger.dispatches.insert(new)
    row = ledger.get(new.id)
    assert row is not None
    assert (row.run_after, row.next_send_at) == (at, at - timedelta(minutes=1))


def test_mark_queued_sets_queued_at_now_and_redelivery_from_now(ledger: Ledger) -> None:
    new = new_dispatch()
    ledger.dispatches.insert(new)
    before = sqlite_now(ledger)
    ledger.dispatches.mark_queued([new.id], 900.0)
    after = sqlite_now(ledger)
    row = ledger.get(new.id)
    assert row is not None
    assert row.status == "queued"
    _between(row.queued_at, before, after)
    _between(row.next_send_at, before + timedelta(seconds=900), after + timedelta(seconds=900))


def test_finish_sets_finished_at_now(ledger: Ledger) -> None:
    new = new_dispatch()
    ledger.dispatches.insert(new)
    claim = ledger.claims.claim(new.id, new.job_name, 1, 60)
    assert claim.token is not None
    before = sqlite_now(ledger)
    assert ledger.claims.finish(new.id, claim.token, "completed", None) is True
    after = sqlite_now(ledger)
    row = ledger.get(new.id)
    assert row is not None
    _between(row.finished_at, before, after)
    assert row.lease_expires_at is None
