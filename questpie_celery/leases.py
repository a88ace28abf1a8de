"""Keeps the execution claims of running handlers alive.

One daemon thread per worker process renews every claim it tracks, every third
of a lease, until the run ends or reaches its `expire_in_seconds`; past that the
lease lapses, which is what makes an overlong run a failed attempt on pools that
cannot interrupt code.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import QuestpieError
from .ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class _Held:
    dispatch_id: str
    token: str
    deadline: float  # monotonic time after which the claim is no longer renewed


class LeaseKeeper:
    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self.ledger = ledger
        self.lease_seconds = lease_seconds
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    @contextmanager
    def hold(self, dispatch_id: str, token: str, max_age_seconds: float) -> Iterator[None]:
        """Renew the claim while the block runs."""
        held = _Held(dispatch_id, token, time.monotonic() + max_age_seconds)
        with self._lock:
            self._held[token] = held
            self._ensure_thread()
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(token, None)

    def _ensure_thread(self) -> None:
        # A thread does not survive fork: start one per process, on first use.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        if self._pid != os.getpid():
            self._held.clear()  # the parent's claims are the parent's to renew
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._loop, name="questpie-leases", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(self.lease_seconds / 3, 0.05)
        while True:
            self._wake.wait(interval)
            with self._lock:
                due = list(self._held.values())
            now = time.monotonic()
            for held in due:
                if now >= held.deadline:
                    continue  # past expire_in_seconds: let the lease lapse
                try:
                    if not self.ledger.renew(held.dispatch_id, held.token, self.lease_seconds):
                        log.warning(
                            "lost the execution claim of dispatch %s while it ran",
                            held.dispatch_id,
                            extra={"dispatch_id": held.dispatch_id},
                        )
                        with self._lock:
                            self._held.pop(held.token, None)
                except QuestpieError as exc:
                    # The ledger is unreachable: keep trying; the lease is long enough
                    # to ride out a short outage.
                    log.warning(
                        "could not renew the claim of dispatch %s: %s",
                        held.dispatch_id,
                        type(exc).__name__,
                    )
