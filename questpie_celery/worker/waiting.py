"""Waiting for an unreachable ledger: the one rule every worker step that waits follows.

A step (a claim, taking a delivery into the ledger, an outcome write) that meets an
unreachable ledger, a row another transaction holds, or (for a claim) a ledger not
migrated yet, is tried again: after a short pause that doubles up to a cap, until a
deadline. No pause runs past the deadline, so the last try is at it; once it has come,
the caller decides what running out means (a delivery goes back to the broker, an
outcome write raises). Each failure to reach the ledger is reported to the ledger's
`Outage`, which tells the log; the caller's own line about its step is INFO the first
time (WARNING for a held row or a missing schema, which no other line tells) and DEBUG
after that. The deadlines and pauses are the callers' (see operations.md's constants).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

from celery.exceptions import SoftTimeLimitExceeded

from ..errors import LedgerBusyError, LedgerUnavailableError
from ..ledger import Ledger

T = TypeVar("T")

#: What a wait waits out unless told otherwise.
TRANSIENT: tuple[type[Exception], ...] = (LedgerUnavailableError, LedgerBusyError)


def _raise(exc: Exception) -> NoReturn:
    raise exc


class LedgerWait:
    """How long and how often one kind of step tries the ledger again."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        patience: float,
        first_pause: float,
        max_pause: float,
        waits_for: tuple[type[Exception], ...] = TRANSIENT,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._ledger = ledger
        self.patience = patience
        self._first_pause = first_pause
        self._max_pause = max_pause
        self._waits_for = waits_for
        self._clock = clock
        self._sleep = sleep

    def run(
        self,
        step: Callable[[], T],
        *,
        tell: Callable[[int, Exception], None],
        out_of_time: Callable[[Exception], None] = _raise,
        soft_limit: Callable[[SoftTimeLimitExceeded], None] = _raise,
        within: float = math.inf,
        waits_for: tuple[type[Exception], ...] | None = None,
    ) -> T:
        """`step`'s result, once it reaches the ledger.

        `tell(level, error)` logs that the step waits; `out_of_time(error)` is called at
        each failure once the deadline (the patience, or `within` seconds if sooner) has
        come: raising ends the wait, returning keeps it going. `soft_limit` hears a run's
        soft time limit falling anywhere in the wait, and likewise raises or returns.
        `waits_for` replaces the errors waited out (none: every error goes to the caller).
        """
        deadline = self._clock() + min(self.patience, within)
        pause = self._first_pause
        told = False  # the step said it waits (once: the ledger's outage says the rest)
        outage = self._ledger.outage
        transient = self._waits_for if waits_for is None else waits_for
        while True:
            try:
                try:
                    found = step()
                except transient as exc:
                    if isinstance(exc, LedgerUnavailableError):
                        outage.failed(exc)
                    if self._clock() >= deadline:
                        out_of_time(exc)
                    tell(logging.DEBUG if told else first_level(exc), exc)
                    told = True
                else:
                    outage.reached()
                    return found
                # Never sleep past the deadline: a run's soft limit may follow it closely.
                left = deadline - self._clock()
                self._sleep(min(pause, left) if left > 0 else pause)
                pause = min(pause * 2, self._max_pause)
            except SoftTimeLimitExceeded as limit:
                soft_limit(limit)


def first_level(exc: Exception) -> int:
    """How loud a step's first word of waiting is: INFO when the ledger's outage line
    already told the log (see `_runtime/outages.py`), WARNING for a held row or a ledger not
    migrated yet, which no other line tells."""
    return logging.INFO if isinstance(exc, LedgerUnavailableError) else logging.WARNING
