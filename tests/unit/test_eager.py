"""`task_always_eager=True`: publish() runs the handler inline, through the same fence and ledger.

Many Celery projects' test suites set eager mode; adopting publish() must keep them
working, with the same ids, keys, policies, retries and secrets as a real worker.
The ledger here is a real SQLite file.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from questpie_celery import JobContext, PermanentFailure, Questpie, derive_dispatch_id, job
from questpie_celery.ledger import open_ledger

SECRET = "e" * 40


class Order(BaseModel):
    order_id: str
    fail_times: int = 0
    permanent: bool = False
    reenqueue: bool = False


runs: list[tuple[str, str, int]] = []  # (job, dispatch id, attempt)
nested: list[str | None] = []


@job(name="eager.charge", schema=Order, options={"retry_limit": 2})
def charge(payload: Order, ctx: JobContext) -> str:
    runs.append((ctx.job_name, ctx.dispatch_id, ctx.attempt))
    if payload.permanent:
        raise PermanentFailure("card declined")
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("gateway timeout")
    return payload.order_id


@job(name="eager.sync", schema=Order, options={"queue_policy": "exclusive"})
def sync(payload: Order, ctx: JobContext) -> None:
    runs.append((ctx.job_name, ctx.dispatch_id, ctx.attempt))
    if payload.reenqueue:
        # While this run holds the exclusive slot, the same job cannot be accepted again.
        nested.append(questpie_of_test[0].queue.eager_sync.publish({"order_id": "inner"}))


questpie_of_test: list[Questpie] = []


@pytest.fixture
def questpie(tmp_path: Path) -> Iterator[Questpie]:
    app = Celery("eager", broker="memory://")
    app.conf.task_always_eager = True
    made = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}", jobs=[charge, sync],
                    secret=SECRET)  # fmt: skip
    made.migrate()
    runs.clear()
    nested.clear()
    questpie_of_test[:] = [made]
    yield made
    made.close()


def test_unkeyed_publish_runs_inline_under_its_id(questpie: Questpie) -> None:
    dispatch_id = questpie.queue.eager_charge.publish({"order_id": "o1"})
    assert runs == [("eager.charge", dispatch_id, 1)]
    assert questpie.queue.get_status(dispatch_id or "") is None  # no ledger row


def test_a_repeated_key_runs_once(questpie: Questpie) -> None:
    first = questpie.queue.eager_charge.publish({"order_id": "o2"}, idempotency_key="k")
    again = questpie.queue.eager_charge.publish({"order_id": "o2"}, idempotency_key="k")
    assert first == again == derive_dispatch_id("eager.charge", "k")
    assert runs == [("eager.charge", first, 1)]
    status = questpie.queue.get_status(first or "")
    assert status is not None
    assert (status.status, status.attempt) == ("completed", 1)


def test_retries_run_inline_and_count_attempts(questpie: Questpie) -> None:
    dispatch_id = questpie.queue.eager_charge.publish(
        {"order_id": "o3", "fail_times": 2}, idempotency_key="retry", retry_delay=600
    )
    # The 600 s delay would wait in the ledger for the relay; eager mode runs it at once,
    # as Celery's own eager mode ignores countdowns.
    assert [r[2] for r in runs] == [1, 2, 3]
    status = questpie.queue.get_status(dispatch_id or "")
    assert status is not None
    assert (status.status, status.attempt, status.last_error) == ("completed", 3, None)


def test_a_later_start_runs_at_once_as_celerys_eager_mode_runs_an_eta(
    questpie: Questpie,
) -> None:
    # A worker's fence runs nothing before the row is due; eager mode has no later.
    dispatch_id = questpie.queue.eager_charge.publish(
        {"order_id": "o5"}, idempotency_key="later", start_after=600
    )
    assert runs == [("eager.charge", dispatch_id, 1)]
    status = questpie.queue.get_status(dispatch_id or "")
    assert status is not None and status.status == "completed"


def test_permanent_failure_is_recorded(questpie: Questpie) -> None:
    dispatch_id = questpie.queue.eager_charge.publish(
        {"order_id": "o4", "permanent": True}, idempotency_key="perm"
    )
    status = questpie.queue.get_status(dispatch_id or "")
    assert status is not None
    assert (status.status, status.attempt, status.last_error) == ("failed", 1, "PermanentFailure")


def test_eager_propagates_raises_after_the_ledger_recorded_the_failure(
    questpie: Questpie,
) -> None:
    questpie.celery_app.conf.task_eager_propagates = True
    with pytest.raises(PermanentFailure):
        questpie.queue.eager_charge.publish(
            {"order_id": "o5", "permanent": True}, idempotency_key="prop"
        )
    status = questpie.queue.get_status(derive_dispatch_id("eager.charge", "prop"))
    assert status is not None
    assert status.status == "failed"


def test_policy_holds_inline(questpie: Questpie) -> None:
    outer = questpie.queue.eager_sync.publish({"order_id": "outer", "reenqueue": True})
    assert outer is not None
    assert nested == [None]  # suppressed: the outer run held the exclusive slot
    assert [r[0] for r in runs] == ["eager.sync"]
    # With the slot free again, the job is accepted and runs.
    assert questpie.queue.eager_sync.publish({"order_id": "later"}) is not None
    assert len(runs) == 2


def test_plain_delay_of_a_policy_job_goes_through_the_ledger(questpie: Questpie) -> None:
    result = questpie.tasks["eager.sync"].delay({"order_id": "plain"})
    assert [r[1] for r in runs] == [result.id]
    status = questpie.queue.get_status(result.id)
    assert status is not None and status.status == "completed"


def test_secret_payload_runs_inline_and_its_key_is_erased(
    questpie: Questpie, tmp_path: Path
) -> None:
    dispatch_id = questpie.queue.eager_charge.publish(
        {"order_id": "secret-order"}, idempotency_key="s", secret_payload=True
    )
    receipt = questpie.queue.get_receipt(dispatch_id or "")
    assert receipt is not None and receipt.status == "completed"
    ledger = open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    row = ledger.get(dispatch_id or "")
    ledger.close()
    assert row is not None
    assert (row.payload, row.secret_ciphertext, row.secret_wrapped_key) == (None, None, None)


def test_publish_many_runs_each_new_key_inline_once(questpie: Questpie) -> None:
    charge_client = questpie.queue.eager_charge
    ids = charge_client.publish_many(
        [{"order_id": "m1"}, {"order_id": "m2"}, {"order_id": "m1"}, {"order_id": "m3"}],
        idempotency_keys=["m1", "m2", "m1", None],
    )
    assert ids[0] == ids[2] == derive_dispatch_id("eager.charge", "m1")
    assert ids[1] == derive_dispatch_id("eager.charge", "m2")
    assert [r[1] for r in runs] == [ids[0], ids[1], ids[3]]
    again = charge_client.publish_many([{"order_id": "m1"}], idempotency_keys=["m1"])
    assert again == [ids[0]] and len(runs) == 3


def test_publish_many_decides_each_item_after_the_one_before_ran(questpie: Questpie) -> None:
    # Inline, each accepted run ends before the next item is published, as with a loop of
    # publish(): the exclusive slot is free again for the second item.
    ids = questpie.queue.eager_sync.publish_many([{"order_id": "a"}, {"order_id": "b"}])
    assert None not in ids
    assert [r[1] for r in runs] == ids


class Named(BaseModel):
    name: str


class Exit(BaseModel):
    code: int


stepped: list[str] = []


@job(name="eager.step", schema=Named, options={"retry_limit": 0})
def step(payload: Named, ctx: JobContext) -> None:
    stepped.append(payload.name)
    if payload.name.startswith("bad"):
        raise PermanentFailure(f"{payload.name} refused")


@job(name="eager.exit", schema=Exit, options={"retry_limit": 0})
def leave(payload: Exit, ctx: JobContext) -> None:
    raise SystemExit(payload.code)


@pytest.fixture
def propagating(tmp_path: Path) -> Iterator[tuple[Questpie, str]]:
    """An eager Questpie whose handler errors propagate to the caller; its ledger URL."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    app = Celery("eager-propagates", broker="memory://")
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    made = Questpie(app, ledger_url=url, jobs=[step, leave])
    made.migrate()
    stepped.clear()
    yield made, url
    made.close()


