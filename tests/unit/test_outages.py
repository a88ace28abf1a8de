"""How an outage is told: once when it starts, with its cause, then at most once a
reminder's period, and once when it ends; a dependency that comes and goes is told of at
most once a period too. On a clock the test moves."""

from __future__ import annotations

import logging

import pytest

from questpie_celery._runtime.outages import Outage, describe, duration
from questpie_celery.errors import LedgerUnavailableError

CAUSE = LedgerUnavailableError("the dispatch ledger database cannot be reached: Connection refused")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "questpie_celery._runtime.outages"]


def test_one_line_when_it_starts_a_reminder_a_minute_and_one_when_it_ends(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    outage = Outage("the dispatch ledger", clock=clock)
    caplog.set_level(logging.WARNING)
    for _ in range(150):  # a failure every second for two and a half minutes
        outage.failed(CAUSE)
        clock.now += 1
    outage.reached()
    outage.reached()
    said = lines(caplog)
    assert said == [
        "the dispatch ledger cannot be reached (the dispatch ledger database cannot be "
        "reached: Connection refused); waiting for it, and saying so again every 1 min "
        "while it lasts",
        "the dispatch ledger still cannot be reached, for 1 min now (the dispatch ledger "
        "database cannot be reached: Connection refused)",
        "the dispatch ledger still cannot be reached, for 2 min now (the dispatch ledger "
        "database cannot be reached: Connection refused)",
        "the dispatch ledger can be reached again, after 2 min 30 s",
    ]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
    assert not outage.down


def test_a_dependency_that_comes_and_goes_is_told_of_once_a_minute_at_most(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    outage = Outage("the broker", clock=clock)
    caplog.set_level(logging.WARNING)
    for _ in range(60):  # down for a second, back for a second, for two minutes
        outage.failed("ConnectionError: Connection refused")
        clock.now += 1
        outage.reached()
        clock.now += 1
    said = lines(caplog)
    assert len(said) == 4, said  # down, back, and a minute later down, back
    assert said[0].startswith("the broker cannot be reached (ConnectionError")
    assert said[1] == "the broker can be reached again, after 1 s"
    assert said[2].startswith("the broker cannot be reached")


def test_a_failure_that_outlasts_the_quiet_period_after_a_return_is_told(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    outage = Outage("the dispatch ledger", clock=clock)
    caplog.set_level(logging.WARNING)
    outage.failed(CAUSE)
    clock.now += 5
    outage.reached()
    clock.now += 5
    outage.failed(CAUSE)  # soon after the "back" line: not yet
    assert len(lines(caplog)) == 2
    clock.now += 55
    outage.failed(CAUSE)  # still down a minute after the last line: told, from its start
    said = lines(caplog)
    assert len(said) == 3 and said[2].startswith("the dispatch ledger cannot be reached")
    clock.now += 1
    outage.reached()
    assert lines(caplog)[-1] == "the dispatch ledger can be reached again, after 56 s"


def test_a_return_never_told_of_an_outage_says_nothing(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    outage = Outage("the dispatch ledger", clock=clock)
    caplog.set_level(logging.WARNING)
    outage.reached()  # up all along
    assert lines(caplog) == []


def test_a_cause_is_one_line_with_its_class_and_never_runs_long() -> None:
    assert describe(ConnectionRefusedError(111, "Connection refused")) == (
        "ConnectionRefusedError: [Errno 111] Connection refused"
    )
    assert describe(OSError("first line\nsecond line")) == "OSError: first line"
    assert describe(CAUSE) == str(CAUSE)  # our own errors say it themselves
    assert len(describe("x" * 10_000)) == 300


def test_durations_read_as_a_person_would_say_them() -> None:
    assert [duration(s) for s in (0.4, 59, 60, 185, 3600, 7800)] == [
        "0 s", "59 s", "1 min", "3 min 5 s", "1 h", "2 h 10 min",
    ]  # fmt: skip
