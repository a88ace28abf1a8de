"""The execution fence against hostile and unusual deliveries, on Redis and RabbitMQ.

A message that borrows another job's dispatch id, a duplicate of a failed
dispatch under `task_track_started`, handlers that raise `SystemExit` or
`asyncio.CancelledError`, and a retry of a delivery that carried custom headers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from sqlalchemy import select

from questpie_celery.send.broker import MessageHeader
from questpie_celery.worker.fence import EARLY_WAIT_SECONDS
from tests.integration.conftest import StackFactory, new_stack
from tests.support import jobapp
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.services import RedisServer
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

SECRET = "f" * 16 + "-fence-secret-0123456789abcdef"
REQUEST_ID = "req-4711"


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def fence_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A secret, a Redis result backend (on RabbitMQ too), and task_track_started on."""
    env = {"QP_TEST_SECRET": SECRET, "QP_TEST_EXTENDED": "1"}
    if request.param == "rabbitmq":
        redis_server: RedisServer = request.getfixturevalue("redis_server")
        env["QP_TEST_BACKEND"] = redis_server.url(redis_server.new_db())
    made = new_stack(request, tmp_path_factory.mktemp("fence"), request.param, env=env)
    assert made.celery_app.conf.task_track_started is True
    yield made
    made.close()


def runs_of(stack: Stack, dispatch_id: str) -> list[dict[str, Any]]:
    """Every run any job started under one dispatch id."""
    with stack.runs_engine.connect() as conn:
        rows = conn.execute(
            select(jobapp.runs_table)
            .where(
                jobapp.runs_table.c.dispatch_id == dispatch_id,
                jobapp.runs_table.c.phase == "start",
            )
            .order_by(jobapp.runs_table.c.id)
        ).mappings()
        return [dict(r) for r in rows]


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def wait_state(stack: Stack, dispatch_id: str, state: str, timeout: float = 20.0) -> None:
    """Wait for a lasting Celery result state in the result backend."""
    result = AsyncResult(dispatch_id, app=stack.celery_app)
    wait_until(
        lambda: result.state == state,
        f"{dispatch_id}'s result to be {state}",
        timeout,
        0.05,
        explain=lambda: f"it is {result.state}",
    )


def assert_serves_work(stack: Stack) -> None:
    """The worker is alive and still runs a fresh dispatch to completion."""
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"alive:{t}")
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed")
    assert stack.worker.alive()


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "plain"])
def test_a_message_for_another_job_cannot_run_with_a_dispatchs_data(
    fence_stack: Stack, secret: bool
) -> None:
    stack = fence_stack
    t = tag()
    idle = idle_queue()
    link = f"https://example.test/once/{uuid.uuid4().hex}"
    # Job A waits in a queue no worker reads.
    if secret:
        a_id = stack.questpie.queue.secret_link.publish(
            {"tag": t, "link": link}, idempotency_key=f"a:{t}", secret_payload=True, queue=idle
        )
        note = digest(link)
    else:
        a_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"a:{t}", queue=idle)
        note = None
    assert a_id is not None
    before = stack.wait_status(a_id, "queued", timeout=10)
    # A forged message: job B ("permissive", any payload validates) under A's dispatch id,
    # carrying questpie's ledger header.
    stack.celery_app.send_task(
        "permissive",
        args=[{}],
        task_id=a_id,
        headers={"questpie": {"v": 1, "ledgered": True, "attempt": 1, "run": {}}},
    )
    stack.wait_log(a_id, "skipped (unknown)")
    assert runs_of(stack, a_id) == []  # B's handler never ran, with A's data or any other
    row = stack.row(a_id)
    assert (row.status, row.attempt, row.claim_token, row.started_at) == ("queued", 0, None, None)
    assert row.secret_ciphertext == before.secret_ciphertext
    assert row.payload == before.payload
    if secret:
        assert row.secret_ciphertext is not None and row.secret_wrapped_key is not None
    # A's real message still runs A's handler, once.
    deliver(stack, capture(stack, idle))
    done = stack.wait_status(a_id, "completed")
    assert done.attempt == 1
    [run] = runs_of(stack, a_id)
    assert (run["job_name"], run["attempt"], run["tag"]) == (
        "secret.link" if secret else "record", 1, t,
    )  # fmt: skip
    assert run["note"] == note
    # And B never recorded a run whose payload was A's.
    a_payload = {"tag": t, "link": link} if secret else {"tag": t}
    forged_note = digest(json.dumps(a_payload, sort_keys=True))
    with stack.runs_engine.connect() as conn:
        notes = conn.execute(
            select(jobapp.runs_table.c.note).where(jobapp.runs_table.c.job_name == "permissive")
        ).scalars()
        assert forged_note not in set(notes)