def test_a_failing_eager_run_after_commit_does_not_strand_the_commits_others(
    propagating: tuple[Questpie, str],
) -> None:
    """publish(session=...) runs a commit's dispatches in the Session's after-commit
    hook; with task_eager_propagates the first handler error is raised from commit()
    only after every dispatch of the commit ran. Before the fix the first error stopped
    the loop and the others stayed `pending` for good (no relay runs in eager tests).
    Two failing dispatches make this independent of the order the rows are read in."""
    questpie, url = propagating
    caller = create_engine(url)
    ids: list[str | None] = []
    try:
        with pytest.raises(PermanentFailure), Session(caller) as session:
            for name in ("bad-1", "bad-2", "good"):
                ids.append(questpie.queue.eager_step.publish({"name": name}, session=session))
            session.commit()
    finally:
        caller.dispose()
    assert sorted(stepped) == ["bad-1", "bad-2", "good"]
    statuses = []
    for dispatch_id in ids:
        assert dispatch_id is not None
        status = questpie.queue.get_status(dispatch_id)
        assert status is not None
        statuses.append(status.status)
    assert statuses == ["failed", "failed", "completed"]


def test_a_handler_s_system_exit_keeps_its_exit_code(propagating: tuple[Questpie, str]) -> None:
    """The fence records a handler's SystemExit as a failed attempt, then lets the
    process stop as asked, with the exit code the handler gave. Before the fix it raised
    a new SystemExit() without arguments: exit code 0, a clean exit."""
    questpie, _ = propagating
    with pytest.raises(SystemExit) as raised:
        questpie.queue.eager_exit.publish({"code": 3}, idempotency_key="exit")
    assert raised.value.code == 3


