"""The ledger's transitions walked at random (hypothesis): after every step each row's
times are in order and each status shows only the times it has, on both dialects."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.policies import QueuePolicy
from questpie_celery.ledger import DispatchRow, Ledger
from questpie_celery.ledger.schema import TERMINAL
from questpie_celery.ops.receipts import DispatchDetail
from tests.support.ledgers import JOB, new_row, row_of


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
        return row_of(self.ledger, self.ids[index % len(self.ids)])

    @rule(taken_in=st.booleans())
    def publish(self, taken_in: bool) -> None:
        if len(self.ids) >= 3:
            return
        # A publish writes `pending`; a worker taking a plain call in writes `queued`.
        new = new_row(
            idempotency_key=None,
            status="queued" if taken_in else "pending",
            policy=QueuePolicy.SINGLETON,
            singleton_key=random_dispatch_id(),
        )
        assert self.ledger.dispatches.insert(new)
        self.ids.append(new.id)

    @rule(index=st.integers(0, 2), ago=st.floats(0, 0.5))
    def acceptance_mark(self, index: int, ago: float) -> None:
        row = self._pick(index)
        if row is not None:  # early or late, on any row: the publisher's batch
            self.ledger.dispatches.mark_queued([row.id], 3600, accepted_ago=ago)

    @rule(index=st.integers(0, 2), lease=st.sampled_from([60.0, -1.0]))
    def claim(self, index: int, lease: float) -> None:
        row = self._pick(index)
        if row is not None and row.status in ("pending", "queued", "retry"):
            claim = self.ledger.claims.claim(row.id, JOB, row.attempt + 1, lease)
            if claim.token is not None:
                self.tokens[row.id] = claim.token

    @rule(index=st.integers(0, 2), outcome=st.sampled_from(["completed", "failed", "retry"]))
    def end_attempt(self, index: int, outcome: str) -> None:
        row = self._pick(index)
        if row is None or row.status != "active":
            return
        token = self.tokens[row.id]
        if outcome == "retry":
            self.ledger.claims.retry(row.id, token, retry_in=0, relay_in=0, error="E")
        else:
            self.ledger.claims.finish(row.id, token, outcome, "E" if outcome == "failed" else None)  # type: ignore[arg-type]

    @rule(index=st.integers(0, 2), again=st.booleans())
    def lease_lapses(self, index: int, again: bool) -> None:
        row = self._pick(index)
        if row is not None and row in self.ledger.claims.expired():
            self.ledger.claims.lapse(row, retry_in=0 if again else None, relay_in=0)

    @rule(index=st.integers(0, 2))
    def park_and_unpark(self, index: int) -> None:
        row = self._pick(index)
        if row is None:
            return
        if row.status == "parked" and row.slot is not None:
            self.ledger.slots.unpark_next(JOB, row.slot, 3600)
        elif row.status in ("pending", "queued", "retry"):
            self.ledger.slots.park(row.id, JOB, row.attempt + 1)

    @rule()
    def relay_sends(self) -> None:
        self.ledger.relay.take_due(
            50, max_sends=25, first_backoff=0, max_backoff=0, accepted_backoff=0
        )

    @rule(index=st.integers(0, 2), how=st.sampled_from(["give up", "revoke", "lost"]))
    def unrun(self, index: int, how: str) -> None:
        row = self._pick(index)
        if row is None or row.status not in ("pending", "queued", "retry"):
            return
        if how == "give up":
            self.ledger.relay.give_up(row)
        elif how == "revoke":
            self.ledger.claims.end_unclaimed(row.id, JOB, row.attempt + 1, "Revoked")
        else:
            self.ledger.claims.send_unclaimed_now(row.id, JOB, row.attempt + 1, horizon=60)

    @rule(index=st.integers(0, 2))
    def requeue(self, index: int) -> None:
        row = self._pick(index)
        if row is not None and row.status == "failed":
            self.ledger.views.requeue(row.id)

    @rule(index=st.integers(0, 2))
    def cancel(self, index: int) -> None:
        row = self._pick(index)
        if row is None:
            return
        done = self.ledger.cancels.cancel(row.id)
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
            self.ledger.limits.wait_for_rate(row.id, token, retry_in=0, relay_in=0)
            return
        ended = self.ledger.claims.end_unrun(row.id, token)
        assert (ended is not None) == (row.cancel_requested_at is not None)
        if ended is not None:
            assert ended.status == "cancelled" and ended.attempt == row.attempt - 1
            assert ended.last_error == row.last_error

    @invariant()
    def times_are_honest(self) -> None:
        for dispatch_id in self.ids:
            check_times(row_of(self.ledger, dispatch_id))

    @invariant()
    def cancels_hold(self) -> None:
        for dispatch_id, attempt in self.cancelled_unstarted.items():
            row = row_of(self.ledger, dispatch_id)
            assert (row.status, row.attempt) == ("cancelled", attempt), row