def test_a_duplicate_of_a_failed_dispatch_does_not_store_started(fence_stack: Stack) -> None:
    stack = fence_stack
    t = tag()
    idle = idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "permanent": True}, idempotency_key=f"failed-dup:{t}", queue=idle
    )
    assert dispatch_id is not None
    message = capture(stack, idle)
    deliver(stack, message)
    row = stack.wait_status(dispatch_id, "failed")
    assert row.last_error == "PermanentFailure"
    wait_state(stack, dispatch_id, "FAILURE")
    deliver(stack, message)  # the broker delivers it again
    stack.wait_log(dispatch_id, "skipped (done)")
    result = AsyncResult(dispatch_id, app=stack.celery_app)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "PermanentFailure"
    assert len(stack.runs(t)) == 1


def test_system_exit_in_a_handler_is_a_recorded_attempt(fence_stack: Stack) -> None:
    stack = fence_stack
    t = tag()
    # One retry: attempt 1 is recorded and retried, attempt 2 fails for good. The stack's
    # lease is 60 s, longer than this test waits: a lapse cannot be what ends them.
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "raise_base": "SystemExit"}, idempotency_key=f"exit:{t}", retry_limit=1
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed", timeout=40)
    assert (row.attempt, row.last_error) == (2, "SystemExit")
    assert row.lease_expires_at is None
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]
    # Without retries: failed after its one attempt.
    t2 = tag()
    last = stack.questpie.queue.record.publish(
        {"tag": t2, "raise_base": "SystemExit"}, idempotency_key=f"exit0:{t2}", retry_limit=0
    )
    assert last is not None
    row = stack.wait_status(last, "failed", timeout=40)
    assert (row.attempt, row.last_error) == (1, "SystemExit")
    assert [r["attempt"] for r in stack.runs(t2)] == [1]
    assert_serves_work(stack)


def test_cancelled_error_in_a_handler_is_a_recorded_failure(fence_stack: Stack) -> None:
    stack = fence_stack
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "raise_base": "CancelledError"}, idempotency_key=f"cancel:{t}", retry_limit=0
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "failed", timeout=40)
    assert (row.attempt, row.last_error) == (1, "CancelledError")
    assert [r["attempt"] for r in stack.runs(t)] == [1]
    wait_state(stack, dispatch_id, "FAILURE")
    assert type(AsyncResult(dispatch_id, app=stack.celery_app).result).__name__ == (
        "HandlerAbortedError"
    )
    assert_serves_work(stack)


def test_a_retry_keeps_the_deliverys_custom_headers(fence_stack: Stack) -> None:
    stack = fence_stack
    t = tag()
    idle = idle_queue()
    # Published to an idle queue: the retry of the delivery goes to that queue as well,
    # where the test can read it.
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"headers:{t}", queue=idle
    )
    assert dispatch_id is not None
    first = capture(stack, idle)
    assert "x-request-id" not in first.headers
    first.headers["x-request-id"] = (
        REQUEST_ID  # a custom header, added on the way (a tracing context, say)
    )
    deliver(stack, first)
    stack.wait_status(dispatch_id, "retry")
    retry = capture(stack, idle)
    assert (retry.headers["id"], retry.headers["task"]) == (dispatch_id, "record")
    assert retry.headers["questpie"]["attempt"] == 2
    assert retry.headers.get("x-request-id") == REQUEST_ID
    deliver(stack, retry)
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 2
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]


def _forge_first_attempt(stack: Stack, job_name: str, dispatch_id: str) -> None:
    """A message for attempt 1 of a dispatch, as anyone with the broker could send it:
    the dispatch's id and questpie's ledger header."""
    stack.celery_app.send_task(
        job_name,
        args=[{}],
        task_id=dispatch_id,
        headers={"questpie": {"v": 1, "ledgered": True, "attempt": 1, "run": {}}},
    )