awaited: list[str] = []


class AsyncCallable:
    """A handler object whose `__call__` is `async def`."""

    async def __call__(self, payload: Named, ctx: JobContext) -> str:
        await asyncio.sleep(0)
        awaited.append(f"object {payload.name}")
        return payload.name


async def _notify(payload: Named, ctx: JobContext) -> str:
    await asyncio.sleep(0)
    awaited.append(f"wrapped {payload.name}")
    return payload.name


@functools.wraps(_notify)
def _plain_wrapper(payload: Named, ctx: JobContext) -> Any:
    return _notify(payload, ctx)  # a sync decorator's wrapper: returns the coroutine


async_object = job(name="eager.async-object", schema=Named)(AsyncCallable())
async_wrapped = job(name="eager.async-wrapped", schema=Named)(_plain_wrapper)


@pytest.mark.parametrize("job_name", ["eager.async-object", "eager.async-wrapped"])
def test_a_handler_that_is_async_without_looking_so_runs_to_its_end(
    tmp_path: Path, job_name: str
) -> None:
    """Before, the coroutine such a handler returns was dropped unawaited: the dispatch
    was recorded completed although its body never ran."""
    app = Celery("eager-async-shapes", broker="memory://")
    app.conf.task_always_eager = True
    made = Questpie(
        app, ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}", jobs=[async_object, async_wrapped]
    )
    made.migrate()
    awaited.clear()
    try:
        dispatch_id = made.queue[job_name].publish({"name": "n1"}, idempotency_key="k")
        assert dispatch_id is not None
        status = made.queue.get_status(dispatch_id)
        assert status is not None and status.status == "completed"
        assert awaited == [f"{'object' if 'object' in job_name else 'wrapped'} n1"]
        # A plain Celery call of the task (no ledger) runs it to its end too.
        made.queue["eager.async-wrapped"].task.delay({"name": "n2"})
        assert awaited[-1] == "wrapped n2"
    finally:
        made.close()


@pytest.mark.parametrize(
    ("args", "kwargs", "hint"),
    [
        ((), {"sku": "a"}, r"args=\[\{\.\.\.\}\], not keywords \(sku\)"),
        ((), {}, r"one positional argument, its payload: args=\[\{\.\.\.\}\]"),
        (({"sku": "a"}, "extra"), {}, r"one positional argument"),
    ],
)
def test_a_plain_call_of_a_jobs_task_without_its_payload_is_refused_when_sent(
    questpie: Questpie, args: tuple[Any, ...], kwargs: dict[str, Any], hint: str
) -> None:
    """Sent as it is, every delivery would fail at the worker: the call is refused at
    once, saying how a job's task takes its payload."""
    with pytest.raises(TypeError, match=hint):
        questpie.tasks["eager.charge"].apply_async(args, kwargs)
