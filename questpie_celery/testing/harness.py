"""What a test reads of its dispatches: `Harness.dispatches(job)`, `Harness.wait_for(id)`.

A ledgered dispatch is read from the ledger. An unledgered one (an unkeyed publish of a
`standard` job, a plain `task.delay()`) is a plain Celery message with no row, so the
harness also watches this process's Celery signals while the test runs: every message of
one of the Questpie's jobs it sends (`before_task_publish`) and every run of one
(`task_prerun`, `task_postrun`, `task_failure`), eager or in the in-process worker. That
gives the unledgered ones a record too, and every dispatch its place in publish order.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import signals

from ..client import JobClient
from ..jobs.definition import JobDefinition
from ..ops.operations import MAX_PAGE
from ..ops.receipts import Dispatch, DispatchDetail

if TYPE_CHECKING:
    from ..app import Questpie

#: What a test may name a job by: its definition, its name, or its queue client.
JobRef = JobDefinition[Any] | JobClient[Any] | str

# Celery's end states of a run, in the ledger's words.
_ENDED_AS = {"SUCCESS": "completed", "FAILURE": "failed", "RETRY": "retry"}


@dataclass
class _Seen:
    """A message or run of one dispatch this process saw."""

    order: int
    id: str
    job_name: str
    payload: dict[str, Any] | None
    status: str = "queued"
    runs: int = 0
    last_error: str | None = None


class _Watcher:
    """Records, from Celery's signals, the messages and runs of the given jobs."""

    def __init__(self, questpie: Questpie) -> None:
        self._questpie = questpie  # its jobs, read at each signal: some register late
        self._seen: dict[str, _Seen] = {}
        self._order = itertools.count()
        self._lock = threading.Lock()  # signals arrive from the worker's threads too
        self._handlers: dict[Any, Callable[..., None]] = {
            signals.before_task_publish: self._published,
            signals.task_prerun: self._started,
            signals.task_postrun: self._ended,
            signals.task_failure: self._failed,
        }
        for signal, handler in self._handlers.items():
            signal.connect(handler, weak=False, dispatch_uid=(id(self), signal.name))

    def close(self) -> None:
        for signal in self._handlers:
            signal.disconnect(dispatch_uid=(id(self), signal.name))

    def seen(self, job_name: str | None = None) -> list[_Seen]:
        with self._lock:
            found = [s for s in self._seen.values() if job_name in (None, s.job_name)]
        return sorted(found, key=lambda s: s.order)

    def get(self, dispatch_id: str) -> _Seen | None:
        with self._lock:
            return self._seen.get(dispatch_id)

    def _note(self, dispatch_id: object, job_name: object, args: object) -> _Seen | None:
        """The record of a dispatch, made when it is first seen; caller holds the lock."""
        if not isinstance(dispatch_id, str) or job_name not in self._questpie.definitions:
            return None
        found = self._seen.get(dispatch_id)
        if found is None:
            first = args[0] if isinstance(args, list | tuple) and args else None
            payload = first if isinstance(first, dict) else None
            found = _Seen(next(self._order), dispatch_id, str(job_name), payload)
            self._seen[dispatch_id] = found
        return found

    def _published(
        self, sender: object = None, body: Any = None, headers: Any = None, **_: Any
    ) -> None:
        args = body[0] if isinstance(body, tuple | list) and body else None  # protocol 2
        with self._lock:
            self._note((headers or {}).get("id"), sender, args)

    def _started(
        self, task_id: object = None, task: Any = None, args: object = None, **_: Any
    ) -> None:
        with self._lock:
            found = self._note(task_id, getattr(task, "name", None), args)
            if found is not None:
                found.runs += 1
                found.status = "active"

    def _ended(self, task_id: object = None, state: object = None, **_: Any) -> None:
        with self._lock:
            found = self._seen.get(task_id) if isinstance(task_id, str) else None
            if found is not None and isinstance(state, str) and state in _ENDED_AS:
                found.status = _ENDED_AS[state]

    def _failed(self, task_id: object = None, exception: object = None, **_: Any) -> None:
        with self._lock:
            found = self._seen.get(task_id) if isinstance(task_id, str) else None
            if found is not None and exception is not None:
                found.last_error = type(exception).__name__


