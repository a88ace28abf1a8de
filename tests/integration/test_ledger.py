"""The ledger's operations on both dialects, against real databases (no broker, no worker)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import (
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)

from questpie_celery import LedgerBusyError, LedgerSchemaError, LedgerUnavailableError, metadata
from questpie_celery.jobs.ids import MAX_DISPATCH_ID_BYTES, random_dispatch_id, unstorable_id
from questpie_celery.jobs.options import RunOptions, StoredOptions
from questpie_celery.jobs.policies import QueuePolicy
from questpie_celery.ledger import (
    LEASE_EXPIRED,
    SCHEMA_VERSION,
    DispatchRow,
    Ledger,
    NewDispatch,
    dispatch_table,
    open_ledger,
)
from questpie_celery.ledger.aio import AsyncLedger
from questpie_celery.ledger.direct import DriverStatement
from questpie_celery.ledger.hot import HotConnection
from questpie_celery.ledger.schema import TERMINAL, UTCDateTime, schema_version_table
from questpie_celery.ledger.statements import RELAY_WAKE_CHANNEL, by_id, db_time
from questpie_celery.ops.receipts import DispatchDetail
from tests.support.services import PostgresServer, free_port
from tests.support.tracing import at_line
from tests.support.waiting import wait_until

JOB = "record"


def _new(dispatch_id: str | None = None, **fields: Any) -> NewDispatch:
    values: dict[str, Any] = {
        "id": dispatch_id or random_dispatch_id(),
        "job_name": JOB,
        "idempotency_key": "k",
        "payload": {"tag": "x"},
        "options": StoredOptions(run=RunOptions(retry_limit=2)),
    }
    values.update(fields)
    return NewDispatch(**values)


def _row(ledger: Ledger, dispatch_id: str) -> DispatchRow:
    row = ledger.get(dispatch_id)
    assert row is not None
    return row


def _due_now(ledger: Ledger, dispatch_id: str) -> None:
    """Let the row's `run_after` come (a second ago, by the database's clock)."""
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(run_after=db_time(-1))
        )


def _claimed(ledger: Ledger, lease: float = 60) -> tuple[str, str]:
    new = _new()
    assert ledger.insert(new) is True
    claim = ledger.claim(new.id, JOB, 1, lease)
    assert claim.outcome == "claimed" and claim.token is not None
    return new.id, claim.token


def test_insert_is_insert_or_nothing(ledger: Ledger) -> None:
    new = _new()
    assert ledger.insert(new) is True
    assert ledger.insert(new) is False
    assert ledger.insert(_new(new.id, payload={"tag": "changed"})) is False
    row = _row(ledger, new.id)
    assert (row.status, row.attempt, row.payload) == ("pending", 0, {"tag": "x"})
    assert (row.job_name, row.idempotency_key, row.claim_token) == (JOB, "k", None)
    assert row.options == StoredOptions(run=RunOptions(retry_limit=2))
    assert row.created_at.tzinfo is not None
    assert ledger.exists(new.id) and not ledger.exists(random_dispatch_id())
    assert [r.id for r in ledger.get_many([new.id, random_dispatch_id()])] == [new.id]


def test_an_insert_made_again_counts_the_row_under_its_id_as_its_own(ledger: Ledger) -> None:
    """After a shared statement that failed, perhaps after writing the row: the row found
    under its id is this publish's (else an unkeyed policy row would be taken for a
    refusal, answered None, and run)."""
    new = _new()
    assert ledger.insert(new, again=True) is True  # not written before: inserted now
    assert ledger.insert(new, again=True) is True  # written before: counted as ours
    assert ledger.insert(new) is False
    assert ledger.insert(_new(), again=True) is True


def test_mark_queued_records_broker_acceptance(ledger: Ledger) -> None:
    new = _new()
    ledger.insert(new)
    ledger.mark_queued([new.id], 3600)
    row = _row(ledger, new.id)
    assert row.status == "queued"
    assert row.queued_at is not None
    # A fast worker may have claimed the row already: acceptance never undoes that.
    other, _token = _claimed(ledger)
    ledger.mark_queued([other], 3600)
    assert _row(ledger, other).status == "active"
    assert _row(ledger, other).queued_at is not None


def test_an_acceptance_mark_that_lands_after_the_run_keeps_the_times_in_order(
    ledger: Ledger,
) -> None:
    """The publisher's acceptance mark is batched, off the publish path: a fast worker
    may claim and finish the dispatch before it lands. The claim records the acceptance
    (the delivery proves it), so the late mark changes nothing: never a `queued_at` after
    the run, and a completed row has nothing due."""
    new = _new()
    assert ledger.insert(new)
    claim = ledger.claim(new.id, JOB, 1, 60)
    assert claim.token is not None
    assert ledger.finish(new.id, claim.token, "completed", None)
    ledger.mark_queued([new.id], 3600, accepted_ago=0.01)
    row = _row(ledger, new.id)
    assert row.queued_at is not None and row.started_at is not None
    assert row.finished_at is not None
    assert row.created_at <= row.queued_at <= row.started_at <= row.finished_at
    assert row.next_send_at is None
    shown = DispatchDetail.of(row)
    assert (shown.next_send_at, shown.send_count) == (None, None)
    # A mark that lands first dates the acceptance from the publisher's measure of it:
    # when the broker took the message, not when the batch was written.
    waiting = _new()
    assert ledger.insert(waiting)
    # Past the 0.2 s the mark dates back, or it would date from the row's creation, in
    # the same millisecond as `before` on a fast machine.
    created = _row(ledger, waiting.id).created_at
    wait_until(
        lambda: ledger.now() > created + timedelta(seconds=0.2),
        "the database's clock to pass 0.2 s after the row's creation",
    )
    before = ledger.now()
    ledger.mark_queued([waiting.id], 3600, accepted_ago=0.2)
    marked = _row(ledger, waiting.id)
    assert marked.queued_at is not None
    assert marked.created_at <= marked.queued_at < before
    assert DispatchDetail.of(marked).send_count == 0


def test_every_transition_keeps_the_times_the_state_machine_promises(ledger: Ledger) -> None:
    """Random walks through the dispatch states (publish, acceptance marks early and late,
    claims, outcomes, retries, lapsed leases, parking, relay sends, give-ups, revokes,
    requeues): after every step each row's times are in order (created, then queued,
    then started, then finished) and each status shows only the times it has (see the
    table in docs/operations.md)."""
    run_state_machine_as_test(
        lambda: Transitions(ledger),
        settings=settings(
            max_examples=25,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )


def check_times(row: DispatchRow) -> None:
    """What docs/operations.md says each status shows, and the order of the times."""
    said = f"{row.status} row {row}"
    if row.queued_at is not None:
        assert row.created_at <= row.queued_at, said
    if row.started_at is not None:
        assert row.queued_at is not None and row.queued_at <= row.started_at, said
    if row.finished_at is not None:
        assert row.created_at <= row.finished_at, said
        if row.started_at is not None:
            assert row.started_at <= row.finished_at, said
    assert (row.attempt == 0) == (row.started_at is None), said
    waits_for_relay = row.status in ("pending", "queued", "retry")
    assert (row.next_send_at is not None) == waits_for_relay, said
    assert (row.lease_expires_at is not None) == (row.status == "active"), said
    assert (row.finished_at is not None) == (row.status in TERMINAL), said
    # A cancel marks only a running row, and its end is `cancelled`: nothing marked waits.
    if row.cancel_requested_at is not None:
        assert row.status in ("active", "cancelled"), said
    if row.status in ("queued", "parked", "active", "completed"):
        assert row.queued_at is not None, said
    if row.status in ("active", "retry", "completed"):
        assert row.started_at is not None, said
    shown = DispatchDetail.of(row)
    assert (shown.send_count is not None) == waits_for_relay, said


class Transitions(RuleBasedStateMachine):
    """A few dispatches of a singleton job (each its own slot, so it can park), moved
    through the ledger's operations as workers, publishers, relays and cancels would."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__()
        self.ledger = ledger
        self.ids: list[str] = []
        self.tokens: dict[str, str] = {}
        #: Cancelled before they started: the attempt each had then, for good.
        self.cancelled_unstarted: dict[str, int] = {}

    def _pick(self, index: int) -> DispatchRow | None:
        if not self.ids:
            return None
        return _row(self.ledger, self.ids[index % len(self.ids)])

    @rule(taken_in=st.booleans())
    def publish(self, taken_in: bool) -> None:
        if len(self.ids) >= 3:
            return
        # A publish writes `pending`; a worker taking a plain call in writes `queued`.
        new = _new(
            idempotency_key=None,
            status="queued" if taken_in else "pending",
            policy=QueuePolicy.SINGLETON,
            singleton_key=random_dispatch_id(),
        )
        assert self.ledger.insert(new)
        self.ids.append(new.id)

    @rule(index=st.integers(0, 2), ago=st.floats(0, 0.5))
    def acceptance_mark(self, index: int, ago: float) -> None:
        row = self._pick(index)
        if row is not None:  # early or late, on any row: the publisher's batch
            self.ledger.mark_queued([row.id], 3600, accepted_ago=ago)

    @rule(index=st.integers(0, 2), lease=st.sampled_from([60.0, -1.0]))
    def claim(self, index: int, lease: float) -> None:
        row = self._pick(index)
        if row is not None and row.status in ("pending", "queued", "retry"):
            claim = self.ledger.claim(row.id, JOB, row.attempt + 1, lease)
            if claim.token is not None:
                self.tokens[row.id] = claim.token

    @rule(index=st.integers(0, 2), outcome=st.sampled_from(["completed", "failed", "retry"]))
    def end_attempt(self, index: int, outcome: str) -> None:
        row = self._pick(index)
        if row is None or row.status != "active":
            return
        token = self.tokens[row.id]
        if outcome == "retry":
            self.ledger.retry(row.id, token, retry_in=0, relay_in=0, error="E")
        else:
            self.ledger.finish(row.id, token, outcome, "E" if outcome == "failed" else None)  # type: ignore[arg-type]

    @rule(index=st.integers(0, 2), again=st.booleans())
    def lease_lapses(self, index: int, again: bool) -> None:
        row = self._pick(index)
        if row is not None and row in self.ledger.expired_claims():
            self.ledger.lapse(row, retry_in=0 if again else None, relay_in=0)

    @rule(index=st.integers(0, 2))
    def park_and_unpark(self, index: int) -> None:
        row = self._pick(index)
        if row is None:
            return
        if row.status == "parked" and row.slot is not None:
            self.ledger.unpark_next(JOB, row.slot, 3600)
        elif row.status in ("pending", "queued", "retry"):
            self.ledger.park(row.id, JOB, row.attempt + 1)

    @rule()
    def relay_sends(self) -> None:
        self.ledger.take_due(50, max_sends=25, first_backoff=0, max_backoff=0, accepted_backoff=0)

    @rule(index=st.integers(0, 2), how=st.sampled_from(["give up", "revoke", "lost"]))
    def unrun(self, index: int, how: str) -> None:
        row = self._pick(index)
        if row is None or row.status not in ("pending", "queued", "retry"):
            return
        if how == "give up":
            self.ledger.give_up(row)
        elif how == "revoke":
            self.ledger.end_unclaimed(row.id, JOB, row.attempt + 1, "Revoked")
        else:
            self.ledger.send_unclaimed_now(row.id, JOB, row.attempt + 1, horizon=60)

    @rule(index=st.integers(0, 2))
    def requeue(self, index: int) -> None:
        row = self._pick(index)
        if row is not None and row.status == "failed":
            self.ledger.requeue(row.id)

    @rule(index=st.integers(0, 2))
    def cancel(self, index: int) -> None:
        row = self._pick(index)
        if row is None:
            return
        done = self.ledger.cancel(row.id)
        if done.outcome == "cancelled":
            assert done.row is not None
            self.cancelled_unstarted[row.id] = done.row.attempt

    @rule(index=st.integers(0, 2), how=st.sampled_from(["rate set-back", "end unrun"]))
    def claimed_but_not_run(self, index: int, how: str) -> None:
        """A claimed run that does not start: set back for its rate window, or found
        cancelled before its handler began."""
        row = self._pick(index)
        if row is None or row.status != "active":
            return
        token = self.tokens[row.id]
        if how == "rate set-back":
            self.ledger.wait_for_rate(row.id, token, retry_in=0, relay_in=0)
            return
        ended = self.ledger.end_unrun(row.id, token)
        assert (ended is not None) == (row.cancel_requested_at is not None)
        if ended is not None:
            assert ended.status == "cancelled" and ended.attempt == row.attempt - 1
            assert ended.last_error == row.last_error

    @invariant()
    def times_are_honest(self) -> None:
        for dispatch_id in self.ids:
            check_times(_row(self.ledger, dispatch_id))

    @invariant()
    def cancels_hold(self) -> None:
        for dispatch_id, attempt in self.cancelled_unstarted.items():
            row = _row(self.ledger, dispatch_id)
            assert (row.status, row.attempt) == ("cancelled", attempt), row


