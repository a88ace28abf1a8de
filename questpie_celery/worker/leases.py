"""Keeps the execution claims of running handlers alive.

One daemon thread per worker process renews every claim it tracks, every third
of a lease (each renewal also brings back whether the run was cancelled), until the
run ends or reaches the age its caller gave (`renewal_cap`):
past that the lease lapses, which is what makes an overlong run a failed attempt on
pools that cannot interrupt code. In a prefork pool process, whose run the pool kills
at its hard time limit, that age is the hard limit (and a margin): the claim then
lapses only once the process is gone, so a retry can never start beside a run that
overran its soft limit. The pool's kill comes from the worker's main process, which
may not make it (stalled, or in its broker reconnect loop, where its event loop runs
no timers): a run still going at the end of that age ends its own process, so its
claim lapses only after it. The thread survives any error (a dead renewer would let
every long run in the process be run twice) and is restarted if it ever dies.

A process that stalls (stopped by a signal or a debugger, a paused VM or container, a
swap storm) renews nothing while it stands still: its claim may lapse, the relay may
end it and a retry may start elsewhere. So a run whose process stood still until a
whole lease had passed since its last renewal was sent (the ledger's lease runs from no
earlier) is in doubt, and so is one whose renewal finds the claim gone: a prefork pool
process then ends itself at once, before it renews or records anything, since its run
may be another's by now. A stood-still process is one whose renewal thread woke later
than it asked by `STOOD_STILL_SECONDS` (it sees that as soon as it runs again), or one
continued after a stop (SIGCONT: the check runs in its main thread, the handler's,
before any more of the handler's Python does), or one whose claim is already a lease old
when its handler is about to begin. A process that stood still for less keeps its
claim: the renewal that follows lands in time. A slow or unreachable ledger is not a
stall: renewals that hang or fail leave the run going, and the next one that goes
through says whether the claim is still its own. Pools that run handlers in threads of
the worker itself cannot end one run alone: there the run goes on, its outcome is not
recorded, and `ctx.fencing_token` is what keeps its late writes out.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_init, worker_process_init

from .._runtime.forking import reset_in_child
from ..errors import LedgerUnavailableError
from ..ledger import Ledger

log = logging.getLogger(__name__)

#: How soon a renewal that failed is tried again.
RENEW_RETRY_SECONDS = 1.0
#: The renewal thread waking this much later than it asked (or a renewal interval, if
#: less) means the process stood still: a loaded machine runs a thread late by less.
STOOD_STILL_SECONDS = 1.0
#: How long past a run's hard time limit a prefork pool process goes on renewing its
#: claim: the pool kills the process at the limit, so renewals end with it; the margin
#: covers a kill the pool's event loop makes late, and bounds the claim of a process
#: the kill never reached.
KILL_MARGIN_SECONDS = 10.0

# The pid of this worker's main process (None outside a worker), and whether this
# process is one of its prefork pool processes: Celery sends `worker_process_init` in
# those, and in the main process of the solo pool, which cannot kill a run.
_worker_pid: int | None = None
_in_prefork_child = False


def _worker_starts(**_: Any) -> None:
    global _worker_pid  # noqa: PLW0603  # one fact per process, as Celery's own signals are
    _worker_pid = os.getpid()


def _pool_process_starts(**_: Any) -> None:
    global _in_prefork_child  # noqa: PLW0603
    _in_prefork_child = os.getpid() != _worker_pid
    if _in_prefork_child:
        _watch_for_continue()


#: The lease keepers of this process, told when the process is continued after a stop.
_keepers: weakref.WeakSet[LeaseKeeper] = weakref.WeakSet()


def _watch_for_continue() -> None:
    """Check every held claim as soon as this process is continued after a stop: Python
    runs a signal handler in the main thread, which in a prefork pool process is the one
    that runs the handler, so the check comes before any more of its Python does. Any
    handler the application had is called after ours."""
    if not hasattr(signal, "SIGCONT"):
        return
    before = signal.getsignal(signal.SIGCONT)

    def continued(signum: int, frame: Any) -> None:
        for keeper in list(_keepers):
            keeper.stop_if_in_doubt()
        if callable(before):
            before(signum, frame)

    signal.signal(signal.SIGCONT, continued)


worker_init.connect(_worker_starts, weak=False)
worker_process_init.connect(_pool_process_starts, weak=False)


@dataclass(frozen=True)
class RenewalCap:
    """For how many seconds from now a run's claim is renewed, and whether the process
    ends itself should the run still go on then."""

    seconds: float
    ends_process: bool = False


def renewal_cap(expire_in_seconds: float, hard_limit_left: float | None) -> RenewalCap:
    """In a prefork pool process with a hard time limit, until the pool has killed the
    run (`hard_limit_left`, plus `KILL_MARGIN_SECONDS`), and a run still going then ends
    its process: the kill never came. On every other pool (threads, solo, gevent,
    eventlet), which cannot stop running code for sure, `expire_in_seconds`, and the run
    goes on past it."""
    if _in_prefork_child and hard_limit_left is not None:
        return RenewalCap(max(hard_limit_left, 0.0) + KILL_MARGIN_SECONDS, ends_process=True)
    return RenewalCap(expire_in_seconds)


@dataclass
class Lease:
    """One held claim, as this process sees it."""

    dispatch_id: str
    token: str
    deadline: float  # monotonic time after which the claim is no longer renewed
    #: Monotonic time at which the last renewal that succeeded (or the claim) was sent:
    #: the ledger's lease runs from no earlier than this.
    renewed_at: float = 0.0
    lost: bool = False
    #: A cancel reached the run (its renewal said so): `ctx.cancel_requested`.
    cancel_requested: bool = False
    ends_process: bool = False  # past the deadline, the run's process ends itself
    #: The kind of failure its renewals meet, said once until one succeeds (another
    #: kind is said again: an outage's word must not silence a bug's).
    failing: type[Exception] | None = None

    def still_held(self) -> bool:
        """Whether the claim is still this run's: renewed, and within its time cap."""
        return not self.lost and time.monotonic() < self.deadline


