"""Regression tests for the review's findings that need no servers (R9, R10): eager
mode (`task_always_eager`, `task_eager_propagates`) on a real SQLite ledger file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType

import pytest
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from questpie_celery import JobContext, PermanentFailure, Questpie, SecretJobError, job

CANARY = "https://example.test/one-time/CANARY-7f3a9c"
ran: list[str] = []


class Link(BaseModel):
    link: str


class Named(BaseModel):
    name: str


@job(name="review.leaky", schema=Link, options={"retry_limit": 0})
def leaky(payload: Link, ctx: JobContext) -> None:
    raise RuntimeError(f"mail server rejected {payload.link}")


@job(name="review.step", schema=Named, options={"retry_limit": 0})
def step(payload: Named, ctx: JobContext) -> None:
    ran.append(payload.name)
    if payload.name.startswith("bad"):
        raise PermanentFailure(f"{payload.name} refused")


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[tuple[Questpie, str]]:
    """An eager Questpie whose handler errors propagate to the caller; its ledger URL."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    app = Celery("review-eager", broker="memory://")
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    made = Questpie(app, ledger_url=url, secret="s" * 40, jobs=[leaky, step])
    made.migrate()
    ran.clear()
    yield made, url
    made.close()


def run_frames(tb: TracebackType | None) -> list[FrameType]:
    """The traceback's frames from Celery's task tracer down to the raise: what a worker's
    task_failure receivers and error trackers see (in eager mode the frames above are
    the publisher's, which holds its caller's own payload)."""
    frames: list[FrameType] = []
    while tb is not None:
        if frames or tb.tb_frame.f_code.co_filename.endswith("celery/app/trace.py"):
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def test_r9_no_frame_of_a_failed_secret_run_holds_the_plaintext(
    eager: tuple[Questpie, str],
) -> None:
    """R9: the SecretJobError Celery receives for a secret run carries no plaintext in
    its message, cause, context or the locals of its traceback's frames. Before the fix
    it was raised in fence.run, whose frame still held the decrypted payload (`model`)
    and the handler's own exception (`failure`), message and all."""
    questpie, _ = eager
    with pytest.raises(SecretJobError) as raised:
        questpie.queue.review_leaky.publish(
            {"link": CANARY}, idempotency_key="r9", secret_payload=True
        )
    error = raised.value
    assert CANARY not in str(error)
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__
    frames = run_frames(error.__traceback__)
    files = [frame.f_code.co_filename for frame in frames]
    assert any(f.endswith("questpie_celery/fence.py") for f in files), files
    leaks = [
        (frame.f_code.co_name, name)
        for frame in frames
        for name, value in frame.f_locals.items()
        if CANARY in repr(value) or CANARY in str(value)
    ]
    assert leaks == []


def test_r10_a_failing_eager_run_after_commit_does_not_strand_the_commits_others(
    eager: tuple[Questpie, str],
) -> None:
    """R10: publish(session=...) runs a commit's dispatches in the Session's after-commit
    hook; with task_eager_propagates the first handler error is raised from commit()
    only after every dispatch of the commit ran. Before the fix the first error stopped
    the loop and the others stayed `pending` for good (no relay runs in eager tests).
    Two failing dispatches make this independent of the order the rows are read in."""
    questpie, url = eager
    caller = create_engine(url)
    ids: list[str | None] = []
    try:
        with pytest.raises(PermanentFailure), Session(caller) as session:
            for name in ("bad-1", "bad-2", "good"):
                ids.append(questpie.queue.review_step.publish({"name": name}, session=session))
            session.commit()
    finally:
        caller.dispose()
    assert sorted(ran) == ["bad-1", "bad-2", "good"]
    statuses = []
    for dispatch_id in ids:
        assert dispatch_id is not None
        status = questpie.queue.get_status(dispatch_id)
        assert status is not None
        statuses.append(status.status)
    assert statuses == ["failed", "failed", "completed"]