def test_claim_fences_every_kind_of_duplicate(ledger: Ledger) -> None:
    new = _new()
    ledger.insert(new)
    assert ledger.claim(random_dispatch_id(), JOB, 1, 60).outcome == "unknown"
    first = ledger.claim(new.id, JOB, 1, 60)
    assert first.outcome == "claimed"
    assert first.row is not None and first.row.attempt == 1 and first.token
    assert first.row.claim_token == first.token
    # A second delivery of the same attempt meets a live claim.
    assert ledger.claim(new.id, JOB, 1, 60).outcome == "busy"
    # A delivery meant for an attempt the row has not reached is not claimable either.
    assert ledger.claim(new.id, JOB, 3, 60).outcome == "stale"
    assert ledger.finish(new.id, first.token, "completed", None) is True
    assert ledger.claim(new.id, JOB, 1, 60).outcome == "done"
    assert ledger.claim(new.id, JOB, 2, 60).outcome == "done"


def test_a_delivery_that_ended_unrun_moves_only_a_row_still_waiting_for_its_claim(
    ledger: Ledger,
) -> None:
    waiting = _new(status="queued", send_in=3600)
    assert ledger.insert(waiting)
    far_off = _row(ledger, waiting.id).next_send_at
    # Another job's delivery, or one for an attempt the row is not at, moves nothing.
    assert ledger.send_unclaimed_now(waiting.id, "some-other-job", 1, horizon=60) is False
    assert ledger.send_unclaimed_now(waiting.id, JOB, 2, horizon=60) is False
    assert ledger.end_unclaimed(waiting.id, JOB, 2, "Revoked") is None
    assert _row(ledger, waiting.id).next_send_at == far_off
    # Its own delivery makes it due now, for the relay.
    assert ledger.send_unclaimed_now(waiting.id, JOB, 1, horizon=60) is True
    now = _row(ledger, waiting.id)
    assert now.status == "queued" and now.next_send_at is not None
    assert far_off is not None and now.next_send_at < far_off
    # A row that was claimed is the lease's business: neither moves it.
    claimed_id, token = _claimed(ledger)
    assert ledger.send_unclaimed_now(claimed_id, JOB, 1, horizon=60) is False
    assert ledger.end_unclaimed(claimed_id, JOB, 1, "Revoked") is None
    assert _row(ledger, claimed_id).claim_token == token
    # A revoked one ends failed, its error saying why.
    ended = ledger.end_unclaimed(waiting.id, JOB, 1, "Revoked")
    assert ended is not None and (ended.status, ended.last_error) == ("failed", "Revoked")
    assert ended.finished_at is not None and ended.attempt == 0


