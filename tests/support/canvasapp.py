"""Adopted tasks (`base=LedgerTask`) for the durable Canvas tests: chord members that
return their index, fail, or wait at a gate; a body and an errback that record what
they were given; a chain's step; a batch's completion callback. Each run is recorded in
`test_runs` (`note`), its arguments as JSON in the note where a test reads them."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from typing import Any

from celery import Task, shared_task

from questpie_celery import LedgerTask
from tests.support.adoptedapp import note
from tests.support.jobapp import wait_at


@shared_task(bind=True, base=LedgerTask, name="canvas.member")
def member(
    self: Task,
    index: int,
    tag: str,
    fail: bool = False,
    gate: str | None = None,
    die_once: str | None = None,
) -> int:
    """Returns `index * 10`; `fail` fails it for good; `die_once` (a file) kills its pool
    process on the first run that finds the file, which it removes."""
    note(self, tag, note=str(index))
    if die_once is not None and os.path.exists(die_once):
        os.remove(die_once)
        os.kill(os.getpid(), signal.SIGKILL)
    wait_at(gate)
    if fail:
        raise ValueError(f"member {index} failed")
    note(self, tag, phase="end", note=str(index))
    return index * 10


@shared_task(bind=True, base=LedgerTask, name="canvas.body")
def body(self: Task, results: list[Any], tag: str) -> int:
    """Records the results it was given."""
    note(self, tag, phase="body", note=json.dumps(results, separators=(",", ":")))
    return len(results)


@shared_task(bind=True, base=LedgerTask, name="canvas.errback")
def errback(self: Task, failed_member: str, tag: str) -> None:
    note(self, tag, phase="errback", note=failed_member)


@shared_task(bind=True, base=LedgerTask, name="canvas.step")
def step(self: Task, value: int, tag: str, gate: str | None = None) -> int:
    """One link of a chain: records the value it was given, returns it plus one."""
    note(self, tag, note=str(value))
    wait_at(gate)
    return value + 1


@shared_task(bind=True, base=LedgerTask, name="canvas.on_complete")
def on_complete(self: Task, summary: dict[str, Any], tag: str) -> None:
    """Records the summary, its ids as a digest (a note holds 200 characters)."""
    ids = hashlib.sha256(json.dumps(summary["ids"]).encode()).hexdigest()[:16]
    note(
        self, tag, phase="complete", note=json.dumps([summary["batch_id"], summary["counts"], ids])
    )
