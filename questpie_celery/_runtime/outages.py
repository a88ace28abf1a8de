"""Telling of an outage of the ledger or the broker, quietly.

The parts that wait out an outage (claims, lease renewals and outcome writes in the
worker, the relay and its listening connection, beat, the status page) retry every
second or so. Each of them reports what it meets to the process's one `Outage` of that
dependency, which tells the log: one line when the dependency becomes unreachable,
with its cause and no traceback; at most one reminder a minute while it stays so; one
line when it is back. The parts' own lines about it (which dispatch waits) are INFO
the first time and DEBUG after that.

A dependency that comes and goes (back for a moment, gone again) is told of at most
once a reminder's period: a failure soon after a "back" line is told when the period
has passed, if it still lasts then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..errors import QuestpieError
from .forking import reset_in_child

log = logging.getLogger(__name__)

#: The least time between two lines about one outage.
REMIND_EVERY_SECONDS = 60.0
#: The longest cause a line quotes (a driver's message can run long).
MAX_CAUSE_CHARACTERS = 300


class Outage:
    """One dependency as this process sees it: reachable, or not since when."""

    def __init__(
        self,
        what: str,
        *,
        trouble: str = "cannot be reached",
        recovered: str = "can be reached again",
        logger: logging.Logger | None = None,
        remind_every: float = REMIND_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self._trouble = trouble
        self._recovered = recovered
        self._log = logger or log
        self._remind_every = remind_every
        self._clock = clock
        self._down_since: float | None = None
        self._told_down = False  # this outage was told of (its "back" line is due)
        self._last_line = float("-inf")
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # A child keeps what its parent knew (and told), with a lock of its own.
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        """Whether the last report was a failure."""
        return self._down_since is not None

    def failed(self, cause: BaseException | str) -> None:
        """A part could not reach the dependency (it retries on its own)."""
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
            if now - self._last_line < self._remind_every:
                return  # told just now (or back just now: told once the period passed)
            self._last_line = now
            if not self._told_down:
                self._told_down = True
                self._log.warning(
                    "%s %s (%s); waiting for it, and saying so again every %s while it lasts",
                    self.what,
                    self._trouble,
                    describe(cause),
                    duration(self._remind_every),
                )
                return
            self._log.warning(
                "%s still %s, for %s now (%s)",
                self.what,
                self._trouble,
                duration(now - self._down_since),
                describe(cause),
            )

    def reached(self) -> None:
        """A part reached the dependency. Costs an attribute read while it is up."""
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
            if since is None or not self._told_down:
                return  # an outage never told of ends untold
            self._told_down = False
            now = self._clock()
            self._last_line = now
            self._log.warning("%s %s, after %s", self.what, self._recovered, duration(now - since))


def describe(cause: BaseException | str) -> str:
    """What a line quotes of a cause: our own errors' messages (which never hold a
    payload); of anything else its class and the first line of its message."""
    if isinstance(cause, str):
        text = cause
    else:
        lines = str(cause).strip().splitlines()
        first = lines[0] if lines else ""
        ours = isinstance(cause, QuestpieError)
        text = first if ours else f"{type(cause).__name__}{': ' + first if first else ''}"
    if len(text) > MAX_CAUSE_CHARACTERS:
        text = text[: MAX_CAUSE_CHARACTERS - 3] + "..."
    return text


def duration(seconds: float) -> str:
    """`45 s`, `3 min 5 s`, `2 h 10 min`: how long, for a person."""
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h" + (f" {minutes} min" if minutes else "")
