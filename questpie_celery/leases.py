"""Keeps the execution claims of running handlers alive.

One daemon thread per worker process renews every claim it tracks, every third
of a lease, until the run ends or reaches its `expire_in_seconds`; past that the
lease lapses, which is what makes an overlong run a failed attempt on pools that
cannot interrupt code. The thread survives any error (a dead renewer would let
every long run in the process be run twice) and is restarted if it ever dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .forking import reset_in_child
from .ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class Lease:
    """One held claim, as this process sees it."""

    dispatch_id: str
    token: str
    deadline: float  # monotonic time after which the claim is no longer renewed
    expires: float  # monotonic estimate of when the database's lease runs out
    lost: bool = False


class LeaseKeeper:
    _held: dict[str, Lease]
    _lock: threading.Lock
    _thread: threading.Thread | None

    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self._ledger = ledger
        self.lease_seconds = lease_seconds
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # The parent's claims are the parent's to renew; the child starts empty.
        self._held = {}
        self._lock = threading.Lock()
        self._thread = None

    @contextmanager
    def hold(self, dispatch_id: str, token: str, max_age_seconds: float) -> Iterator[Lease]:
        """Renew the claim (taken just now) while the block runs."""
        now = time.monotonic()
        lease = Lease(dispatch_id, token, now + max_age_seconds, now + self.lease_seconds)
        with self._lock:
            self._ensure_thread()
            self._held[token] = lease
        try:
            yield lease
        finally:
            with self._lock:
                self._held.pop(token, None)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._loop, name="questpie-leases", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = max(self.lease_seconds / 3, 0.05)
        while True:
            time.sleep(interval)
            with self._lock:
                due = list(self._held.values())
            for lease in due:
                try:
                    self._renew(lease)
                except Exception:
                    # Whatever went wrong, the other claims still need renewing.
                    log.exception("renewing the claim of dispatch %s failed", lease.dispatch_id)

    def _renew(self, lease: Lease) -> None:
        started = time.monotonic()
        if started >= lease.deadline:
            return  # past expire_in_seconds: let the lease lapse
        try:
            renewed = self._ledger.renew(lease.dispatch_id, lease.token, self.lease_seconds)
        except Exception as exc:
            # The ledger is unreachable: keep trying; the lease is long enough to ride
            # out a short outage.
            log.warning(
                "could not renew the claim of dispatch %s: %s",
                lease.dispatch_id,
                type(exc).__name__,
                extra={"dispatch_id": lease.dispatch_id},
            )
            return
        if renewed:
            lease.expires = started + self.lease_seconds
            return
        log.warning(
            "lost the execution claim of dispatch %s while it ran",
            lease.dispatch_id,
            extra={"dispatch_id": lease.dispatch_id},
        )
        lease.lost = True
        with self._lock:
            self._held.pop(lease.token, None)
