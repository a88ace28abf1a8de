"""Existing Celery tasks adopted where they stand (`base=LedgerTask`), as a project
would have them: `@shared_task`, positional arguments, a dataclass only pickle carries,
`bind=True`, `autoretry_for`. The worker imports this module through the app's
`include`; each run is recorded in `test_runs` as the jobs' runs are.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from celery import Task, shared_task
from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import insert

from questpie_celery import LedgerTask
from tests.support.jobapp import runs_engine, runs_table, wait_at


@dataclass(frozen=True)
class Overrides:
    """A value the JSON serializer cannot carry: the app's pickle serializer does."""

    language: str
    pages: tuple[int, ...] = ()


def note(task: Task, tag: str, phase: str = "start", note: str | None = None) -> None:
    request = task.request
    with runs_engine().begin() as conn:
        conn.execute(
            insert(runs_table).values(
                job_name=task.name,
                tag=tag,
                dispatch_id=request.id,
                attempt=int(request.retries or 0) + 1,
                idempotency_key=None,
                pid=os.getpid(),
                phase=phase,
                note=note,
            )
        )


@shared_task(
    bind=True,
    base=LedgerTask,
    name="adopted.process_document",
    ledger={"idempotency_key": "process:{document_id}"},
)
def process_document(
    self: Task,
    document_id: int,
    overrides: Overrides | None = None,
    *,
    tag: str,
    gate: str | None = None,
) -> dict[str, Any]:
    """Idempotent per document: a double click, a replayed message, run once."""
    note(self, tag, note=None if overrides is None else f"language={overrides.language}")
    wait_at(gate)
    note(self, tag, phase="end")
    return {"document_id": document_id, "language": overrides.language if overrides else None}


@shared_task(
    bind=True,
    base=LedgerTask,
    name="adopted.rebuild_index",
    ledger={"singleton_key": "{index}", "queue_policy": "singleton"},
)
def rebuild_index(self: Task, index: str, tag: str, gate: str | None = None) -> None:
    """Never two at once per index."""
    note(self, tag)
    wait_at(gate)
    time.sleep(0.05)
    note(self, tag, phase="end")


@shared_task(
    bind=True,
    base=LedgerTask,
    name="adopted.charge",
    ledger={"idempotency_key": "charge:{order}", "secret_payload": True},
)
def charge(self: Task, order: str, card: str, tag: str) -> None:
    """Its arguments are secret: they reach this function and nothing else."""
    note(self, tag, note=f"card-length={len(card)}")


@shared_task(
    bind=True,
    base=LedgerTask,
    name="adopted.flaky",
    autoretry_for=(ConnectionError,),
    max_retries=3,
    default_retry_delay=0,
    ledger={"idempotency_key": "flaky:{tag}"},
)
def flaky(self: Task, tag: str, fail_times: int = 0, boom: bool = False) -> int:
    """Fails `fail_times` times with a ConnectionError (retried by `autoretry_for`); with
    `boom`, raises a ValueError, which Celery does not retry."""
    note(self, tag)
    if boom:
        raise ValueError("not retried")
    if self.request.retries < fail_times:
        raise ConnectionError("flaky")
    return int(self.request.retries)


@shared_task(bind=True, base=LedgerTask, name="adopted.asks_retry", max_retries=2)
def asks_retry(self: Task, tag: str, times: int) -> str:
    """Calls `self.retry()` itself `times` times."""
    note(self, tag)
    if self.request.retries < times:
        raise self.retry(countdown=0)
    return "done"


@shared_task(base=LedgerTask, name="adopted.square", ledger={"idempotency_key": "square:{x}:{tag}"})
def square(x: int, tag: str) -> int:
    """A chord member."""
    with runs_engine().begin() as conn:
        conn.execute(
            insert(runs_table).values(
                job_name="adopted.square",
                tag=tag,
                dispatch_id=str(x),
                attempt=1,
                pid=os.getpid(),
                phase="start",
            )
        )
    return x * x


@shared_task(
    bind=True, base=LedgerTask, name="adopted.tracked", ledger={"idempotency_key": "{tag}"}
)
def tracked(self: Task, tag: str, fail_times: int = 0) -> None:
    """Notes the custom header a tracker reads (Celery puts a message's custom headers
    on the request); fails `fail_times` times, retried by `self.retry()`."""
    note(self, tag, note=f"trigger_source={getattr(self.request, 'trigger_source', None)}")
    if self.request.retries < fail_times:
        raise self.retry(countdown=0)


@shared_task(
    base=LedgerTask,
    name="adopted.patient",
    soft_time_limit=1,
    ledger={"idempotency_key": "{tag}"},
)
def patient(tag: str) -> str:
    """Its own soft time limit holds on a ledgered call, as Celery declares it."""
    try:
        time.sleep(5)
    except SoftTimeLimitExceeded:
        return "soft limit"
    return "slept through"


@shared_task(base=LedgerTask, name="adopted.shout", ledger={"idempotency_key": "{word}"})
def shout(word: str) -> str:
    """Touches nothing: called in-process by a test."""
    return word.upper()


@shared_task(name="adopted.total")
def total(results: list[int], tag: str) -> int:
    """A plain Celery chord body."""
    with runs_engine().begin() as conn:
        conn.execute(
            insert(runs_table).values(
                job_name="adopted.total",
                tag=tag,
                dispatch_id="-",
                attempt=1,
                pid=os.getpid(),
                phase="end",
                note=",".join(map(str, results)),
            )
        )
    return sum(results)