class LeaseKeeper:
    _held: dict[str, Lease]
    _lock: threading.Lock
    _thread: threading.Thread | None

    def __init__(self, ledger: Ledger, lease_seconds: float) -> None:
        self._ledger = ledger  # its outage line, and `idle` between rounds
        self._claims = ledger.claims
        self.lease_seconds = lease_seconds
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # The parent's claims are the parent's to renew; the child starts empty.
        self._held = {}
        self._lock = threading.Lock()
        self._thread = None
        self._wake_at = float("inf")  # when the renewal thread's sleep should end
        _keepers.add(self)

    @property
    def _interval(self) -> float:
        """How often the renewal thread renews every claim."""
        return max(self.lease_seconds / 3, 0.05)

    @contextmanager
    def hold(
        self,
        dispatch_id: str,
        token: str,
        max_age_seconds: float,
        *,
        claimed_at: float | None = None,
        ends_process: bool = False,
    ) -> Iterator[Lease]:
        """Renew the claim while the block runs, for `max_age_seconds` at most; past that,
        with `ends_process`, a block still running ends this process. `claimed_at`: the
        monotonic time the claim's statement was sent (now, when not given)."""
        now = time.monotonic()
        lease = Lease(
            dispatch_id,
            token,
            now + max_age_seconds,
            renewed_at=now if claimed_at is None else claimed_at,
            ends_process=ends_process,
        )
        if _in_prefork_child and self._in_doubt(lease, now, stood_still=True):
            # A lease old already (the process stood still between its claim and here):
            # the handler must not begin.
            _end_stalled(lease, now - lease.renewed_at)
        with self._lock:
            self._ensure_thread()
            self._held[token] = lease
        try:
            yield lease
        finally:
            with self._lock:
                self._held.pop(token, None)

    def stop_if_in_doubt(self) -> None:
        """In a prefork pool process just continued after a stop, end the process if a
        claim it holds may have lapsed meanwhile. Takes no lock: it runs in a signal
        handler, which may have interrupted a holder of one."""
        if not _in_prefork_child:
            return
        now = time.monotonic()
        for lease in list(self._held.values()):
            if self._in_doubt(lease, now, stood_still=True):
                _end_stalled(lease, now - lease.renewed_at)

    def _stood_still(self, now: float) -> bool:
        """Whether the renewal thread's sleep ended much later than it asked: time in
        which this process did not run."""
        return now - self._wake_at >= min(STOOD_STILL_SECONDS, self._interval)

    def _in_doubt(self, lease: Lease, now: float, *, stood_still: bool) -> bool:
        """Whether `lease`'s claim may have lapsed while this process stood still: a whole
        lease since its last renewal was sent. Time spent waiting on a slow or unreachable
        ledger is not standing still: the next renewal that lands says."""
        return stood_still and now - lease.renewed_at >= self.lease_seconds

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._loop, name="questpie-leases", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        interval = self._interval
        # After a failed renewal, try again soon: once the ledger is back, the claim must
        # be renewed before the relay's grace for a lapsed lease runs out.
        retry = min(interval, RENEW_RETRY_SECONDS)
        failed = False
        while True:
            pause = retry if failed else interval
            self._wake_at = time.monotonic() + pause
            time.sleep(pause)
            stood_still = self._stood_still(time.monotonic())
            self._wake_at = float("inf")
            with self._lock:
                due = list(self._held.values())
            failed = False
            for lease in due:
                try:
                    failed = not self._renew(lease, stood_still) or failed
                except Exception:
                    # Whatever went wrong, the other claims still need renewing.
                    log.exception("renewing the claim of dispatch %s failed", lease.dispatch_id)
                    failed = True
            if due:
                self._ledger.idle()

    def _renew(self, lease: Lease, stood_still: bool = False) -> bool:
        """Renew one claim; False when the ledger could not be reached."""
        started = time.monotonic()
        if started >= lease.deadline:
            if lease.ends_process:
                self._end_process(lease)
            return True  # past its cap: let the lease lapse
        if _in_prefork_child and self._in_doubt(lease, started, stood_still=stood_still):
            self._end_if_held(lease, started)
            return True
        try:
            renewed = self._claims.renew_lease(lease.dispatch_id, lease.token, self.lease_seconds)
        except Exception as exc:
            # The ledger is unreachable: keep trying; the lease is long enough to ride
            # out a short outage. The ledger's outage line tells the log of it; each
            # claim says once that it waits.
            unreachable = isinstance(exc, LedgerUnavailableError)
            if unreachable:
                self._ledger.outage.failed(exc)
            log.log(
                logging.DEBUG
                if lease.failing is type(exc)
                else logging.INFO
                if unreachable
                else logging.WARNING,
                "could not renew the claim of dispatch %s: %s; trying again every %gs",
                lease.dispatch_id,
                type(exc).__name__,
                RENEW_RETRY_SECONDS,
                extra={"dispatch_id": lease.dispatch_id},
            )
            lease.failing = type(exc)
            return False
        self._ledger.outage.reached()
        lease.failing = None
        if renewed is not None:
            lease.renewed_at = started
            if renewed.cancel_requested and not lease.cancel_requested:
                log.info(
                    "dispatch %s was cancelled while it runs: it goes on, and is not retried",
                    lease.dispatch_id,
                    extra={"dispatch_id": lease.dispatch_id},
                )
                lease.cancel_requested = True
            return True
        if _in_prefork_child:
            # Its run may be another's by now: it must not go on (the run has not ended:
            # its claim is dropped from here before its outcome is written).
            self._end_if_held(lease, started)
            return True
        with self._lock:
            still_held = self._held.pop(lease.token, None) is not None
        if still_held:  # not a run that ended (and recorded itself) just now
            log.warning(
                "lost the execution claim of dispatch %s while it ran",
                lease.dispatch_id,
                extra={"dispatch_id": lease.dispatch_id},
            )
            lease.lost = True
        return True

    def _end_if_held(self, lease: Lease, now: float) -> None:
        """End this prefork pool process for a claim in doubt or lost, while its run still
        holds it: a run whose handler returned is writing its outcome, which its token
        fences (a claim that is another's by now is not written over)."""
        with self._lock:
            if self._held.get(lease.token) is lease:
                _end_stalled(lease, now - lease.renewed_at)

    def _end_process(self, lease: Lease) -> None:
        """The run went past its hard time limit and the margin, and the pool has not
        killed it: end the process as the pool would have, before its lease lapses (the
        last renewal keeps it for two thirds of a lease more), so no retry of the run
        starts while it goes on. Under the lock, and only while the run still holds the
        claim: a run that has returned is recording its outcome, which must not be cut."""
        with self._lock:
            if self._held.get(lease.token) is not lease:
                return
            log.error(
                "dispatch %s ran past its hard time limit and the pool did not kill it (the "
                "worker's main process is stalled, or cut off from its broker); its pool "
                "process ends itself, so the run's claim lapses only once the run is over",
                lease.dispatch_id,
                extra={"dispatch_id": lease.dispatch_id},
            )
            os.kill(os.getpid(), signal.SIGKILL)


def _end_stalled(lease: Lease, unrenewed: float) -> None:
    """End this prefork pool process at once: its run's claim may be another's. Said with
    one write to the process's standard error, which takes no lock the stalled handler's
    thread could hold (a logging handler's would let the handler go on until it let go);
    the worker's main process then reports the pool process lost, and the relay ends the
    claim if it is still this run's."""
    line = (
        f"questpie_celery: dispatch {lease.dispatch_id}: this pool process stood still or lost "
        f"its claim ({unrenewed:.1f}s since the claim was last renewed); it ends itself so "
        "that the run cannot go on beside its retry\n"
    )
    try:
        os.write(2, line.encode(errors="replace"))
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
