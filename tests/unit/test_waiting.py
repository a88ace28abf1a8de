"""Waiting for an unreachable ledger (`LedgerWait`): the pauses double up to their cap,
none runs past the deadline, running out is the caller's to decide, and the step's own
line is INFO once, then DEBUG. On a clock the test moves: nothing really sleeps."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from questpie_celery.errors import LedgerBusyError, LedgerSchemaError, LedgerUnavailableError
from questpie_celery.ledger import Ledger, open_ledger
from questpie_celery.worker.waiting import TRANSIENT, LedgerWait
from tests.unit.helpers import sqlite_url

DOWN = LedgerUnavailableError("the dispatch ledger database cannot be reached: Connection refused")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    made = open_ledger(sqlite_url(tmp_path))  # only its outage is used: no statement runs
    yield made
    made.close()


def waiting(
    ledger: Ledger, clock: Clock, *, waits_for: tuple[type[Exception], ...] = TRANSIENT
) -> LedgerWait:
    return LedgerWait(
        ledger,
        patience=10.0,
        first_pause=1.0,
        max_pause=4.0,
        waits_for=waits_for,
        clock=clock,
        sleep=clock.sleep,
    )


def failing(times: int, error: Exception = DOWN, result: str = "done") -> Callable[[], str]:
    left = [times]

    def step() -> str:
        if left[0] > 0:
            left[0] -= 1
            raise error
        return result

    return step


def test_an_outage_is_waited_out_with_pauses_that_double_up_to_their_cap(
    ledger: Ledger, clock: Clock
) -> None:
    told: list[int] = []
    result = waiting(ledger, clock).run(
        failing(4), tell=lambda level, exc: told.append(level), within=100.0
    )
    assert result == "done"
    assert clock.slept == [1.0, 2.0, 4.0, 3.0]  # the last pause ends at the deadline
    assert told == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.DEBUG]
    assert not ledger.outage.down  # told it failed, and then that it was reached


def test_past_the_deadline_the_error_is_raised_unless_the_caller_keeps_waiting(
    ledger: Ledger, clock: Clock
) -> None:
    with pytest.raises(LedgerUnavailableError):
        waiting(ledger, clock).run(failing(100), tell=lambda level, exc: None)
    assert clock.now == 1010.0  # the last try was at the deadline, none after it
    assert ledger.outage.down

    clock.slept.clear()
    ran_out: list[Exception] = []
    result = waiting(ledger, clock).run(
        failing(6), tell=lambda level, exc: None, out_of_time=ran_out.append
    )
    assert result == "done"
    assert clock.slept == [1.0, 2.0, 4.0, 3.0, 4.0, 4.0]  # full pauses once it ran out
    assert len(ran_out) == 2  # the tries at the deadline and after it


def test_a_shorter_bound_moves_the_deadline_and_running_out_may_end_the_wait(
    ledger: Ledger, clock: Clock
) -> None:
    def send_back(exc: Exception) -> None:
        raise Ignore()

    with pytest.raises(Ignore):
        waiting(ledger, clock).run(
            failing(100), tell=lambda level, exc: None, out_of_time=send_back, within=2.5
        )
    assert clock.slept == [1.0, 1.5]


def test_a_held_row_is_told_as_a_warning_and_errors_not_waited_for_pass_at_once(
    ledger: Ledger, clock: Clock
) -> None:
    told: list[int] = []
    wait = waiting(ledger, clock, waits_for=(*TRANSIENT, LedgerSchemaError))
    wait.run(failing(2, LedgerBusyError("row held")), tell=lambda level, exc: told.append(level))
    wait.run(
        failing(1, LedgerSchemaError("not migrated")), tell=lambda level, exc: told.append(level)
    )
    assert told == [logging.WARNING, logging.DEBUG, logging.WARNING]
    assert not ledger.outage.down  # a held row or a missing schema is no outage

    with pytest.raises(LedgerSchemaError):
        waiting(ledger, clock).run(failing(1, LedgerSchemaError("x")), tell=lambda level, exc: None)
    with pytest.raises(LedgerUnavailableError):  # an eager run waits for nothing
        wait.run(failing(1), tell=lambda level, exc: None, waits_for=())
    assert not ledger.outage.down  # and reports nothing either


def test_a_soft_time_limit_in_the_wait_is_the_callers_to_handle(
    ledger: Ledger, clock: Clock
) -> None:
    step = failing(2, SoftTimeLimitExceeded())  # type: ignore[no-untyped-call]
    heard: list[SoftTimeLimitExceeded] = []
    assert waiting(ledger, clock).run(step, tell=lambda level, exc: None, soft_limit=heard.append)
    assert len(heard) == 2
    with pytest.raises(SoftTimeLimitExceeded):
        waiting(ledger, clock).run(
            failing(1, SoftTimeLimitExceeded()),  # type: ignore[no-untyped-call]
            tell=lambda level, exc: None,
        )
