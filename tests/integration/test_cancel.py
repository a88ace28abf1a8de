"""Durable cancellation: the ledger's row ends the dispatch for every worker at once.

Real prefork workers on Redis and RabbitMQ, PostgreSQL (and SQLite for the ledger's own
operations). What ran is read from the rows the handlers record; a run held open by a
gate stays active for as long as the test wants.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from questpie_celery import QuestpieError, UnknownDispatchError
from questpie_celery.cli.commands import main
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import Ledger, NewDispatch
from questpie_celery.ops.receipts import Receipt
from questpie_celery.signals import dispatch_cancelled
from questpie_celery.worker.cancels import Cancellation
from tests.integration.conftest import StackFactory, new_stack
from tests.support.brokers import deliver
from tests.support.faultproxy import FaultProxy
from tests.support.faults import SHORT_LEASE, held_dispatch
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

BROKERS = ["redis", "rabbitmq"]


@pytest.fixture(scope="module", params=BROKERS)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """PostgreSQL, a prefork worker, a short lease (renewed every second), a secret."""
    made = new_stack(
        request,
        tmp_path_factory.mktemp("cancel"),
        request.param,
        env={**SHORT_LEASE, "QP_TEST_SECRET": "cancel secret " * 3},
    )
    yield made
    made.close()


@pytest.fixture
def told() -> Iterator[list[dict[str, Any]]]:
    """What `dispatch_cancelled` said, in this process."""
    heard: list[dict[str, Any]] = []

    def hear(sender: str, signal: object, **kwargs: Any) -> None:
        heard.append({"sender": sender, **kwargs})

    dispatch_cancelled.connect(hear, weak=False)
    yield heard
    dispatch_cancelled.disconnect(hear)


def key() -> str:
    return f"key-{uuid.uuid4().hex[:10]}"


# --- with real workers --------------------------------------------------------------------


def test_a_cancelled_dispatch_that_waits_for_its_start_never_runs(
    stack: Stack, told: list[dict[str, Any]]
) -> None:
    t, k = tag(), key()
    client = stack.questpie.queue.record
    dispatch_id = client.publish({"tag": t}, idempotency_key=k, start_after=2)
    assert dispatch_id is not None
    assert stack.questpie.queue.cancel(dispatch_id) is True
    assert told[-1] == {
        "sender": "record",
        "job_name": "record",
        "dispatch_id": dispatch_id,
        "started": False,
    }
    status = stack.questpie.queue.get_status(dispatch_id)
    assert status is not None and status.status == "cancelled" and status.attempt == 0
    # Its message arrives when due, is acknowledged, and runs nothing.
    stack.wait_log(dispatch_id, "skipped (done)", timeout=30)
    assert stack.runs(t) == []
    # The key keeps its id for good: publishing it again runs nothing either.
    assert client.publish({"tag": t}, idempotency_key=k) == dispatch_id
    assert client.cancel(idempotency_key=k) is False  # ended already: nothing changed
    assert stack.runs(t) == []
    assert stack.row(dispatch_id).status == "cancelled"


@pytest.mark.parametrize("broker", BROKERS)
def test_a_worker_down_at_cancel_time_that_starts_later_runs_nothing(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, env=SHORT_LEASE, start_worker=False)
    t = tag()
    client = stack.questpie.queue.record
    cancelled = [client.publish({"tag": t}, idempotency_key=key()) for _ in range(3)]
    kept = client.publish({"tag": t}, idempotency_key=key())
    assert kept is not None
    for dispatch_id in cancelled:
        assert dispatch_id is not None
        assert stack.questpie.queue.cancel(dispatch_id) is True
    # No worker heard anything: Celery's revoke would be lost here. The one that starts
    # now takes every message from the broker.
    stack.worker.start()
    assert stack.wait_status(kept, "completed").attempt == 1
    for dispatch_id in cancelled:
        assert dispatch_id is not None
        stack.wait_log(dispatch_id, "skipped (done)")
        assert stack.row(dispatch_id).status == "cancelled"
    assert [r["dispatch_id"] for r in stack.runs(t)] == [kept]


def test_a_running_dispatch_goes_on_sees_the_cancel_and_is_not_retried(
    stack: Stack, told: list[dict[str, Any]]
) -> None:
    t = tag()
    client = stack.questpie.queue.cancel_watch
    # It fails every attempt, and would be retried twice were it not cancelled.
    dispatch_id = client.publish({"tag": t, "fail_times": 5}, idempotency_key=key())
    assert dispatch_id is not None
    stack.wait_runs(t, 1)
    assert stack.questpie.queue.cancel(dispatch_id) is True
    assert told[-1]["dispatch_id"] == dispatch_id and told[-1]["started"] is True
    # Not interrupted: its renewal brings the news, the handler sees it and ends.
    row = stack.wait_status(dispatch_id, "cancelled", timeout=30)
    assert row.attempt == 1 and row.started_at is not None
    assert row.cancel_requested_at is not None
    assert row.last_error == "RuntimeError"
    [end] = stack.runs(t, phase="end")
    assert end["note"] == "cancel_requested=True"
    status = stack.questpie.queue.get_status(dispatch_id)
    assert status is not None and status.cancel_requested_at is not None
    # A retry would be due at once (no retry delay): its message would have been taken,
    # and its delivery ended, by now.
    stack.wait_settled(dispatch_id)
    assert len(stack.runs(t)) == 1
    assert stack.row(dispatch_id).status == "cancelled"
    assert stack.questpie.queue.cancel(dispatch_id) is False


def test_a_running_dispatch_that_completes_after_its_cancel_ends_cancelled(
    stack: Stack,
) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.cancel_watch.publish({"tag": t}, idempotency_key=key())
    assert dispatch_id is not None
    stack.wait_runs(t, 1)
    assert stack.questpie.queue.cancel(dispatch_id) is True
    row = stack.wait_status(dispatch_id, "cancelled", timeout=30)
    assert row.last_error is None and row.attempt == 1


def test_a_cancelled_parked_run_frees_its_waiting_slot_for_the_next(stack: Stack) -> None:
    t, s = tag(), f"slot-{uuid.uuid4().hex[:8]}"
    client = stack.questpie.queue.policy_stately
    gate = stack.gate()
    running = client.publish({"tag": t, "gate": str(gate)}, singleton_key=s)
    assert running is not None
    stack.wait_status(running, "active")
    waiting = client.publish({"tag": t}, singleton_key=s)
    assert waiting is not None
    stack.wait_status(waiting, "parked")
    assert client.publish({"tag": t}, singleton_key=s) is None  # one waits already
    assert stack.questpie.queue.cancel(waiting) is True
    following = client.publish({"tag": t}, singleton_key=s)  # the slot is free at once
    assert following is not None
    gate.open()
    stack.wait_status(running, "completed")
    stack.wait_status(following, "completed")
    assert waiting not in {r["dispatch_id"] for r in stack.runs(t)}
    assert stack.row(waiting).status == "cancelled"


def test_cancelling_a_retry_that_holds_the_running_slot_sends_the_parked_run_at_once(
    stack: Stack,
) -> None:
    t, s = tag(), f"slot-{uuid.uuid4().hex[:8]}"
    client = stack.questpie.queue.policy_singleton
    gate = stack.gate()
    first = client.publish(
        {"tag": t, "gate": str(gate), "fail_times": 1}, singleton_key=s, retry_delay=600
    )
    assert first is not None
    stack.wait_status(first, "active")
    second = client.publish({"tag": t}, singleton_key=s)
    assert second is not None
    stack.wait_status(second, "parked")
    gate.open()
    stack.wait_status(first, "retry")  # its retry, ten minutes off, keeps the slot
    assert stack.row(second).status == "parked"
    assert stack.questpie.queue.cancel(first) is True
    assert stack.wait_status(second, "completed").attempt == 1
    assert stack.row(first).status == "cancelled" and stack.row(first).attempt == 1


def test_a_secret_dispatch_cancelled_has_its_key_erased_and_a_cancelled_receipt(
    stack: Stack,
) -> None:
    t, k = tag(), key()
    canary = f"canary-{uuid.uuid4().hex}"
    client = stack.questpie.queue.secret_link
    dispatch_id = client.publish(
        {"tag": t, "link": canary}, idempotency_key=k, secret_payload=True, start_after=60
    )
    assert dispatch_id is not None
    assert client.cancel(idempotency_key=k) is True
    row = stack.row(dispatch_id)
    assert row.status == "cancelled"
    assert row.secret_ciphertext is None and row.secret_wrapped_key is None
    receipt = stack.questpie.queue.get_receipt(dispatch_id)
    assert receipt is not None and receipt.status == "cancelled"
    assert receipt.handled_at is not None
    assert canary not in stack.worker.log()


def test_acancel_from_an_event_loop(stack: Stack) -> None:
    t, k = tag(), key()
    client = stack.questpie.queue.record

    async def go() -> tuple[bool, bool]:
        dispatch_id = await client.apublish({"tag": t}, idempotency_key=k, start_after=60)
        assert dispatch_id is not None
        first = await stack.questpie.queue.acancel(dispatch_id)
        return first, await client.acancel(idempotency_key=k)

    assert asyncio.run(go()) == (True, False)


def test_the_cli_cancels_and_says_when_there_was_nothing_to_cancel(stack: Stack) -> None:
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": tag()}, idempotency_key=key(), start_after=60
    )
    assert dispatch_id is not None
    url = stack.env["QP_TEST_LEDGER"]
    runner = CliRunner()
    done = runner.invoke(main, ["dispatches", "cancel", dispatch_id, "--ledger-url", url])
    assert done.exit_code == 0, done.output
    assert "cancelled" in done.output
    again = runner.invoke(main, ["dispatches", "cancel", dispatch_id, "--ledger-url", url])
    assert again.exit_code == 1
    assert "had already ended (cancelled)" in again.output
    unknown = runner.invoke(main, ["dispatches", "cancel", "no-such-id", "--ledger-url", url])
    assert unknown.exit_code == 1
    assert "no dispatch 'no-such-id' in the ledger" in unknown.output


# --- the ledger alone, on both dialects -------------------------------------------------


def _row(ledger: Ledger, **values: Any) -> NewDispatch:
    new = NewDispatch(
        id=str(uuid.uuid4()),
        job_name="job",
        payload={"n": 1},
        options=StoredOptions(),
        **values,
    )
    assert ledger.dispatches.insert(new)
    return new


def test_each_state_before_a_start_is_cancelled_and_then_claims_nothing(ledger: Ledger) -> None:
    cancellation = Cancellation(ledger, None)
    pending = _row(ledger)
    queued = _row(ledger, status="queued")
    parked = _row(ledger, status="queued")
    ledger.slots.park(parked.id, "job", 1, None)
    retrying = _row(ledger)
    claim = ledger.claims.claim(retrying.id, "job", 1, 30)
    assert claim.token is not None
    assert ledger.claims.retry(retrying.id, claim.token, retry_in=600, relay_in=600, error="E")
    assert [ledger.get(new.id).status for new in (pending, queued, parked, retrying)] == [  # type: ignore[union-attr]
        "pending",
        "queued",
        "parked",
        "retry",
    ]
    for new, attempt in ((pending, 1), (queued, 1), (parked, 1), (retrying, 2)):
        assert cancellation.cancel(new.id) is True
        row = ledger.get(new.id)
        assert row is not None and row.status == "cancelled"
        assert row.finished_at is not None and row.next_send_at is None
        assert ledger.claims.claim(new.id, "job", attempt, 30, any_time=True).outcome == "done"
        assert cancellation.cancel(new.id) is False


def test_an_unknown_id_is_an_unknown_dispatch_error(ledger: Ledger) -> None:
    with pytest.raises(UnknownDispatchError) as caught:
        Cancellation(ledger, None).cancel("no-such-id")
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, QuestpieError)
    assert "no-such-id" in str(caught.value)


def test_an_ended_dispatch_is_left_as_it_was(ledger: Ledger) -> None:
    new = _row(ledger)
    claim = ledger.claims.claim(new.id, "job", 1, 30)
    assert claim.token is not None
    assert ledger.claims.finish(new.id, claim.token, "completed", None)
    before = ledger.get(new.id)
    assert Cancellation(ledger, None).cancel(new.id) is False
    assert ledger.get(new.id) == before


def test_a_run_cancelled_while_it_runs_is_never_retried_whatever_ends_it(
    ledger: Ledger,
) -> None:
    cancellation = Cancellation(ledger, None)
    # Its handler fails: the retry's write does not match, the end writes `cancelled`.
    failing = _row(ledger)
    claim = ledger.claims.claim(failing.id, "job", 1, 30)
    assert claim.token is not None
    renewal = ledger.claims.renew_lease(failing.id, claim.token, 30)
    assert renewal is not None and renewal.cancel_requested is False
    assert cancellation.cancel(failing.id) is True
    renewal = ledger.claims.renew_lease(failing.id, claim.token, 30)
    assert renewal is not None and renewal.cancel_requested is True
    assert ledger.get(failing.id).status == "active"  # type: ignore[union-attr]
    assert cancellation.cancel(failing.id) is True  # still running: it will not run again
    assert not ledger.claims.retry(failing.id, claim.token, retry_in=0, relay_in=0, error="E")
    assert ledger.claims.finish(failing.id, claim.token, "failed", "E")
    row = ledger.get(failing.id)
    assert row is not None and row.status == "cancelled" and row.last_error == "E"
    # Its lease lapses (the worker died): the relay's lapse does not retry it either.
    lapsing = _row(ledger)
    claim = ledger.claims.claim(lapsing.id, "job", 1, 0.2)
    assert claim.row is not None and claim.token is not None
    assert cancellation.cancel(lapsing.id) is True
    [expired] = wait_until(
        lambda: [r for r in ledger.claims.expired() if r.id == lapsing.id],
        "its lease to lapse (the row among the expired claims)",
        10,
    )
    assert not ledger.claims.lapse(expired, retry_in=0, relay_in=0)
    assert ledger.claims.lapse(expired, retry_in=None, relay_in=0)
    row = ledger.get(lapsing.id)
    assert row is not None and row.status == "cancelled" and row.claim_token is None


def test_a_cancelled_secret_row_keeps_no_key_and_its_receipt_says_cancelled(
    ledger: Ledger,
) -> None:
    new = _row(
        ledger,
        idempotency_key="k",
        secret_ciphertext=b"ciphertext",
        secret_wrapped_key=b"wrapped",
        secret_key_id="kid",
        run_after=None,
    )
    before = ledger.now()
    assert Cancellation(ledger, None).cancel(new.id) is True
    after = ledger.now()
    row = ledger.get(new.id)
    assert row is not None
    assert row.secret_ciphertext is None and row.secret_wrapped_key is None
    receipt = Receipt.of(row)
    assert receipt is not None and receipt.status == "cancelled"
    # Handled when it was cancelled, by the database's clock.
    assert receipt.handled_at is not None and before <= receipt.handled_at <= after


@pytest.mark.parametrize("attempt", [1, 2], ids=["first attempt", "a retry"])
def test_a_run_cancelled_between_its_claim_and_its_rate_set_back_never_runs(
    ledger: Ledger, attempt: int
) -> None:
    # Review finds: the rate limit sets a claimed run back unrun; a cancel in between
    # finds it active and only marks it, so the set-back must not make it claimable; and
    # its end is the record of a run that never was (the attempt it took given back, a
    # retry's error kept), not of a completion.
    new = _row(ledger)
    if attempt == 2:
        first = ledger.claims.claim(new.id, "job", 1, 30)
        assert first.token is not None
        assert ledger.claims.retry(
            new.id, first.token, retry_in=0, relay_in=3600, error="RuntimeError"
        )
    claim = ledger.claims.claim(new.id, "job", attempt, 30)
    assert claim.outcome == "claimed" and claim.token is not None
    assert Cancellation(ledger, None).cancel(new.id) is True  # found active: marked
    assert ledger.limits.wait_for_rate(new.id, claim.token, retry_in=0, relay_in=0) is None
    assert ledger.get(new.id).status == "active"  # type: ignore[union-attr]
    # The claimer ends it, unrun: the run side of that set-back.
    ended = ledger.claims.end_unrun(new.id, claim.token)
    assert ended is not None and ended.status == "cancelled"
    assert ended.attempt == attempt - 1
    assert ended.last_error == (None if attempt == 1 else "RuntimeError")
    assert (ended.started_at is None) == (attempt == 1)
    assert ended.finished_at is not None and ended.claim_token is None
    assert ledger.claims.claim(new.id, "job", attempt, 30, any_time=True).outcome == "done"
    # Only a marked run's claimer ends it so: not an unmarked run, not a lost claim.
    other = _row(ledger)
    held = ledger.claims.claim(other.id, "job", 1, 30)
    assert held.token is not None
    assert ledger.claims.end_unrun(other.id, held.token) is None
    assert ledger.claims.end_unrun(new.id, claim.token) is None
    assert ledger.get(other.id).status == "active"  # type: ignore[union-attr]


def test_a_claim_read_back_after_a_cancel_marked_it_never_runs_its_handler(
    proxy: FaultProxy, via_proxy: StackFactory
) -> None:
    """Review find: the claim commits, its reply is lost and the ledger stays out of reach
    for seconds; meanwhile a cancel finds the row active, marks it and returns True. The
    worker's next try reads its own claim back, with the mark on it: its handler has not
    begun, so it never does, and the dispatch ends cancelled at its first attempt, unrun."""
    stack = via_proxy("redis")
    t = tag()
    dispatch_id, message = held_dispatch(stack, t, retry_limit=0)
    proxy.arm(dispatch_id.encode(), refuse_for=4.0)
    deliver(stack, message)
    assert proxy.fired.wait(20), "the worker never sent its claim"
    stack.wait_status(dispatch_id, "active", timeout=5)
    assert stack.runs(t) == []  # the handler has not begun
    assert Cancellation(stack.ledger, None).cancel(dispatch_id) is True
    ended = stack.wait_status(dispatch_id, "cancelled", timeout=40)
    assert (ended.attempt, ended.started_at) == (0, None)
    assert stack.runs(t) == []
    told = stack.worker.log_about(dispatch_id)
    assert any("cancelled before it started" in line for line in told)
