"""Records, off the publish path, that the broker accepted a ledgered dispatch.

A ledgered dispatch's message goes to the broker after its row is durable; the
`pending -> queued` update that follows a send the broker took is batched by a
background thread instead of costing each send another round trip. Losing a batch
(the process dies, the ledger is briefly down) only leaves rows `pending`: the relay
sends them again and the worker's fence drops the duplicate delivery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .._runtime.forking import finish_at_exit, reset_in_child
from ..errors import LedgerUnavailableError, QuestpieError
from ..ledger import Ledger

log = logging.getLogger(__name__)

#: How often the batch is written. A row a worker claimed first is left alone by the
#: mark (a write that moves no row costs the server no writing transaction), so the
#: longer the interval the fewer marks a busy fleet pays; it stays far below the grace
#: after which the relay sends a row still pending (`PENDING_GRACE_SECONDS`, 30 s).
FLUSH_INTERVAL_SECONDS = 0.25


class AcceptanceRecorder:
    """Batches `pending -> queued` writes; `redeliver_in()` is the redelivery delay."""

    _accepted: list[str]
    _newest: float  # when the newest of `_accepted` was accepted (monotonic)
    _lock: threading.Lock
    _thread: threading.Thread | None

    def __init__(self, ledger: Ledger, redeliver_in: Callable[[], float]) -> None:
        self.ledger = ledger
        self._dispatches = ledger.dispatches
        self.redeliver_in = redeliver_in
        self._closed = False
        self._forked()
        reset_in_child(self._forked)
        finish_at_exit(self.flush)

    def close(self) -> None:
        """Flush, and stop recording in the background (later records flush at once)."""
        self._closed = True
        self.flush()

    def record(self, dispatch_id: str) -> None:
        if self._closed:
            self._dispatches.mark_queued([dispatch_id], self.redeliver_in())
            return
        with self._lock:
            self._accepted.append(dispatch_id)
            self._newest = time.monotonic()
            if self._thread is None:
                thread = threading.Thread(
                    target=self._loop, name="questpie-acceptance", daemon=True
                )
                thread.start()
                self._thread = thread

    def flush(self) -> None:
        """Write every recorded acceptance now."""
        with self._lock:
            batch, self._accepted = self._accepted, []
            newest = self._newest
        if not batch:
            return
        try:
            # Each row's queued_at is when the newest of the batch was accepted: a moment
            # (a batch interval at most) after its own acceptance, never before it.
            self._dispatches.mark_queued(
                batch, self.redeliver_in(), accepted_ago=time.monotonic() - newest
            )
        except QuestpieError as exc:
            unreachable = isinstance(exc, LedgerUnavailableError)
            if unreachable:
                self.ledger.outage.failed(exc)  # its line tells the log; this is detail
            log.log(
                logging.DEBUG if unreachable else logging.WARNING,
                "could not record broker acceptance of %d dispatch(es) (%s); "
                "they stay pending and the relay sends them again",
                len(batch),
                type(exc).__name__,
            )
        else:
            self.ledger.outage.reached()

    def _loop(self) -> None:
        failing: str | None = None
        while not self._closed:
            time.sleep(FLUSH_INTERVAL_SECONDS)
            try:
                self.flush()
                self.ledger.idle()
            except Exception as exc:
                # Not the ledger's own errors (flush logs those): something refusing the
                # database outright (a test harness's blocker, say). The thread lives on,
                # and says so once per kind of failure.
                if failing != type(exc).__name__:
                    failing = type(exc).__name__
                    log.warning("recording broker acceptance failed (%s); retrying", failing)
            else:
                failing = None

    def _forked(self) -> None:
        # The parent flushes its own batch; the child starts empty, with a fresh lock.
        self._accepted = []
        self._newest = 0.0
        self._lock = threading.Lock()
        self._thread = None