def _publish_delayed(stack: Stack, secret: bool, t: str, start_after: float) -> tuple[str, str]:
    """(job name, dispatch id) of a keyed dispatch that starts `start_after` s from now."""
    link = f"https://example.test/once/{uuid.uuid4().hex}"
    if secret:
        dispatch_id = stack.questpie.queue.secret_link.publish(
            {"tag": t, "link": link},
            idempotency_key=f"early:{t}",
            secret_payload=True,
            start_after=start_after,
        )
        job_name = "secret.link"
    else:
        dispatch_id = stack.questpie.queue.record.publish(
            {"tag": t}, idempotency_key=f"early:{t}", start_after=start_after
        )
        job_name = "record"
    assert dispatch_id is not None
    return job_name, dispatch_id


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "plain"])
def test_a_forged_copy_runs_nothing_before_the_dispatch_is_due(
    fence_stack: Stack, secret: bool
) -> None:
    stack = fence_stack
    t = tag()
    job_name, dispatch_id = _publish_delayed(stack, secret, t, start_after=600)
    before = stack.row(dispatch_id)
    assert before.status == "pending" and before.next_send_at is not None
    _forge_first_attempt(stack, job_name, dispatch_id)
    stack.wait_log(dispatch_id, "before the row is due; dropped")
    assert runs_of(stack, dispatch_id) == []  # not run, and a secret not decrypted
    # The row is as it was, its secret with it; the relay still sends it 60 s before
    # its start, as planned.
    assert stack.row(dispatch_id) == before
    if secret:
        assert before.secret_ciphertext is not None and before.secret_wrapped_key is not None


@pytest.mark.parametrize("secret", [True, False], ids=["secret", "plain"])
@pytest.mark.parametrize("start_after", [8.0, 2.0], ids=["too-early", "a-little-early"])
def test_a_dispatch_due_soon_runs_once_on_time_whatever_copy_comes_first(
    fence_stack: Stack, secret: bool, start_after: float
) -> None:
    """Its own message is a broker ETA; a forged copy comes at once. One too early is
    dropped (and the row made due for the relay at its start); one a little early waits
    for the start. Either way, one run, not before the start."""
    stack = fence_stack
    t = tag()
    job_name, dispatch_id = _publish_delayed(stack, secret, t, start_after=start_after)
    _forge_first_attempt(stack, job_name, dispatch_id)
    if start_after > EARLY_WAIT_SECONDS:
        stack.wait_log(dispatch_id, "before the row is due; dropped")
        assert runs_of(stack, dispatch_id) == []
        row = stack.row(dispatch_id)
        assert row.next_send_at is not None and row.next_send_at <= row.run_after
    row = stack.wait_status(dispatch_id, "completed", timeout=40)
    assert row.started_at is not None and row.started_at >= row.run_after
    assert [r["attempt"] for r in runs_of(stack, dispatch_id)] == [1]
    # Whatever copy comes later (the ETA message, a relay send) runs nothing more.
    stack.wait_log(dispatch_id, "skipped (")
    assert [r["attempt"] for r in runs_of(stack, dispatch_id)] == [1]


# --- malformed headers ---------------------------------------------------------------------

#: Values that may stand where questpie writes another (AMQP and JSON can carry them all).
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(0, 9), max_size=2),
)


def _not(good: Any) -> st.SearchStrategy[Any]:
    """Any value `good` is not, of any type (a bool is not an int here)."""
    return junk.filter(lambda v: type(v) is not type(good) or v != good)


