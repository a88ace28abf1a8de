"""Completions carried into the next claim: one commit per run on a busy worker.

A fenced run writes twice: its claim before the handler and its outcome after. On a
busy worker another delivery follows each run within a millisecond or two (a prefork
child is handed its next prefetched message as soon as it reports the last one done),
and its claim can carry the previous run's completion in the same statement and
commit (`Claims.claim(carried=...)`): a run then costs the ledger one commit, not two.

A process holds completions only while it is busy: once an end waited for nothing, its
ends are recorded at once until a claim follows an end within `CARRY_SECONDS` again, so
a worker that is mostly idle keeps the window below as short as it always was.

Only a completion nothing else is waiting for is carried: a run that returned, of a
dispatch with no policy slot, no seat and no chord or batch (whose ends hand something
on at once), not eager, and whose Celery result goes nowhere (the task ignores its
result, or the app has no result backend), so no reader can see the run finished in
Celery before the ledger says so. When no claim takes it within `CARRY_SECONDS`, a
thread of the process records it alone, patiently, as the run itself would have. A
process that dies before either leaves the run to its lease, as a process dying just
after its handler returned always has (the documented window between a handler's end
and its outcome's commit, here at most `CARRY_SECONDS` longer). A pool process that
stops in the ordinary way (warm shutdown, `max_tasks_per_child`) records what it holds
before it goes.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from celery.signals import worker_process_shutdown

from .._runtime.forking import finish_at_exit, reset_in_child
from ..ledger import CarriedEnd, DispatchRow

log = logging.getLogger(__name__)

#: How long a completion waits for a claim to carry it before it is recorded alone.
CARRY_SECONDS = 0.01

#: What records a completion alone (`Outcomes`): patiently, with its hooks.
RecordAlone = Callable[[DispatchRow, CarriedEnd], None]

_LIVE: weakref.WeakSet[Carried] = weakref.WeakSet()


class Carried:
    """The completions of this process waiting for a claim to carry them."""

    _waiting: deque[tuple[DispatchRow, CarriedEnd]]
    _changed: threading.Condition
    _thread: threading.Thread | None

    def __init__(self, record_alone: RecordAlone, idle: Callable[[], None]) -> None:
        self._record_alone = record_alone
        self._idle = idle  # the thread's unit of work ended (Django's connection rules)
        self._forked()
        reset_in_child(self._forked)
        finish_at_exit(self.flush)
        _LIVE.add(self)

    def _forked(self) -> None:
        # A forked child holds none of the parent's: the parent records its own.
        self._waiting = deque()
        self._until: dict[str, float] = {}  # when each waiting one is recorded alone
        self._changed = threading.Condition()
        self._thread = None
        # Busy: the last claim came within `CARRY_SECONDS` of the end before it, so the
        # next end is held. An end no claim took in time makes the process idle: its
        # ends are recorded at once (nothing would carry them, and a kill in the wait
        # would run the dispatch again), until a claim follows an end that closely again.
        self._busy = True
        self._last_end = 0.0  # when the last completion ended (monotonic)
        self._recording = 0  # completions the thread is recording now

    def hold(self, row: DispatchRow, end: CarriedEnd, longest: float) -> bool:
        """Hold a completion for the next claim of this process, for `CARRY_SECONDS`
        and at most `longest` (well inside what is left of its lease); then the thread
        records it alone. False, holding nothing, while the process is idle: the caller
        records it."""
        with self._changed:
            now = self._last_end = time.monotonic()
            if not self._busy:
                return False
            self._until[end.dispatch_id] = now + min(CARRY_SECONDS, longest)
            self._waiting.append((row, end))
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name="questpie-carried", daemon=True)
                thread.start()
                self._thread = thread
            self._changed.notify_all()
            return True

    def take(self, not_for: str) -> tuple[DispatchRow, CarriedEnd] | None:
        """The oldest completion waiting, for a claim of another dispatch to carry. Every
        claim of the process asks (that is how it learns it is busy again)."""
        with self._changed:
            if not self._busy and time.monotonic() - self._last_end <= CARRY_SECONDS:
                self._busy = True
            if not self._waiting or self._waiting[0][0].id == not_for:
                return None
            return self._popped()

    def give_back(self, held: tuple[DispatchRow, CarriedEnd]) -> None:
        """A claim that carried it failed before anything was committed: record it alone."""
        with self._changed:
            self._until[held[1].dispatch_id] = time.monotonic()
            self._waiting.appendleft(held)
            self._changed.notify_all()

    def _popped(self) -> tuple[DispatchRow, CarriedEnd]:
        """The oldest waiting, taken (holding `_changed`)."""
        held = self._waiting.popleft()
        self._until.pop(held[1].dispatch_id, None)
        return held

    def settle(self) -> None:
        """Before a claimed run starts: record in the caller's thread what still waits,
        and wait for what the thread is recording (through an outage its write is
        patient). So a process never starts a run while an earlier run's completion is
        unrecorded, as when it recorded each before its next claim; on a busy worker the
        claim carried it, and there is nothing to wait for."""
        self.flush()
        with self._changed:
            while self._recording:
                self._changed.wait()

    def flush(self) -> None:
        """Record everything waiting, alone, now (in the caller's thread)."""
        while True:
            with self._changed:
                if not self._waiting:
                    return
                held = self._popped()
            self._record(held)

    def _record(self, held: tuple[DispatchRow, CarriedEnd]) -> None:
        try:
            self._record_alone(*held)
        except Exception as exc:  # the run's lease is the safety net, as for any outcome
            log.error(  # noqa: TRY400 (the type only: the text could quote a result)
                "dispatch %s: recording its completion failed (%s); its lease decides",
                held[0].id,
                type(exc).__name__,
                extra={"dispatch_id": held[0].id, "job_name": held[0].job_name},
            )

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                first = self._waiting[0]
                # Give a claim of this process the time to carry it.
                # (A deadline missing, which only two ends of one dispatch could make:
                # recorded at once.)
                left = self._until.get(first[1].dispatch_id, 0.0) - time.monotonic()
                if left > 0:
                    self._changed.wait_for(functools.partial(self._moved_on, first), left)
                if self._moved_on(first):
                    continue
                held = self._popped()
                self._busy = False
                self._recording += 1
            try:
                self._record(held)
                self._idle()
            finally:
                with self._changed:
                    self._recording -= 1
                    self._changed.notify_all()

    def _moved_on(self, first: tuple[DispatchRow, CarriedEnd]) -> bool:
        """`first` is no longer the oldest waiting: a claim took it (holding `_changed`)."""
        return not self._waiting or self._waiting[0] is not first


def _pool_process_stops(**_: object) -> None:
    """A pool process that stops in the ordinary way records what it holds first."""
    for carried in list(_LIVE):
        carried.flush()


worker_process_shutdown.connect(_pool_process_stops, weak=False)
