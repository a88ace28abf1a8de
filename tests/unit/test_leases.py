"""The lease renewer survives whatever a renewal raises, and comes back if it dies.

A dead renewer would let every long run of its process lapse and run twice, so a
failed renewal must be one skipped beat, and the next claim held must start a new
thread when the old one is gone. Observed through the ledger row's lease_expires_at,
which only moves forward while someone renews it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from questpie_celery.errors import LedgerUnavailableError
from questpie_celery.ledger import Ledger, open_ledger
from questpie_celery.ledger.claims import Renewal
from questpie_celery.worker import leases, relay
from questpie_celery.worker.leases import LeaseKeeper
from tests.support.waiting import wait_until
from tests.unit.helpers import IdleApp, new_dispatch, sqlite_now, sqlite_url

LEASE = 0.3  # renewed every 0.1 s


def _claimed(ledger: Ledger) -> tuple[str, str]:
    new = new_dispatch()
    assert ledger.dispatches.insert(new) is True
    claim = ledger.claims.claim(new.id, new.job_name, 1, LEASE)
    assert claim.outcome == "claimed" and claim.token is not None
    return new.id, claim.token


def _expires(ledger: Ledger, dispatch_id: str) -> datetime:
    row = ledger.get(dispatch_id)
    assert row is not None and row.lease_expires_at is not None
    return row.lease_expires_at


def _advanced_past(ledger: Ledger, dispatch_id: str, mark: datetime) -> datetime | None:
    found = _expires(ledger, dispatch_id)
    return found if found > mark else None


class FailingOnce:
    """`ledger.claims.renew_lease` that raises `error` on its first call only, then renews."""

    def __init__(self, ledger: Ledger, error: BaseException) -> None:
        self._renew = ledger.claims.renew_lease
        self._error = error
        self.calls = 0
        self.raised = threading.Event()

    def __call__(self, dispatch_id: str, token: str, lease_seconds: float) -> Renewal | None:
        self.calls += 1
        if self.calls == 1:
            self.raised.set()
            raise self._error
        return self._renew(dispatch_id, token, lease_seconds)


def test_a_renewal_that_raises_does_not_stop_renewing(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    dispatch_id, token = _claimed(ledger)
    failing = FailingOnce(ledger, RuntimeError("not a QuestpieError"))
    monkeypatch.setattr(ledger.claims, "renew_lease", failing)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with caplog.at_level(logging.WARNING), keeper.hold(dispatch_id, token, 60) as lease:
        assert failing.raised.wait(10), "the renewer never tried to renew"
        after_error = _expires(ledger, dispatch_id)
        # Renewed after the failure, and again after that: renewal goes on.
        later = wait_until(
            lambda: _advanced_past(ledger, dispatch_id, after_error), "a renewal after the error"
        )
        wait_until(lambda: _advanced_past(ledger, dispatch_id, later), "a second renewal")
        assert not lease.lost
        row = ledger.get(dispatch_id)
        assert row is not None and (row.status, row.claim_token) == ("active", token)
    assert failing.calls >= 3
    assert any(
        dispatch_id in record.getMessage() and record.levelno >= logging.WARNING
        for record in caplog.records
        if record.name == "questpie_celery.worker.leases"
    ), "the failed renewal was not logged"


class FailingFirst:
    """`ledger.claims.renew_lease` that raises each of `errors` in turn on its first calls,
    then renews."""

    def __init__(self, ledger: Ledger, *errors: BaseException) -> None:
        self._renew = ledger.claims.renew_lease
        self._errors = list(errors)
        self.calls = 0

    def __call__(self, dispatch_id: str, token: str, lease_seconds: float) -> Renewal | None:
        self.calls += 1
        if self._errors:
            raise self._errors.pop(0)
        return self._renew(dispatch_id, token, lease_seconds)


def test_a_renewal_failing_otherwise_after_an_outage_is_a_warning(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The outage's own line tells of an unreachable ledger, so the claim's word of it is
    # INFO; a renewal that then fails for another reason (a bug, a held row) is news that
    # no other line tells, and the claim may lapse on it.
    dispatch_id, token = _claimed(ledger)
    failing = FailingFirst(
        ledger, LedgerUnavailableError("the ledger is down"), RuntimeError("a bug")
    )
    monkeypatch.setattr(ledger.claims, "renew_lease", failing)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with (
        caplog.at_level(logging.DEBUG, logger="questpie_celery.worker.leases"),
        keeper.hold(dispatch_id, token, 60),
    ):
        wait_until(lambda: failing.calls >= 3, "a renewal after both errors")
    said = [
        (record.levelno, record.getMessage())
        for record in caplog.records
        if record.name == "questpie_celery.worker.leases" and dispatch_id in record.getMessage()
    ]
    assert [level for level, message in said if "LedgerUnavailableError" in message] == [
        logging.INFO
    ], said
    assert [level for level, message in said if "RuntimeError" in message] == [logging.WARNING], (
        said
    )


def test_a_dead_renewer_is_restarted_by_the_next_hold(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatch_id, token = _claimed(ledger)
    # A BaseException is not caught by the renewer's loop: it ends the thread, which is
    # the death the keeper must recover from. Its report is taken here, not by pytest.
    deaths: list[tuple[str, type[BaseException]]] = []

    def died(args: threading.ExceptHookArgs) -> None:
        deaths.append((args.thread.name if args.thread else "", args.exc_type))

    monkeypatch.setattr(threading, "excepthook", died)
    failing = FailingOnce(ledger, SystemExit(0))
    monkeypatch.setattr(ledger.claims, "renew_lease", failing)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with keeper.hold(dispatch_id, token, 60):
        first = keeper._thread
        assert first is not None
        assert failing.raised.wait(10), "the renewer never tried to renew"
        wait_until(lambda: not first.is_alive(), "the renewer thread to die")
        assert deaths == [("questpie-leases", SystemExit)]
        stalled = _expires(ledger, dispatch_id)
    # The run goes on under a new hold (the next claim this process holds).
    with keeper.hold(dispatch_id, token, 60) as lease:
        second = keeper._thread
        assert second is not None and second is not first and second.is_alive()
        renewed = wait_until(
            lambda: _advanced_past(ledger, dispatch_id, stalled), "a renewal by the new thread"
        )
        wait_until(lambda: _advanced_past(ledger, dispatch_id, renewed), "a second renewal")
        assert not lease.lost
    assert failing.calls >= 3


def test_renewal_stops_when_the_claim_is_lost(ledger: Ledger) -> None:
    """The other side of renewal: a claim that is no longer ours is reported lost."""
    dispatch_id, token = _claimed(ledger)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with keeper.hold(dispatch_id, token, 60) as lease:
        assert ledger.claims.finish(dispatch_id, token, "failed", "Lost") is True
        wait_until(lambda: lease.lost, "the lease to be reported lost")


def test_renewal_stops_past_max_age(ledger: Ledger) -> None:
    """Past expire_in_seconds the claim is left to lapse: the row stops advancing."""
    dispatch_id, token = _claimed(ledger)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with keeper.hold(dispatch_id, token, max_age_seconds=0.0):
        expired = wait_until(
            lambda: any(row.id == dispatch_id for row in ledger.claims.expired()),
            "the lease to lapse",
        )
        assert expired


def test_a_run_past_a_cap_that_ends_its_process_kills_it_before_the_lease_lapses(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefork pool process the pool's kill never reached ends itself at its cap,
    while its claim is still live, and only while the run still holds it."""
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(leases.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    dispatch_id, token = _claimed(ledger)
    keeper = LeaseKeeper(ledger, lease_seconds=LEASE)
    with keeper.hold(dispatch_id, token, max_age_seconds=0.0, ends_process=True) as lease:
        wait_until(lambda: killed, "the process to end itself")
        assert killed[0] == (os.getpid(), signal.SIGKILL)
        assert not any(row.id == dispatch_id for row in ledger.claims.expired())
    # A run that has returned is recording its outcome: never cut off.
    count = len(killed)
    keeper._end_process(lease)
    assert len(killed) == count


def test_a_ledger_slow_on_every_read_still_frees_lapsed_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalled read of lapsed leases ends none of them (the holders waited behind the
    same stall); but a ledger that is that slow on every read is slow, not stalled, and a
    dead worker's lease must still end, or its slot would be held for ever."""
    app = IdleApp.build(tmp_path)
    try:
        new = new_dispatch(status="queued")
        assert app.ledger.dispatches.insert(new)
        assert app.ledger.claims.claim(new.id, "record", 1, lease_seconds=-1).outcome == "claimed"
        monkeypatch.setattr(relay, "STALL_SECONDS", -1.0)  # every read counts as stalled
        for _ in range(relay.MAX_STALLS_IN_A_ROW):
            assert app.questpie.run_relay(once=True, end_lapsed_leases=True) == 0
            row = app.ledger.get(new.id)
            assert row is not None and row.status == "active"
        assert app.questpie.run_relay(once=True, end_lapsed_leases=True) == 1
        row = app.ledger.get(new.id)
        assert row is not None and (row.status, row.last_error) == ("retry", "LeaseExpired")
    finally:
        app.close()


# --- a pool process that stood still past its lease ------------------------------------

#: Long enough that a loaded machine never leaves a renewal five sixths of a lease late.
STALL_LEASE = 3.0


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def _hold_in_a_pool_process(
    url: str,
    dispatch_id: str,
    token: str,
    *,
    watch_continue: bool,
    renew: Callable[[Ledger], Callable[[str, str, float], Renewal | None]] | None = None,
) -> tuple[int, int]:
    """Fork a process that acts as a prefork pool process holding the claim: it notes
    on a pipe that it holds it, then the monotonic time of each step of its "handler",
    every few milliseconds, until it is killed. Returns its pid and the pipe's read end."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    try:
        os.close(read)
        leases._in_prefork_child = True
        if watch_continue:
            leases._watch_for_continue()
        ledger = open_ledger(url)
        if renew is not None:
            ledger.claims.renew_lease = renew(ledger)  # type: ignore[method-assign]
        keeper = LeaseKeeper(ledger, lease_seconds=STALL_LEASE)
        with keeper.hold(dispatch_id, token, 600):
            os.write(write, b"holding\n")
            while True:
                os.write(write, f"{time.monotonic()}\n".encode())
                time.sleep(0.005)
    finally:
        os._exit(0)


def _steps(read: int) -> list[float]:
    """The steps the forked process wrote after it held the claim, once it has ended."""
    with os.fdopen(read, "rb") as pipe:
        return [float(line) for line in pipe.read().decode().split() if line != "holding"]


def _claimed_for_stall(ledger: Ledger) -> tuple[str, str]:
    new = new_dispatch()
    assert ledger.dispatches.insert(new) is True
    claim = ledger.claims.claim(new.id, new.job_name, 1, STALL_LEASE)
    assert claim.outcome == "claimed" and claim.token is not None
    return new.id, claim.token


def _stall_past_the_lease(
    ledger: Ledger, pid: int, dispatch_id: str, before_continue: Callable[[], object] = bool
) -> float:
    """Stop the process until its claim has lapsed in the ledger, call `before_continue`,
    continue it; return the monotonic time just before it was continued."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _stopped(pid), "the process to stop")
    # Well past the lapse: a process continued right at it may still renew in time.
    wait_until(
        lambda: sqlite_now(ledger) - _expires(ledger, dispatch_id) > timedelta(seconds=0.5),
        "the claim to lapse while its process stands still",
    )
    before_continue()
    resumed_at = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    return resumed_at


def _ended_by(pid: int) -> int | None:
    """The signal that ended the process, None when it exited."""
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None


@pytest.mark.parametrize("watch_continue", [True, False], ids=["continued", "renewer-sees-it"])
def test_a_pool_process_stopped_past_its_lease_ends_itself_when_it_wakes(
    tmp_path: Path, watch_continue: bool
) -> None:
    """A prefork pool process stopped (SIGSTOP, a debugger, a paused VM) until its claim
    lapsed ends itself as it wakes. Continued by SIGCONT, it checks in the handler's own
    thread before any more of the handler's Python runs. Without that check, its renewal
    thread sees the stall when it runs; or, if the stop caught it in the middle of a
    renewal, that renewal finds the claim gone: the relay ended it meanwhile, as here."""
    url = sqlite_url(tmp_path)
    ledger = open_ledger(url)
    ledger.migration.migrate()
    dispatch_id, token = _claimed_for_stall(ledger)
    pid, read = _hold_in_a_pool_process(url, dispatch_id, token, watch_continue=watch_continue)
    try:
        with os.fdopen(os.dup(read), "rb", buffering=0) as pipe:
            assert pipe.readline() == b"holding\n"
            float(pipe.readline())  # the handler took a step
        relay_ends_it = (
            bool
            if watch_continue
            else lambda: ledger.claims.finish(dispatch_id, token, "failed", "LeaseExpired")
        )
        resumed_at = _stall_past_the_lease(ledger, pid, dispatch_id, relay_ends_it)
        assert _ended_by(pid) == signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    steps = _steps(read)
    if watch_continue:
        assert not [step for step in steps if step > resumed_at], "the handler went on"


def test_a_pool_process_whose_renewal_finds_the_claim_gone_ends_itself(
    tmp_path: Path,
) -> None:
    url = sqlite_url(tmp_path)
    ledger = open_ledger(url)
    ledger.migration.migrate()
    dispatch_id, token = _claimed_for_stall(ledger)
    pid, read = _hold_in_a_pool_process(url, dispatch_id, token, watch_continue=True)
    try:
        with os.fdopen(os.dup(read), "rb", buffering=0) as pipe:
            assert pipe.readline() == b"holding\n"
        # The relay ended the claim (a lapse it saw while this process was cut off).
        assert ledger.claims.finish(dispatch_id, token, "failed", "LeaseExpired") is True
        assert _ended_by(pid) == signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.close(read)


def test_a_ledger_out_of_reach_longer_than_a_lease_is_not_a_stall(tmp_path: Path) -> None:
    """Renewals that fail (the ledger down or cut off) leave the run going: the relay
    ends no lapsed lease while it cannot reach the ledger either, and once a renewal
    goes through, the claim is the run's own again."""
    url = sqlite_url(tmp_path)
    ledger = open_ledger(url)
    ledger.migration.migrate()
    dispatch_id, token = _claimed_for_stall(ledger)
    back = tmp_path / "ledger-back"

    def down_until_back(child: Ledger) -> Callable[[str, str, float], Renewal | None]:
        renew = child.claims.renew_lease

        def renewing(dispatch_id: str, token: str, lease_seconds: float) -> Renewal | None:
            if not back.exists():
                raise LedgerUnavailableError("the ledger is down")
            return renew(dispatch_id, token, lease_seconds)

        return renewing

    pid, read = _hold_in_a_pool_process(
        url, dispatch_id, token, watch_continue=True, renew=down_until_back
    )
    try:
        with os.fdopen(os.dup(read), "rb", buffering=0) as pipe:
            assert pipe.readline() == b"holding\n"
            lapsed_at = _expires(ledger, dispatch_id)
            wait_until(
                lambda: any(row.id == dispatch_id for row in ledger.claims.expired()),
                "the claim to lapse while the ledger is out of reach",
            )
            back.touch()
            wait_until(
                lambda: _advanced_past(ledger, dispatch_id, lapsed_at), "a renewal once it is back"
            )
            pipe.readline()  # the handler still takes steps
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "the process ended"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    os.close(read)


def test_a_renewal_that_answers_late_but_in_time_does_not_end_the_pool_process(
    tmp_path: Path,
) -> None:
    """One renewal takes 0.6 of a lease to answer (a paused pooler, a lock wait: no
    failure, an answer late). The claim never lapses and the process never stood still:
    a stalled ledger is not a stalled process, and the run goes on."""
    url = sqlite_url(tmp_path)
    ledger = open_ledger(url)
    ledger.migration.migrate()
    dispatch_id, token = _claimed_for_stall(ledger)
    slow = tmp_path / "slow"

    def slow_once(child: Ledger) -> Callable[[str, str, float], Renewal | None]:
        renew = child.claims.renew_lease
        answered_late: list[bool] = []

        def renewing(dispatch_id: str, token: str, lease_seconds: float) -> Renewal | None:
            if slow.exists() and not answered_late:
                answered_late.append(True)
                time.sleep(0.6 * STALL_LEASE)  # the ledger's stall, in the ledger's place
            return renew(dispatch_id, token, lease_seconds)

        return renewing

    pid, read = _hold_in_a_pool_process(
        url, dispatch_id, token, watch_continue=True, renew=slow_once
    )
    try:
        with os.fdopen(os.dup(read), "rb", buffering=0) as pipe:
            assert pipe.readline() == b"holding\n"
        slow.touch()
        # The slow renewal, and two after it, land: each moves the lease's end.
        mark = _expires(ledger, dispatch_id)
        for _ in range(3):
            mark = wait_until(
                lambda seen=mark: _advanced_past(ledger, dispatch_id, seen), "the next renewal"
            )
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), "a slow ledger was taken for a stall"
        assert not any(row.id == dispatch_id for row in ledger.claims.expired())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    os.close(read)