def _spoil(field: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A header questpie writes, with one field spoiled (or, for None, dropped)."""
    return value.map(lambda bad: (field, bad))


spoilers = st.one_of(
    _spoil("v", _not(1)),
    _spoil("ledgered", junk.filter(lambda v: not isinstance(v, bool))),
    _spoil(
        "attempt",
        st.one_of(
            junk.filter(lambda v: type(v) is not int),
            st.integers(-(2**62), 0),
            st.integers(2**31, 2**62),
        ),
    ),
    _spoil("run", junk.filter(lambda v: not isinstance(v, dict))),
    _spoil("run.retry_limit", st.one_of(st.integers(-(2**62), -1), st.text(max_size=5))),
    _spoil("run.retry_delay", st.one_of(st.floats(max_value=-0.001), st.just(math.nan))),
    _spoil("run.retry_backoff", junk.filter(lambda v: not isinstance(v, bool))),
    _spoil("run.expire_in_seconds", st.one_of(st.integers(-5, 0), st.integers(10**6, 2**62))),
    _spoil("token", st.one_of(st.text(max_size=40), st.integers(), st.booleans())),
    _spoil("sent", st.one_of(st.floats(max_value=0), st.text(max_size=5), st.booleans())),
    _spoil("header", junk.filter(lambda v: not isinstance(v, dict) and v is not None)),
)


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _spoiled(good: dict[str, Any], field: str, bad: Any) -> Any:
    if field == "header":
        return bad
    header = {**good, "run": dict(good["run"])}
    if field.startswith("run."):
        header["run"][field[4:]] = bad
    elif bad is None and field in header:
        del header[field]
    else:
        header[field] = bad
    return header


@given(spoiler=spoilers)
@example(spoiler=("attempt", 2**40))  # once a raw NumericValueOutOfRange from the database
@example(spoiler=("v", 2))
@example(spoiler=("token", "not-a-token"))
@example(spoiler=("run.expire_in_seconds", 0))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_malformed_header_runs_nothing_and_leaves_the_row_to_its_own_message(
    fence_stack: Stack, spoiler: tuple[str, Any]
) -> None:
    stack = fence_stack
    if stack.broker == "rabbitmq" and _non_finite(spoiler[1]):
        # RabbitMQ closes the connection on a non-finite double in a header table, after
        # the publish returned: no such message can reach a worker there.
        reject()
    t, idle = tag(), idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"malformed:{t}", queue=idle
    )
    assert dispatch_id is not None
    message = capture(stack, idle)
    before = stack.wait_status(dispatch_id, "queued")
    good = message.headers["questpie"]
    assert MessageHeader.parse(good).ledgered  # what questpie sent reads back
    forged = copy.copy(message)
    forged.headers = {**message.headers, "questpie": _spoiled(good, *spoiler)}
    try:
        deliver(stack, forged)
    except Exception:
        reject()  # the broker cannot carry it (an AMQP header of a type it lacks)
    stack.wait_log(dispatch_id, "questpie header is malformed")
    assert runs_of(stack, dispatch_id) == []
    assert stack.row(dispatch_id) == before  # untouched: no claim, no error recorded
    lines = stack.worker.log_about(dispatch_id)
    assert not any("raised unexpected" in line or "LedgerError" in line for line in lines)
    # The dispatch's own message still runs it, once.
    deliver(stack, message)
    assert stack.wait_status(dispatch_id, "completed").attempt == 1
    assert [r["attempt"] for r in runs_of(stack, dispatch_id)] == [1]
    assert stack.worker.alive()


def test_a_run_that_lost_its_claim_cannot_write_over_its_retry_with_the_fencing_token(
    make_stack: StackFactory,
) -> None:
    """On a pool that cannot end one run alone (threads), a run past its time cap goes on
    after its claim lapsed and its retry ran. The store the handler writes to takes
    `ctx.fencing_token` with each write and refuses a smaller one than it has seen: the
    late run's write is refused, the retry's stands, and the ledger keeps the retry's
    outcome."""
    stack = make_stack("redis", env={"QP_TEST_LEASE": "3", "QP_TEST_RELAY": "0.5"}, pool="threads")
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.fenced_capped.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed", timeout=60)  # the retry, beside the first
    gate.open()
    ends = stack.wait_ends(t, 2)
    assert [(r["attempt"], r["note"]) for r in ends] == [
        (2, "token=2 taken=True"),
        (1, "token=1 taken=False"),
    ]
    with stack.runs_engine.connect() as conn:
        stored = conn.execute(
            select(jobapp.fenced_table.c.value, jobapp.fenced_table.c.token).where(
                jobapp.fenced_table.c.key == dispatch_id
            )
        ).one()
    assert tuple(stored) == ("attempt 2", 2)
    row = stack.row(dispatch_id)
    assert (row.status, row.attempt) == ("completed", 2)