def test_a_lost_early_copy_leaves_a_far_off_row_to_its_own_next_send(ledger: Ledger) -> None:
    """The delivery that ended unrun was an early copy of a row that starts in an hour:
    making it due now would have the relay hand the broker an hour-long ETA."""
    start = ledger.now() + timedelta(hours=1)
    later = _new(status="queued", run_after=start, next_send_at=start - timedelta(minutes=1))
    assert ledger.insert(later)
    before = _row(ledger, later.id).next_send_at
    assert ledger.send_unclaimed_now(later.id, JOB, 1, horizon=60) is True
    assert _row(ledger, later.id).next_send_at == before
    # Within the horizon, it is due now.
    soon = _new(status="queued", run_after=ledger.now() + timedelta(seconds=30), send_in=3600)
    assert ledger.insert(soon)
    far_off = _row(ledger, soon.id).next_send_at
    assert ledger.send_unclaimed_now(soon.id, JOB, 1, horizon=60) is True
    moved = _row(ledger, soon.id).next_send_at
    assert far_off is not None and moved is not None and moved < far_off


def test_a_claim_naming_another_job_is_unknown_and_touches_nothing(ledger: Ledger) -> None:
    new = _new()
    ledger.insert(new)
    before = _row(ledger, new.id)
    claim = ledger.claim(new.id, "some-other-job", 1, 60)
    assert (claim.outcome, claim.row, claim.token) == ("unknown", None, None)
    assert _row(ledger, new.id) == before
    # The right job still claims it, as attempt 1.
    right = ledger.claim(new.id, JOB, 1, 60)
    assert right.outcome == "claimed" and right.row is not None and right.row.attempt == 1
    # ... and on an active row, another job's claim is still unknown (not busy).
    active = _row(ledger, new.id)
    assert ledger.claim(new.id, "some-other-job", 1, 60).outcome == "unknown"
    assert _row(ledger, new.id) == active


def test_only_the_token_holder_records_outcomes(ledger: Ledger) -> None:
    dispatch_id, token = _claimed(ledger)
    assert ledger.finish(dispatch_id, "not-the-token", "completed", None) is False
    assert ledger.finish(dispatch_id, "not-the-token", "failed", "X") is False
    assert ledger.retry(dispatch_id, "not-the-token", retry_in=1, relay_in=2, error="X") is False
    assert ledger.renew(dispatch_id, "not-the-token", 60) is False
    assert _row(ledger, dispatch_id).status == "active"
    assert ledger.renew(dispatch_id, token, 60) is True
    assert ledger.finish(dispatch_id, token, "failed", "RuntimeError") is True
    row = _row(ledger, dispatch_id)
    assert (row.status, row.last_error) == ("failed", "RuntimeError")
    assert row.finished_at is not None and row.lease_expires_at is None
    # The token stays on the row, so a holder can read back whether its write landed ...
    assert row.claim_token == token
    # ... but a finished row can no longer be changed with it.
    assert ledger.finish(dispatch_id, token, "completed", None) is False
    assert ledger.renew(dispatch_id, token, 60) is False
    assert ledger.retry(dispatch_id, token, retry_in=1, relay_in=2, error="X") is False
    assert _row(ledger, dispatch_id).status == "failed"


def test_finish_twice_reads_back_whether_our_write_landed(ledger: Ledger) -> None:
    dispatch_id, token = _claimed(ledger)
    assert ledger.finish(dispatch_id, token, "completed", None) is True
    finished = _row(ledger, dispatch_id)
    # Run again (as after a dropped connection): the row carries our token in `completed`.
    assert ledger.finish(dispatch_id, token, "completed", None) is True
    # Another token, or another outcome, did not land.
    assert ledger.finish(dispatch_id, "another-token", "completed", None) is False
    assert ledger.finish(dispatch_id, token, "failed", "X") is False
    assert _row(ledger, dispatch_id) == finished


def test_retry_twice_reads_back_too(ledger: Ledger) -> None:
    dispatch_id, token = _claimed(ledger)
    assert ledger.retry(dispatch_id, token, retry_in=5, relay_in=10, error="E") is True
    assert ledger.retry(dispatch_id, token, retry_in=5, relay_in=10, error="E") is True
    assert ledger.retry(dispatch_id, "another", retry_in=5, relay_in=10, error="E") is False


def test_retry_releases_the_claim_and_moves_the_attempt_on(ledger: Ledger) -> None:
    dispatch_id, first = _claimed(ledger)
    assert ledger.retry(dispatch_id, first, retry_in=5, relay_in=10, error="RuntimeError") is True
    row = _row(ledger, dispatch_id)
    assert (row.status, row.attempt, row.last_error) == ("retry", 1, "RuntimeError")
    assert row.lease_expires_at is None
    assert row.run_after > datetime.now(UTC)
    assert row.next_send_at is not None and row.next_send_at > row.run_after
    # The old delivery (attempt 1) is stale now; the retry's delivery claims attempt 2,
    # once it is due.
    assert ledger.claim(dispatch_id, JOB, 1, 60).outcome == "stale"
    assert ledger.claim(dispatch_id, JOB, 2, 60).outcome == "early"
    _due_now(ledger, dispatch_id)
    second = ledger.claim(dispatch_id, JOB, 2, 60)
    assert second.outcome == "claimed"
    assert second.row is not None and second.row.attempt == 2
    assert second.token is not None and second.token != first
    # The first worker's token is dead.
    assert ledger.finish(dispatch_id, first, "completed", None) is False
    assert ledger.renew(dispatch_id, first, 60) is False
    assert ledger.finish(dispatch_id, second.token, "completed", None) is True


def test_lease_expiry_is_visible_and_ends_the_claim(ledger: Ledger) -> None:
    dispatch_id, token = _claimed(ledger, lease=0.2)
    # Polled: the expiry is a persistent fact once reached.
    [expired] = wait_until(
        lambda: [r for r in ledger.expired_claims() if r.id == dispatch_id], "the lease to lapse"
    )
    assert expired.lease_expires_at is not None
    assert expired.lease_expires_at < datetime.now(UTC)
    assert ledger.lapse(expired, retry_in=None, relay_in=0) is True
    row = _row(ledger, dispatch_id)
    assert (row.status, row.last_error, row.claim_token) == ("failed", LEASE_EXPIRED, None)
    # The relay cleared the token: the late holder's write, read back, did not land.
    assert ledger.finish(dispatch_id, token, "completed", None) is False
    assert ledger.lapse(expired, retry_in=None, relay_in=0) is False  # once only


def test_migrate_is_idempotent_and_matches_metadata(ledger: Ledger) -> None:
    first_id = ledger.ledger_id()
    assert ledger.migrate() == SCHEMA_VERSION
    assert ledger.migrate() == SCHEMA_VERSION
    assert ledger.schema_version() == SCHEMA_VERSION
    tables = set(inspect(ledger.engine).get_table_names())
    assert set(metadata.tables) <= tables
    # One identity for the database, whoever asks, however often it is migrated.
    again = Ledger(ledger.engine)
    assert again.ledger_id() == first_id
    fresh = open_ledger(ledger.engine.url.render_as_string(hide_password=False))
    try:
        assert fresh.migrate() == SCHEMA_VERSION
        assert fresh.ledger_id() == first_id
    finally:
        fresh.close()
    with ledger.engine.connect() as conn:
        assert ledger.ledger_id(conn) == first_id


