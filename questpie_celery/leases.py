"""Keeps the execution claims of running handlers alive.

One daemon thread per worker process renews every claim it tracks, every third
of a lease, until the run ends or reaches its `expire_in_seconds`; past that the
lease lapses, which is what makes an overlong run a failed attempt on pools that
cannot interrupt code.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import QuestpieError
from .forking import reset_in_child
from .ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class _Held:
    dispatch_id: str
    token: str
    deadline: float  # monotonic time after which the claim is no longer renewed


class LeaseKeeper:
    _held: dict[str, _Held]
    _lock: threading.Lock
    _thread: threading.Thread | None

    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self.ledger = ledger
        self.lease_seconds = lease_seconds
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # The parent's claims are the parent's to renew; the child starts empty.
        self._held = {}
        self._lock = threading.Lock()
        self._thread = None

    @contextmanager
    def hold(self, dispatch_id: str, token: str, max_age_seconds: float) -> Iterator[None]:
        """Renew the claim while the block runs."""
        held = _Held(dispatch_id, token, time.monotonic() + max_age_seconds)
        with self._lock:
            self._ensure_thread()
            self._held[token] = held
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(token, None)

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="questpie-leases", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(self.lease_seconds / 3, 0.05)
        while True:
            time.sleep(interval)
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
