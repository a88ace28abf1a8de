"""A loop a test runs beside its work, in a daemon thread, until it is told to stop."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import ClassVar, Self


@dataclass
class Background:
    """`start()` runs `_run` in a daemon thread; `_run` loops until `_stop` is set, which
    `stop()` does before it waits for the thread. The fields are keyword-only, so that a
    dataclass deriving from this one lists its own fields first."""

    #: How long `stop()` waits for the loop to notice.
    JOIN_SECONDS: ClassVar[float] = 60.0

    _stop: threading.Event = field(default_factory=threading.Event, kw_only=True, repr=False)
    _thread: threading.Thread | None = field(default=None, kw_only=True, repr=False)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.JOIN_SECONDS)

    def _run(self) -> None:
        raise NotImplementedError