def empty_database(request: pytest.FixtureRequest, tmp_path: Path, dialect: str) -> str:
    """The URL of a fresh database of the test's own, with no tables, on `dialect`."""
    if dialect == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    url: str = request.getfixturevalue("pg_db")
    return url


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_missing_tables_give_a_schema_error(
    request: pytest.FixtureRequest, tmp_path: Path, dialect: str
) -> None:
    ledger = open_ledger(empty_database(request, tmp_path, dialect))
    try:
        with pytest.raises(LedgerSchemaError, match="migrate"):
            ledger.insert(_new())
        with pytest.raises(LedgerSchemaError):
            ledger.ledger_id()
    finally:
        ledger.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_missing_column_gives_a_schema_error(
    request: pytest.FixtureRequest, tmp_path: Path, dialect: str
) -> None:
    """A schema older than the package (`migrate` not run since the upgrade) reads as one
    to migrate, which the fence and the publisher wait out or report, not as a failure."""
    ledger = open_ledger(empty_database(request, tmp_path, dialect))
    try:
        ledger.migrate()
        with ledger.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {dispatch_table.name} DROP COLUMN started_at")
        with pytest.raises(LedgerSchemaError, match="run `questpie-celery migrate`"):
            ledger.get(random_dispatch_id())
    finally:
        ledger.close()


def test_two_ledgers_have_different_identities(ledger: Ledger, tmp_path: Path) -> None:
    other = open_ledger(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    try:
        other.migrate()
        assert other.ledger_id() != ledger.ledger_id()
    finally:
        other.close()


# --- the relay's batches --------------------------------------------------------------------

BACKOFF = {"first_backoff": 2.0, "max_backoff": 3600.0, "accepted_backoff": 100.0}


def _due(ledger: Ledger, count: int, **values: Any) -> list[str]:
    """`count` rows due for the relay now, with `values` written over them."""
    ids = []
    for _ in range(count):
        new = _new(idempotency_key=None, send_in=0.0)
        assert ledger.insert(new) is True
        ids.append(new.id)
    if values:
        with ledger.engine.begin() as conn:
            t = dispatch_table.c
            conn.execute(update(dispatch_table).where(t.id.in_(ids)).values(**values))
    return ids


def _due_after(row: DispatchRow, seconds: float, before: datetime, after: datetime) -> bool:
    """Whether `row` is due `seconds` after a moment between `before` and `after` (the
    database's clock read around the statement that set it)."""
    assert row.next_send_at is not None
    ahead = timedelta(seconds=seconds)
    return before + ahead <= row.next_send_at <= after + ahead


def test_take_due_counts_each_send_and_backs_it_off(ledger: Ledger) -> None:
    fresh = _due(ledger, 2)
    resent = _due(ledger, 1, send_count=3)
    capped = _due(ledger, 1, send_count=20)
    accepted = _due(ledger, 1, status="queued")
    spent = _due(ledger, 1, send_count=25)
    _due(ledger, 1, next_send_at=datetime.now(UTC) + timedelta(hours=1))  # not due yet
    before = ledger.now()
    taken = ledger.take_due(100, max_sends=25, **BACKOFF)
    after = ledger.now()
    assert sorted(r.id for r in taken) == sorted(fresh + resent + capped + accepted)
    by_id = {r.id: r for r in taken}
    expected = {
        fresh[0]: (1, 2.0),
        fresh[1]: (1, 2.0),
        resent[0]: (4, 16.0),  # 2 ** (sends so far + 1)
        capped[0]: (21, 3600.0),  # capped
        accepted[0]: (1, 100.0),  # never sooner than the accepted floor
    }
    for dispatch_id, (count, ahead) in expected.items():
        assert by_id[dispatch_id].send_count == count
        assert _due_after(by_id[dispatch_id], ahead, before, after), (ahead, before, after)
    # Backed off: not due again. Out of sends: left for give_up.
    assert ledger.take_due(100, max_sends=25, **BACKOFF) == []
    assert [r.id for r in ledger.due_out_of_sends(25)] == spent


def test_give_back_uncounts_only_the_take_it_names(ledger: Ledger) -> None:
    first, second = _due(ledger, 2)
    taken = {r.id: r for r in ledger.take_due(10, max_sends=25, **BACKOFF)}
    before = ledger.now()
    ledger.give_back([taken[first]], send_in=5.0)
    after = ledger.now()
    row = _row(ledger, first)
    assert row.send_count == 0 and _due_after(row, 5.0, before, after), (row, before, after)
    # Taken again since (by another relay, say): an older take's give-back changes nothing.
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == second)
            .values(send_count=2, next_send_at=datetime.now(UTC) + timedelta(seconds=8))
        )
    ledger.give_back([taken[second]], send_in=5.0)
    assert _row(ledger, second).send_count == 2


def test_relays_taking_at_once_never_share_a_row(ledger: Ledger) -> None:
    ids = set(_due(ledger, 600))
    url = ledger.engine.url.render_as_string(hide_password=False)
    relays = [open_ledger(url) for _ in range(3)]
    start = threading.Barrier(len(relays))
    taken: list[list[str]] = [[] for _ in relays]

    def drain(index: int) -> None:
        start.wait()
        while batch := relays[index].take_due(25, max_sends=25, **BACKOFF):
            taken[index] += [row.id for row in batch]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(relays))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for relay in relays:
        relay.close()
    every = [dispatch_id for batch in taken for dispatch_id in batch]
    assert sorted(every) == sorted(ids), "a row taken twice, or never"
    assert all(_row(ledger, i).send_count == 1 for i in ids)


def test_wake_relays_notifies_listeners_at_commit_only(ledger: Ledger) -> None:
    wakeups = ledger.send_wakeups()
    if ledger.dialect == "sqlite":
        assert wakeups is None  # SQLite has no notifications: relays poll
        with ledger.engine.begin() as conn:
            ledger.wake_relays(conn)  # and waking them is a no-op
        return
    assert wakeups is not None
    # The caller's transactions: not the ledger's own autocommit.
    caller = ledger.engine.execution_options(isolation_level="READ COMMITTED")
    heard = Notifications(ledger)  # every notification on the relays' channel, in order
    wakeups.open()
    try:
        # Nothing to hear yet: the wait's own timeout (what it measures) runs out.
        assert wakeups.wait(0.1) is False
        with caller.begin() as conn:
            ledger.wake_relays(conn)
            ledger.wake_relays(conn)
            assert heard.until_control() == [], "notified before the commit"
        assert heard.until_control() == [""], "one commit, one wake-up"
        assert wakeups.wait(5) is True  # the relay's listener heard it (and the controls)
        with caller.connect() as conn:
            transaction = conn.begin()
            ledger.wake_relays(conn)
            transaction.rollback()
        assert heard.until_control() == [], "a rolled-back transaction woke the relays"
    finally:
        wakeups.close()
        heard.close()