class Harness:
    """A `Questpie` on a throwaway ledger, and what its test dispatched.

    The fixtures of `questpie_celery.testing` give one to each test that asks; `worker`
    is the in-process `celery worker` when the test has one (`questpie_worker`).
    """

    __test__ = False  # not a test class, whatever a test module imports it as

    def __init__(self, questpie: Questpie, ledger_url: str) -> None:
        self.questpie = questpie
        #: The throwaway ledger's URL (for a second `Questpie`, or a look with SQLAlchemy).
        self.ledger_url = ledger_url
        self.worker: Any = None
        self._watcher = _Watcher(questpie)

    def close(self) -> None:
        self._watcher.close()

    def dispatches(self, job: JobRef) -> list[Dispatch]:
        """The dispatches of `job` in publish order: first those this process sent or ran
        during the test, in the order it first saw them; then ledger rows it never saw
        sent (a far-off `start_after`, a `connection=` publish the relay has not sent yet,
        one written by another process), oldest first. A publish a queue policy
        suppressed made no dispatch and is not here."""
        name = _job_name(job)
        operator = self.questpie.operator
        found: list[Dispatch] = []
        for seen in self._watcher.seen(name):
            detail = operator.show(seen.id)
            found.append(Dispatch.of(detail) if detail is not None else _of_seen(seen))
        known = {d.id for d in found}
        found.extend(Dispatch.of(row) for row in self._rows(name) if row.dispatch_id not in known)
        return found

    def dispatch(self, dispatch_id: str) -> Dispatch | None:
        """One dispatch by id, ledgered or seen in this process; None when neither."""
        detail = self.questpie.operator.show(dispatch_id)
        if detail is not None:
            return Dispatch.of(detail)
        seen = self._watcher.get(dispatch_id)
        return _of_seen(seen) if seen is not None else None

    def wait_for(self, dispatch_id: str | None, timeout: float = 10.0) -> Dispatch:
        """Wait until the dispatch completed, failed for good or was cancelled, and return
        it; raises `TimeoutError` (saying where it stands) after `timeout` seconds."""
        if dispatch_id is None:
            raise ValueError("no dispatch to wait for: the publish was suppressed (None)")
        deadline = time.monotonic() + timeout
        while True:
            found = self.dispatch(dispatch_id)
            if found is not None and found.ended:
                return found
            if time.monotonic() >= deadline:
                where = "unknown" if found is None else f"{found.status}"
                raise TimeoutError(
                    f"dispatch {dispatch_id} has not ended after {timeout}s (it is {where})"
                )
            time.sleep(0.02)

    def _rows(self, job_name: str) -> Iterator[DispatchDetail]:
        """Every ledger row of the job, oldest first."""
        pages: list[list[DispatchDetail]] = []
        after: DispatchDetail | None = None
        while True:
            page = self.questpie.operator.dispatches(job=job_name, after=after, limit=MAX_PAGE)
            pages.append(page)
            if len(page) < MAX_PAGE:
                break
            after = page[-1]
        for page in reversed(pages):
            yield from reversed(page)


def _job_name(job: JobRef) -> str:
    if isinstance(job, str):
        return job
    if isinstance(job, JobDefinition | JobClient):
        return job.name
    raise TypeError("name a job by its JobDefinition, its name, or its queue client")


def _of_seen(seen: _Seen) -> Dispatch:
    return Dispatch(
        id=seen.id,
        job_name=seen.job_name,
        key=None,
        singleton_key=None,
        status=seen.status,
        attempts=seen.runs,
        payload=seen.payload,
        secret=False,
        last_error=seen.last_error,
        ledgered=False,
    )
