"""Records, off the publish path, that the broker accepted a ledgered dispatch.

`publish()` returns once the row is durable and the broker took the message; the
`pending -> queued` update that follows is batched by a background thread instead
of costing each publish another round trip. Losing a batch (the process dies, the
ledger is briefly down) only leaves rows `pending`: the relay sends them again and
the worker's fence drops the duplicate delivery.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from datetime import datetime

from .errors import QuestpieError
from .ledger import Ledger, utcnow

log = logging.getLogger(__name__)

FLUSH_INTERVAL_SECONDS = 0.05


class AcceptanceRecorder:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._accepted: list[tuple[str, datetime]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        ref = weakref.ref(self)

        def after_fork() -> None:
            # A lock another thread held at fork time would stay held in the child.
            recorder = ref()
            if recorder is not None:
                recorder._forked()

        def at_exit() -> None:
            recorder = ref()
            if recorder is not None:
                recorder.flush()

        os.register_at_fork(after_in_child=after_fork)
        atexit.register(at_exit)

    def record(self, dispatch_id: str) -> None:
        with self._lock:
            self._accepted.append((dispatch_id, utcnow()))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="questpie-acceptance", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        """Write every recorded acceptance now."""
        with self._lock:
            batch, self._accepted = self._accepted, []
        if not batch:
            return
        try:
            self.ledger.mark_queued(batch)
        except QuestpieError as exc:
            log.warning(
                "could not record broker acceptance of %d dispatch(es) (%s); "
                "they stay pending and the relay sends them again",
                len(batch),
                type(exc).__name__,
            )

    def _loop(self) -> None:
        while True:
            self._wake.wait(FLUSH_INTERVAL_SECONDS)
            self.flush()

    def _forked(self) -> None:
        # The parent flushes its own batch; the child starts empty, with fresh state.
        self._lock = threading.Lock()
        self._accepted = []
        self._thread = None