class Notifications:
    """A listener of our own on the relays' channel that reads what each notification
    says. `until_control()` sends a control notification from a connection of its own
    (committed at once) and returns the payloads heard before it: notifications are
    delivered in the order their transactions committed, so anything committed before
    the control, or by a transaction still open, shows (or not) by then."""

    def __init__(self, ledger: Ledger) -> None:
        url = ledger.engine.url.set(drivername="postgresql")
        self._url = url.render_as_string(hide_password=False)
        self._listening = psycopg.connect(self._url, autocommit=True)
        self._listening.execute(f"LISTEN {RELAY_WAKE_CHANNEL}")
        self._controls = 0

    def until_control(self) -> list[str]:
        self._controls += 1
        control = f"control-{self._controls}"
        with psycopg.connect(self._url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (RELAY_WAKE_CHANNEL, control))
        before: list[str] = []
        for notification in self._listening.notifies(timeout=10):
            if notification.payload == control:
                return before
            before.append(notification.payload)
        raise AssertionError(f"the control notification {control} never came: {before}")

    def close(self) -> None:
        self._listening.close()


# --- a connection the server dropped (PostgreSQL) -------------------------------------------


def _drop_connections(postgres: PostgresServer, ledger: Ledger) -> None:
    url = ledger.engine.url.render_as_string(hide_password=False)
    assert postgres.terminate_backends(url) >= 1, "the ledger held no connection to drop"


