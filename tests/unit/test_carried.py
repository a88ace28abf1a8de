"""A process holds a completion for its next claim only while it is busy: one end that
waited for nothing makes it record the next ones at once, until a claim follows an end
closely again (no database: what would record is a list)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import cast

import pytest

from questpie_celery.ledger import CarriedEnd, DispatchRow
from questpie_celery.worker import carried
from tests.support.waiting import wait_until


def _row(dispatch_id: str) -> DispatchRow:
    return cast(DispatchRow, SimpleNamespace(id=dispatch_id, job_name="job"))


def _end(dispatch_id: str) -> CarriedEnd:
    return CarriedEnd(dispatch_id, "token", None)


@pytest.fixture
def recorded() -> list[str]:
    return []


@pytest.fixture
def holder(recorded: list[str]) -> carried.Carried:
    return carried.Carried(lambda row, end: recorded.append(row.id), idle=lambda: None)


def test_a_held_completion_is_taken_by_the_next_claim_of_another_dispatch(
    holder: carried.Carried, recorded: list[str]
) -> None:
    assert holder.hold(_row("a"), _end("a"), longest=60)
    assert holder.take(not_for="a") is None  # never its own dispatch's claim
    taken = holder.take(not_for="b")
    assert taken is not None and taken[1].dispatch_id == "a"
    holder.flush()
    assert recorded == []


def test_an_end_no_claim_took_makes_the_process_record_the_next_at_once(
    holder: carried.Carried, recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(carried, "CARRY_SECONDS", 0.01)
    assert holder.hold(_row("a"), _end("a"), longest=60)
    wait_until(lambda: recorded == ["a"], "the thread to record the end alone")
    assert not holder.hold(_row("b"), _end("b"), longest=60)  # idle: the caller records
    # A claim right after an end: busy again, and the next end is held.
    monkeypatch.setattr(carried, "CARRY_SECONDS", 60.0)
    assert holder.take(not_for="c") is None
    assert holder.hold(_row("c"), _end("c"), longest=60)
    holder.flush()
    assert recorded == ["a", "c"]


def test_a_completion_is_never_held_past_the_longest_it_may_wait(
    holder: carried.Carried, recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """However long the window, a completion waits no longer than its lease allows."""
    monkeypatch.setattr(carried, "CARRY_SECONDS", 3600.0)
    assert holder.hold(_row("a"), _end("a"), longest=0.01)
    wait_until(lambda: recorded == ["a"], "the end recorded within its lease's share")


def test_a_failed_carrying_claim_gives_the_completion_back_to_be_recorded_at_once(
    holder: carried.Carried, recorded: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(carried, "CARRY_SECONDS", 3600.0)
    assert holder.hold(_row("a"), _end("a"), longest=3600)
    taken = holder.take(not_for="b")
    assert taken is not None
    holder.give_back(taken)
    wait_until(lambda: recorded == ["a"], "the given-back end recorded alone")


def test_a_run_starts_only_once_the_completion_being_recorded_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread is recording a completion alone (patiently, through an outage) when
    the process claims its next delivery: `settle` waits for that record before the
    run begins, so no run starts while an earlier completion is unrecorded. (Found by
    the soak: a kill after such a run started was taken for a second run outside the
    window.)"""
    monkeypatch.setattr(carried, "CARRY_SECONDS", 0.0)
    recording, release = threading.Event(), threading.Event()
    recorded: list[str] = []

    def record_slowly(row: DispatchRow, end: CarriedEnd) -> None:
        recording.set()
        release.wait(30)
        recorded.append(row.id)

    holder = carried.Carried(record_slowly, idle=lambda: None)
    assert holder.hold(_row("a"), _end("a"), longest=60)
    wait_until(recording.is_set, "the thread to take the completion")
    settled = threading.Event()
    settling = threading.Thread(target=lambda: (holder.settle(), settled.set()))
    settling.start()
    assert not settled.wait(0.2)  # still recording: the run may not start
    release.set()
    settling.join(30)
    assert settled.is_set() and recorded == ["a"]
