"""The operator's view: list, show, stuck, failed, counts and requeue, in Python and on the
command line, on a real PostgreSQL ledger and a real worker."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from questpie_celery import PublishOptionsError
from questpie_celery.cli.commands import main
from questpie_celery.ledger import dispatch_table
from tests.integration.conftest import StackFactory
from tests.support.stack import Stack, tag

SECRET = "o" * 40


@pytest.fixture
def stack(make_stack: StackFactory) -> Stack:
    return make_stack("redis", env={"QP_TEST_SECRET": SECRET, "QP_TEST_RELAY": "0.3"})


def set_row(stack: Stack, dispatch_id: str, **values: object) -> None:
    with stack.ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table).where(dispatch_table.c.id == dispatch_id).values(**values)
        )


def test_list_filters_and_pages_newest_first(stack: Stack) -> None:
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    ids = [
        stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}", queue=idle)
        for n in range(5)
    ]
    other = stack.questpie.queue.send_welcome_email.publish(
        {"tag": t}, idempotency_key=f"{t}:other", queue=idle
    )
    operator = stack.questpie.operator
    first = operator.dispatches(job="record", limit=3)
    second = operator.dispatches(job="record", limit=3, after=first[-1])
    assert [d.dispatch_id for d in first + second] == list(reversed(ids))
    assert operator.dispatches(key=f"{t}:other")[0].dispatch_id == other
    assert {d.status for d in operator.dispatches(status="pending")} <= {"pending"}
    assert operator.dispatches(job="record", older_than=3600) == []
    with pytest.raises(PublishOptionsError):
        operator.dispatches(limit=0)


def test_show_holds_everything_but_a_secret(stack: Stack) -> None:
    t = tag()
    canary = f"canary-{uuid.uuid4().hex}"
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    plain = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"{t}:p", queue=idle, priority=7
    )
    secret = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": canary}, idempotency_key=f"{t}:s", secret_payload=True, queue=idle
    )
    assert plain is not None and secret is not None
    shown = stack.questpie.operator.show(plain)
    assert shown is not None
    assert (shown.payload or {})["tag"] == t
    assert (shown.priority, shown.queue, shown.retry_limit, shown.secret) == (7, idle, 2, False)
    hidden = stack.questpie.operator.show(secret)
    assert hidden is not None
    assert (hidden.payload, hidden.secret, hidden.key_erased) == (None, True, False)
    for args in (["show", secret], ["list", "--job", "secret.link"]):
        result = CliRunner().invoke(
            main, ["dispatches", *args, "--json", "--ledger-url", stack.env["QP_TEST_LEDGER"]]
        )
        assert result.exit_code == 0, result.output
        assert secret in result.output
        assert canary not in result.output
    assert stack.questpie.operator.show("no-such-id") is None


def test_stuck_names_each_reason(make_stack: StackFactory) -> None:
    # No worker, so no relay repairs these states while the test looks at them.
    stack = make_stack("redis", start_worker=False)
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    publish = stack.questpie.queue.record.publish
    never_sent, lapsed, unclaimed = (
        publish({"tag": t}, idempotency_key=f"{t}:{n}", queue=idle) for n in range(3)
    )
    assert never_sent and lapsed and unclaimed
    # The broker's acceptance is written off the publish path: let it land first, or
    # it would turn the `pending` row set below back into `queued`.
    stack.questpie.close()
    long_ago = datetime.now(UTC) - timedelta(hours=3)
    # States a relay would repair at once, set up behind its back.
    set_row(stack, never_sent, status="pending", next_send_at=long_ago, queued_at=None)
    set_row(stack, lapsed, status="active", attempt=1, claim_token="x", lease_expires_at=long_ago)
    set_row(stack, unclaimed, status="queued", queued_at=long_ago, next_send_at=long_ago)
    found = {d.dispatch_id: reason for reason, d in stack.questpie.operator.stuck()}
    assert found.get(never_sent) == "never sent"
    assert found.get(lapsed) == "lease lapsed"
    assert found.get(unclaimed) == "accepted, never claimed"
    result = CliRunner().invoke(
        main, ["dispatches", "stuck", "--json", "--ledger-url", stack.env["QP_TEST_LEDGER"]]
    )
    assert result.exit_code == 0, result.output
    reasons = {row["dispatch_id"]: row["reason"] for row in json.loads(result.output)}
    assert reasons.get(lapsed) == "lease lapsed"


def test_a_failed_dispatch_is_requeued_and_runs_again(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"{t}:req", retry_limit=0
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "failed")
    failed = stack.questpie.operator.failed(job="record")
    assert dispatch_id in [d.dispatch_id for d in failed]
    assert next(d for d in failed if d.dispatch_id == dispatch_id).last_error == "RuntimeError"
    result = CliRunner().invoke(
        main, ["dispatches", "requeue", dispatch_id, "--ledger-url", stack.env["QP_TEST_LEDGER"]]
    )
    assert result.exit_code == 0, result.output
    # The worker's relay sends it; attempt 2 no longer fails.
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 2
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]
    # Only a failed dispatch can be requeued; its key still answers with its id.
    with pytest.raises(PublishOptionsError, match="not failed"):
        stack.questpie.operator.requeue(dispatch_id)
    assert (
        stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}:req") == dispatch_id
    )


def test_a_failed_secret_dispatch_cannot_be_requeued(stack: Stack) -> None:
    t = tag()
    dispatch_id = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": "x", "permanent": True}, idempotency_key=f"{t}:s", secret_payload=True
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "failed")
    with pytest.raises(PublishOptionsError, match="erased"):
        stack.questpie.operator.requeue(dispatch_id)
    assert stack.row(dispatch_id).status == "failed"


def test_counts_per_job_and_status(stack: Stack) -> None:
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    for n in range(3):
        stack.questpie.queue.send_welcome_email.publish(
            {"tag": t}, idempotency_key=f"{t}:{n}", queue=idle
        )
    counts = {(c.job_name, c.status): c for c in stack.questpie.operator.counts()}
    waiting = sum(
        counts[("send-welcome-email", s)].count
        for s in ("pending", "queued")
        if ("send-welcome-email", s) in counts
    )
    assert waiting == 3
    result = CliRunner().invoke(
        main, ["dispatches", "counts", "--json", "--ledger-url", stack.env["QP_TEST_LEDGER"]]
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert sum(r["count"] for r in rows if r["job_name"] == "send-welcome-email") == 3