def test_finish_after_a_dropped_connection_reconnects_once(
    postgres: PostgresServer, pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    dispatch_id, token = _claimed(pg_ledger)
    _drop_connections(postgres, pg_ledger)
    with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    assert any("reconnecting" in r.getMessage() for r in caplog.records), (
        "the statement did not meet the dropped connection"
    )
    row = _row(pg_ledger, dispatch_id)
    assert (row.status, row.claim_token) == ("completed", token)


@pytest.mark.parametrize("operation", ["insert", "claim", "renew", "retry", "get", "mark_queued"])
def test_each_operation_survives_a_dropped_connection(
    postgres: PostgresServer, pg_ledger: Ledger, operation: str
) -> None:
    dispatch_id, token = _claimed(pg_ledger)
    _drop_connections(postgres, pg_ledger)
    if operation == "insert":
        assert pg_ledger.insert(_new()) is True
    elif operation == "claim":
        fresh = random_dispatch_id()
        # Insert first (reconnecting), then drop again before the claim.
        assert pg_ledger.insert(_new(fresh)) is True
        _drop_connections(postgres, pg_ledger)
        assert pg_ledger.claim(fresh, JOB, 1, 60).outcome == "claimed"
    elif operation == "renew":
        assert pg_ledger.renew(dispatch_id, token, 60) is True
    elif operation == "retry":
        assert pg_ledger.retry(dispatch_id, token, retry_in=1, relay_in=2, error="E") is True
        assert _row(pg_ledger, dispatch_id).status == "retry"
    elif operation == "get":
        assert _row(pg_ledger, dispatch_id).status == "active"
    else:
        queued = _new()
        assert pg_ledger.insert(queued) is True
        _drop_connections(postgres, pg_ledger)
        pg_ledger.mark_queued([queued.id], 60)
        assert _row(pg_ledger, queued.id).status == "queued"


class _Interrupted(Exception):
    """What a signal handler raises in the middle of a statement (a soft time limit)."""


def test_a_statement_interrupted_on_the_kept_connection_leaves_it_to_the_pool(
    pg_ledger: Ledger,
) -> None:
    """The hottest statements share one connection the process keeps (ledger/hot.py). A
    statement interrupted while the server still works on it must not leave that
    connection to the next statement, which would read the interrupted one's answer."""
    assert pg_ledger.insert(_new()) is True  # the kept connection now exists
    contested = _new()
    caller = pg_ledger.engine.execution_options(isolation_level="READ COMMITTED")

    def interrupt(*_: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    with caller.connect() as holder:
        transaction = holder.begin()
        # Another transaction's uncommitted row under the same id: the insert waits for it.
        assert pg_ledger.insert(contested, holder) is True
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            with pytest.raises(_Interrupted):
                pg_ledger.insert(contested)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # While the interrupted insert still waits on the server: each next statement
        # gets its own answer.
        other = _new(idempotency_key="other")
        assert pg_ledger.insert(other) is True
        assert _row(pg_ledger, other.id).idempotency_key == "other"
        dispatch_id, token = _claimed(pg_ledger)
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
        transaction.rollback()
    # The interrupted insert may still land once the lock is gone: never twice.
    assert pg_ledger.insert(contested) in (True, False)
    with pg_ledger.engine.connect() as conn:
        rows = conn.execute(
            select(func.count())
            .select_from(dispatch_table)
            .where(dispatch_table.c.id == contested.id)
        ).scalar()
    assert rows == 1
    assert _row(pg_ledger, dispatch_id).status == "completed"


@pytest.mark.parametrize(
    "where",
    [
        "try:",  # the turn taken, before anything can give it back: the narrowest window
        "conn = self._kept.pop() if self._kept else self._open()",
        "if not conn.closed:",
        "self._turn.release()",
    ],
)
def test_a_signal_anywhere_in_taking_the_kept_connection_never_hangs(
    pg_ledger: Ledger, where: str
) -> None:
    """A signal's exception (a soft time limit) can land on any line of the short cut:
    afterwards the statements still get their answers, and closing the ledger (which
    `Questpie.close()` and the test plugin's rebinding do) returns."""
    known = _new()
    assert pg_ledger.insert(known) is True

    def interrupt() -> None:
        raise _Interrupted

    with at_line(HotConnection.connect, where, interrupt), pytest.raises(_Interrupted):
        pg_ledger.exists(known.id)
    for _ in range(3):  # (a turn the signal took away leaves them to the pool)
        assert pg_ledger.exists(known.id) is True
        assert pg_ledger.exists(random_dispatch_id()) is False
    closing = threading.Thread(target=pg_ledger.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "closing the ledger hung"
    assert pg_ledger.insert(_new()) is True


@contextmanager
def _listening(ledger: Ledger, name: str, listener: Callable[..., Any]) -> Iterator[None]:
    """`listener` on the ledger's engine's event `name` for the block's length."""
    event.listen(ledger.engine, name, listener)
    try:
        yield
    finally:
        event.remove(ledger.engine, name, listener)


def test_the_fences_statements_on_the_drivers_cursor_are_sqlalchemys_own(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish's insert, the claim, the renewal and the outcome run on psycopg's cursor
    (see ledger/direct.py): the same SQL SQLAlchemy runs, rows of the same values and
    types; and while something listens to SQLAlchemy's cursor events, they go through it."""
    direct_runs: list[str] = []  # the SQL of each statement run on the driver's cursor
    real_run = DriverStatement.run

    def counted(self: DriverStatement, conn: Any, params: Any) -> Any:
        direct_runs.append(self.sql)
        return real_run(self, conn, params)

    def kinds() -> list[str]:
        return [sql.split()[0] for sql in direct_runs]

    monkeypatch.setattr(DriverStatement, "run", counted)
    shortcut, token = _claimed(pg_ledger)
    assert pg_ledger.renew(shortcut, token, 60) is True
    assert kinds() == ["INSERT", "UPDATE", "UPDATE"]
    # Our own claim again (a try whose reply was lost): nothing matches, the row is read.
    claimed_direct = pg_ledger.claim(shortcut, JOB, 1, 60, token)
    assert claimed_direct.outcome == "claimed" and len(direct_runs) == 4
    assert claimed_direct.row == _row(pg_ledger, shortcut)

    seen: list[str] = []

    def listener(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    with _listening(pg_ledger, "before_cursor_execute", listener):
        traced, traced_token = _claimed(pg_ledger)
        assert pg_ledger.finish(traced, traced_token, "completed", None) is True
    assert len(direct_runs) == 4, "a listened-to engine's statement skipped SQLAlchemy"
    assert direct_runs[0] in seen and direct_runs[1] in seen, (
        "the driver's SQL is not the one SQLAlchemy runs"
    )
    # The claim's row, as each path returns it: the same values, of the same types.
    fresh = _new(idempotency_key=None)
    assert pg_ledger.insert(fresh)
    through_driver = pg_ledger.claim(fresh.id, JOB, 1, 60)
    assert kinds()[4:] == ["INSERT", "UPDATE"]
    assert through_driver.row is not None
    by_sqlalchemy = _row(pg_ledger, fresh.id)
    assert through_driver.row == by_sqlalchemy
    for name in DispatchRow.__dataclass_fields__:
        ours, theirs = getattr(through_driver.row, name), getattr(by_sqlalchemy, name)
        assert type(ours) is type(theirs), name
    assert pg_ledger.finish(fresh.id, through_driver.token or "", "completed", None) is True
    assert len(direct_runs) == 7
    assert _row(pg_ledger, fresh.id).status == "completed"


@pytest.mark.parametrize(
    "name",
    [
        "before_execute",
        "after_execute",
        "before_cursor_execute",
        "after_cursor_execute",
        "begin",
        "commit",
        "rollback",
        "handle_error",
    ],
)
def test_a_listener_of_any_execution_event_sees_the_hottest_statements(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Tracing and error listeners see every statement: none takes the driver's cursor
    past them."""
    direct_runs: list[str] = []
    real_run = DriverStatement.run

    def counted(self: DriverStatement, conn: Any, params: Any) -> Any:
        direct_runs.append(self.sql)
        return real_run(self, conn, params)

    monkeypatch.setattr(DriverStatement, "run", counted)
    assert pg_ledger.insert(_new()) is True
    assert len(direct_runs) == 1  # unwatched: on the driver's cursor
    heard: list[object] = []
    with _listening(pg_ledger, name, lambda *args, **_: heard.append(args)):
        dispatch_id, token = _claimed(pg_ledger)
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    assert len(direct_runs) == 1, f"a statement skipped the {name} listener"
    if name.endswith("execute"):  # (nothing failed, and autocommit commits nothing)
        assert heard


def test_a_failure_on_the_drivers_cursor_is_sqlalchemys_to_handle(
    postgres: PostgresServer, pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement that fails on the driver's cursor runs through SQLAlchemy, which finds
    what went wrong as for any statement: here a slot index refusing a second run of a
    singleton slot (SlotTaken, a blocked claim), and a dropped connection (reconnected)."""
    first = _new(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
    second = _new(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
    assert pg_ledger.insert(first) and pg_ledger.insert(second)
    assert pg_ledger.claim(first.id, JOB, 1, 60).outcome == "claimed"
    assert pg_ledger.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert _row(pg_ledger, second.id).status == "pending"
    _drop_connections(postgres, pg_ledger)
    with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
        assert pg_ledger.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert any("reconnecting" in r.getMessage() for r in caplog.records)


def test_a_ledger_on_an_engine_of_ones_own_keeps_its_execution_options(
    pg_ledger: Ledger,
) -> None:
    """An engine passed in may map the ledger's tables to another schema: a statement
    compiled once would not know the map, so only the ledger's own engines take the
    driver's cursor, and a tenant's rows stay in the tenant's tables."""
    url = pg_ledger.engine.url.render_as_string(hide_password=False)
    plain = create_engine(url)
    with plain.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant"))
    tenant = Ledger(plain.execution_options(schema_translate_map={None: "tenant"}))
    try:
        tenant.migrate()
        new = _new()
        assert tenant.insert(new) is True
        claim = tenant.claim(new.id, JOB, 1, 60)
        assert claim.outcome == "claimed" and claim.token is not None
        assert tenant.finish(new.id, claim.token, "completed", None) is True
        assert pg_ledger.get(new.id) is None, "the tenant's row went into the other ledger"
        assert _row(tenant, new.id).status == "completed"
    finally:
        tenant.close()
        plain.dispose()


def test_sqlalchemys_statement_log_shows_the_hottest_statements_too(
    pg_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """With SQLAlchemy's statement log on (`echo`, or its logger at INFO), the insert, the
    claim and the outcome are logged like every other statement."""
    with caplog.at_level(logging.INFO, logger="sqlalchemy.engine"):
        dispatch_id, token = _claimed(pg_ledger)
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    logged = [
        r.getMessage().split()[0] for r in caplog.records if r.name.startswith("sqlalchemy.engine")
    ]
    assert logged.count("INSERT") == 1 and logged.count("UPDATE") == 2, logged


def test_a_select_on_the_drivers_cursor_returns_rows_and_escaped_names_bind(
    pg_ledger: Ledger,
) -> None:
    """A SELECT returns its rows, as through SQLAlchemy, not a row count; and a bind whose
    name SQLAlchemy escapes (a space) gets its value, through its type's processor."""
    new = _new()
    assert pg_ledger.insert(new) is True
    exists = DriverStatement(select(dispatch_table.c.id).where(by_id()), pg_ledger.engine)
    with pg_ledger.engine.connect() as conn:
        assert exists.run(conn, {"dispatch_id": new.id}) == [{"id": new.id}]
        t = dispatch_table.c
        due = DriverStatement(
            select(t.id).where(
                t.id == new.id, t.run_after < bindparam("due by", type_=UTCDateTime)
            ),
            pg_ledger.engine,
        )
        assert due.run(conn, {"due by": datetime.now(UTC) + timedelta(hours=1)}) == [{"id": new.id}]


@contextmanager
def lock_timeouts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each statement that meets PostgreSQL's lock_timeout in the block, on psycopg's own
    cursor (the driver's cursor's statements and SQLAlchemy's alike)."""
    timeouts: list[str] = []
    real_execute = psycopg.Cursor.execute

    def execute(self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_execute(self, query, *args, **kwargs)
        except psycopg.errors.LockNotAvailable:
            timeouts.append(str(query))
            raise

    with monkeypatch.context() as patched:
        patched.setattr(psycopg.Cursor, "execute", execute)
        yield timeouts


def test_a_claim_meeting_a_held_row_waits_the_lock_timeout_once(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's transaction holds the row: the claim fails with LedgerBusyError after one
    lock timeout (PG_LOCK_TIMEOUT_MS); an error of the database on the driver's cursor is
    not run again, on that cursor or through SQLAlchemy."""
    locked = _new()
    assert pg_ledger.insert(locked)
    caller = create_engine(pg_ledger.engine.url.render_as_string(hide_password=False))
    try:
        with caller.begin() as conn:
            conn.execute(
                select(dispatch_table.c.id)
                .where(dispatch_table.c.id == locked.id)
                .with_for_update()
            )
            with lock_timeouts(monkeypatch) as timeouts, pytest.raises(LedgerBusyError):
                pg_ledger.claim(locked.id, JOB, 1, 60)
    finally:
        caller.dispose()
    assert len(timeouts) == 1, timeouts
    assert _row(pg_ledger, locked.id).status == "pending"


def test_listeners_of_the_engines_execution_and_errors_see_the_hottest_statements(
    pg_ledger: Ledger,
) -> None:
    """A listener of statements (`before_execute`) or of their errors (`handle_error`)
    sees the insert, the claim and the outcome as every other statement: none of them
    takes the driver's cursor while one listens."""
    seen: list[str] = []
    heard: list[str] = []

    def before(conn: Any, clauseelement: Any, *_: Any) -> None:
        seen.append(type(clauseelement).__name__)

    def on_error(context: Any) -> None:
        heard.append(getattr(context.original_exception, "sqlstate", None) or "?")

    with _listening(pg_ledger, "before_execute", before):
        dispatch_id, token = _claimed(pg_ledger)
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    assert seen.count("Insert") == 1 and seen.count("Update") == 2, seen
    with _listening(pg_ledger, "handle_error", on_error):
        first = _new(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
        second = _new(idempotency_key=None, policy=QueuePolicy.SINGLETON, singleton_key="s")
        assert pg_ledger.insert(first) and pg_ledger.insert(second)
        assert pg_ledger.claim(first.id, JOB, 1, 60).outcome == "claimed"
        assert pg_ledger.claim(second.id, JOB, 1, 60).outcome == "blocked"
    assert heard == ["23505"], heard  # the slot index's unique violation


def test_a_handle_error_listener_that_counts_more_errors_as_disconnects_still_works(
    pg_ledger: Ledger,
) -> None:
    """SQLAlchemy's way to treat another error as a dropped connection (a `handle_error`
    listener setting `is_disconnect`; here a read-only server, as a primary demoted in a
    failover) holds for the fence's statements: the pool drops the connection and the
    outcome is written on a fresh one."""

    def on_error(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == "25006":  # read only
            context.is_disconnect = True

    with _listening(pg_ledger, "handle_error", on_error):
        dispatch_id, token = _claimed(pg_ledger)
        with pg_ledger.engine.connect() as conn:  # the pool's one idle connection
            conn.exec_driver_sql("SET default_transaction_read_only = on")
        assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    assert _row(pg_ledger, dispatch_id).status == "completed"


def test_finish_twice_across_a_dropped_connection(
    postgres: PostgresServer, pg_ledger: Ledger
) -> None:
    dispatch_id, token = _claimed(pg_ledger)
    assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    _drop_connections(postgres, pg_ledger)
    # The first write landed: run again on a fresh connection, it reads back True.
    assert pg_ledger.finish(dispatch_id, token, "completed", None) is True
    _drop_connections(postgres, pg_ledger)
    assert pg_ledger.finish(dispatch_id, "another-token", "completed", None) is False


def test_a_ledger_that_stays_down_raises_unavailable() -> None:
    ledger = open_ledger(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    try:
        with pytest.raises(LedgerUnavailableError):
            ledger.get(random_dispatch_id())
    finally:
        ledger.close()


def test_pruning_records_how_far_back_rows_may_be_gone_and_never_moves_it_back(
    ledger: Ledger,
) -> None:
    assert ledger.pruned_before() is None  # nothing was ever pruned
    before = ledger.now()
    ledger.prune_schedule_history(key_prefix="questpie-schedule:", older_than=3600, limit=10)
    after = ledger.now()
    first = ledger.pruned_before()
    assert first is not None
    # An hour before the prune, by the database's clock.
    hour = timedelta(hours=1)
    assert before - hour <= first <= after - hour, (before, first, after)
    ledger.prune_ended(keyed=False, older_than=7 * 86400, limit=10, spare_key_prefix="x")
    assert ledger.pruned_before() == first  # an older cutoff does not move it back
    ledger.prune_ended(keyed=True, older_than=60, limit=10, spare_key_prefix="x")
    later = ledger.pruned_before()
    assert later is not None and later > first


# --- dispatch ids of any shape (a plain Celery call keeps its own task id) -----------------

#: Task ids Celery accepts and the ledger stores: long, unicode, punctuation, whitespace.
ODD_IDS = [
    "x" * 37,
    "é" * (MAX_DISPATCH_ID_BYTES // 2),  # two bytes each: the longest that fits
    "order 42 / retry #3 \t(ünïcödé) 🚀 'quoted' \"too\" ; DROP TABLE x; --",
    " \n ",
    "%_\\",  # what LIKE would take for patterns
]


@pytest.mark.parametrize("odd", ODD_IDS, ids=range(len(ODD_IDS)))
def test_a_dispatch_id_of_any_storable_shape_is_a_row_like_any_other(
    ledger: Ledger, odd: str
) -> None:
    assert unstorable_id(odd) is None
    new = _new(odd, idempotency_key=None)
    assert ledger.insert(new) is True
    assert ledger.insert(new) is False
    assert ledger.exists(odd) and ledger.existing([odd, "other"]) == {odd}
    claim = ledger.claim(odd, JOB, 1, 60)
    assert claim.outcome == "claimed" and claim.token is not None
    assert ledger.claim(odd, JOB, 1, 60).outcome == "busy"
    assert ledger.finish(odd, claim.token, "completed", None)
    assert _row(ledger, odd).status == "completed"
    assert ledger.claim(odd, JOB, 1, 60).outcome == "done"


def test_ids_the_ledger_cannot_store_are_named_with_the_reason() -> None:
    assert unstorable_id("a\0b") is not None and "NUL" in (unstorable_id("a\0b") or "")
    assert "surrogate" in (unstorable_id("a\udc80") or "")
    assert "bytes" in (unstorable_id("x" * (MAX_DISPATCH_ID_BYTES + 1)) or "")
    assert unstorable_id("") is not None and unstorable_id(None) is not None
    assert unstorable_id("x" * MAX_DISPATCH_ID_BYTES) is None


def test_migrating_a_version_4_ledger_widens_its_dispatch_ids(ledger: Ledger) -> None:
    """A ledger made before version 5 held ids of at most 36 characters."""
    kept = _new()
    assert ledger.insert(kept)
    before = _make_version_4(ledger)
    assert ledger.migrate() == SCHEMA_VERSION
    assert ledger.migrate() == SCHEMA_VERSION
    if ledger.dialect == "postgresql":
        inspector = inspect(ledger.engine)
        for table, name in (
            ("questpie_queue_dispatch", "id"),
            ("questpie_schedule", "last_dispatch_id"),
        ):
            column = next(c for c in inspector.get_columns(table) if c["name"] == name)
            assert getattr(column["type"], "length", 0) is None, (table, name)
        # A change to the catalog only: neither the table nor its indexes were rewritten.
        assert _storage(ledger) == before
    long_id = "plain-call-" + "x" * 200
    assert ledger.insert(_new(long_id, idempotency_key=None))
    assert ledger.claim(long_id, JOB, 1, 60).outcome == "claimed"
    assert _row(ledger, kept.id).payload == kept.payload  # the old row came through


def _storage(ledger: Ledger) -> dict[str, int]:
    """The files of the dispatch table and its indexes (PostgreSQL): a rewrite changes them."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname, c.relfilenode FROM pg_class c WHERE c.oid = "
                "'questpie_queue_dispatch'::regclass OR c.oid IN (SELECT indexrelid FROM "
                "pg_index WHERE indrelid = 'questpie_queue_dispatch'::regclass)"
            )
        ).all()
    return {name: int(node) for name, node in rows}


def _make_version_4(ledger: Ledger) -> dict[str, int]:
    """Turn a migrated ledger back into what version 4 created: ids of `VARCHAR(36)`.
    Returns the table's storage (PostgreSQL), to compare with after the migration."""
    with ledger.engine.begin() as conn:
        conn.execute(delete(schema_version_table).where(schema_version_table.c.version >= 5))
        conn.execute(insert(schema_version_table).values(version=4, applied_at=db_time()))
        if ledger.dialect == "postgresql":
            for table, name in (
                ("questpie_queue_dispatch", "id"),
                ("questpie_schedule", "last_dispatch_id"),
            ):
                conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN {name} TYPE varchar(36)"))
    # A longer id waits for the migration (a schema error, which the fence waits out)
    # rather than meeting the old width (PostgreSQL would refuse it).
    with pytest.raises(LedgerSchemaError, match="run `questpie-celery migrate`"):
        ledger.insert(_new("y" * 37, idempotency_key=None))
    return _storage(ledger) if ledger.dialect == "postgresql" else {}


def test_a_process_running_across_the_migration_goes_on(
    pg_ledger: Ledger, pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that ran the ledger's statements on version 4's tables has them prepared
    on its connections (psycopg prepares a statement after its fifth run); once another
    process migrated to version 5, PostgreSQL refuses to run them ("cached plan must not
    change result type": the ids' type changed). Each of them, sync and asyncio, then
    runs again on a fresh connection instead of failing for as long as the process lives
    (a worker's claim with a LedgerError, which Celery acknowledges unrun). An engine of
    one's own keeps its connections: there the error is a LedgerUnavailableError (a worker
    sends its delivery back rather than acknowledging it unrun) saying what to do."""
    _make_version_4(pg_ledger)
    pg_ledger.engine.dispose()  # connections opened on version 4's tables from here on
    theirs = Ledger(create_engine(pg_db))
    aledger = AsyncLedger(pg_ledger)
    loop = asyncio.new_event_loop()
    kept = _new(idempotency_key=None)
    assert pg_ledger.insert(kept)

    def hot_path(*, ours_only: bool = False) -> None:
        assert pg_ledger.insert(_new(idempotency_key=None))
        assert _row(pg_ledger, kept.id).id == kept.id
        assert pg_ledger.claim(random_dispatch_id(), JOB, 1, 60).outcome == "unknown"
        pg_ledger.take_due(10, max_sends=5, first_backoff=1, max_backoff=5, accepted_backoff=5)
        assert loop.run_until_complete(aledger.insert(_new(idempotency_key=None)))
        assert loop.run_until_complete(aledger.get(kept.id)) is not None
        if not ours_only:
            assert theirs.get(kept.id) is not None

    try:
        for _ in range(8):
            hot_path()
        other = open_ledger(pg_db)
        try:
            assert other.migrate() == SCHEMA_VERSION
        finally:
            other.close()
        with pytest.raises(LedgerUnavailableError, match="prepare_threshold"):
            theirs.get(kept.id)
        with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
            hot_path(ours_only=True)
        assert any("outlived a migration" in r.getMessage() for r in caplog.records), (
            "no statement met its stale plan"
        )
        fresh = _new("plain-call-" + "x" * 40, idempotency_key=None)
        assert pg_ledger.insert(fresh)
        assert pg_ledger.claim(fresh.id, JOB, 1, 60).outcome == "claimed"
    finally:
        loop.run_until_complete(aledger.close())
        loop.close()
        theirs.close()


# --- never before the row is due -----------------------------------------------------------


def test_a_claim_before_the_row_is_due_is_early_and_touches_nothing(ledger: Ledger) -> None:
    start = ledger.now() + timedelta(seconds=600)
    new = _new(run_after=start, next_send_at=start - timedelta(seconds=60))
    assert ledger.insert(new)
    before = _row(ledger, new.id)
    early = ledger.claim(new.id, JOB, 1, 60)
    assert early.outcome == "early" and early.token is None
    assert 590 < early.due_in <= 600
    assert _row(ledger, new.id) == before
    # Its relay time already comes before its start: nothing to change.
    assert ledger.send_when_due(new.id, JOB, 1) is False
    assert _row(ledger, new.id) == before
    # Other reasons come first: another job's id is unknown, another attempt stale.
    assert ledger.claim(new.id, "other-job", 1, 60).outcome == "unknown"
    assert ledger.claim(new.id, JOB, 2, 60).outcome == "stale"
    # Eager mode runs it at once, as Celery's eager mode does.
    assert ledger.claim(new.id, JOB, 1, 60, any_time=True).outcome == "claimed"


@pytest.mark.parametrize("concurrency", [None, 2], ids=["unlimited", "seated"])
def test_a_row_due_between_the_claim_and_its_read_back_is_claimed(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, concurrency: int | None
) -> None:
    """A delivery a hair early (a debounced burst's message: its countdown is the
    publisher's, its start the database's) finds the row not due; by the read that says
    why, it is. That is neither stale (dropped, the row left to the relay for an hour)
    nor, with a concurrency limit and every seat free, blocked: the claim goes again."""
    start = ledger.now() + timedelta(seconds=0.3)
    new = _new(run_after=start)
    assert ledger.insert(new)
    read_back = ledger._claims_sql.get_and_now
    first = ledger._first

    def slow_read_back(stmt: Any, params: Any) -> Any:
        if stmt is read_back:
            # The scenario: a read-back slow enough (0.5 s) that the row, due 0.3 s after
            # its insert, comes due between the claim and this read.
            time.sleep(0.5)
        return first(stmt, params)

    monkeypatch.setattr(ledger, "_first", slow_read_back)
    claim = ledger.claim(new.id, JOB, 1, 60, concurrency=concurrency)
    assert claim.outcome == "claimed"
    row = _row(ledger, new.id)
    assert (row.status, row.attempt) == ("active", 1)
    assert (row.seat is not None) == (concurrency is not None)


def test_an_early_delivery_of_a_retry_makes_the_relay_send_it_when_due(ledger: Ledger) -> None:
    dispatch_id, token = _claimed(ledger)
    # A retry sent at once with its countdown: the relay looks only long after it is due.
    assert ledger.retry(dispatch_id, token, retry_in=600, relay_in=600 + 3600, error="E")
    waiting = _row(ledger, dispatch_id)
    assert waiting.next_send_at is not None and waiting.next_send_at > waiting.run_after
    early = ledger.claim(dispatch_id, JOB, 2, 60)
    assert early.outcome == "early" and 590 < early.due_in <= 600
    assert ledger.send_when_due(dispatch_id, JOB, 2) is True
    row = _row(ledger, dispatch_id)
    assert row.next_send_at == row.run_after  # due for the relay at its start, no later
    assert (row.status, row.attempt, row.claim_token) == ("retry", 1, token)
    assert ledger.send_when_due(dispatch_id, JOB, 3) is False  # not the attempt it waits for
    _due_now(ledger, dispatch_id)  # once due, the delivery claims
    assert ledger.claim(dispatch_id, JOB, 2, 60).outcome == "claimed"


def test_the_acceptance_mark_after_a_dropped_early_delivery_keeps_it_due_at_start(
    ledger: Ledger,
) -> None:
    """The publisher's acceptance mark is batched: it may come after a worker dropped an
    early delivery (maybe the very message accepted) and made the row due at its start."""
    start = ledger.now() + timedelta(seconds=20)
    dropped, untouched = _new(run_after=start, send_in=30), _new(run_after=start, send_in=30)
    assert ledger.insert(dropped) and ledger.insert(untouched)
    assert ledger.claim(dropped.id, JOB, 1, 60).outcome == "early"
    assert ledger.send_when_due(dropped.id, JOB, 1) is True
    ledger.mark_queued([dropped.id, untouched.id], redeliver_in=3600)
    row = _row(ledger, dropped.id)
    assert (row.status, row.next_send_at) == ("queued", row.run_after)
    other = _row(ledger, untouched.id)
    assert other.status == "queued" and other.next_send_at is not None
    assert other.next_send_at > other.run_after + timedelta(seconds=3000)


def test_only_the_ledgers_own_postgresql_engines_share_inserts(pg_db: str) -> None:
    """A shared statement cannot let a row go: on an engine without the ledger's lock
    timeout, one meeting a row that a publishing thread's own open transaction holds would
    hold that thread up for good. So threads share inserts on the ledger's own engines
    only (and never on SQLite, whose multi-row insert is an insert per row)."""
    own = open_ledger(pg_db)
    passed_in = Ledger(create_engine(pg_db))
    try:
        assert own.inserts_in_batches is True
        assert passed_in.inserts_in_batches is False
    finally:
        own.close()
        passed_in.close()
