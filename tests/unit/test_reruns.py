"""When one ledger statement runs again: the loop the sync and asyncio executors share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
from sqlalchemy import exc

from questpie_celery.ledger.errors import Reruns, SlotTaken


class _Deadlock(Exception):
    sqlstate = "40P01"


def _dropped() -> exc.DBAPIError:
    return exc.DBAPIError("SELECT 1", None, ConnectionError("gone"), connection_invalidated=True)


def _run(reruns: Reruns, failures: list[Exception]) -> tuple[str, int]:
    runs = 0
    for attempt in reruns.attempts():
        with attempt:
            runs += 1
            if failures:
                raise failures.pop(0)
            return "done", runs
    raise AssertionError("the loop ended without a result")


def test_a_dropped_connection_runs_the_statement_once_more_and_says_so() -> None:
    reruns = Reruns(after_rollback=False)
    assert _run(reruns, [_dropped()]) == ("done", 2)
    assert reruns.reconnected


def test_a_second_dropped_connection_is_raised() -> None:
    with pytest.raises(exc.DBAPIError):
        _run(Reruns(after_rollback=False), [_dropped(), _dropped()])


def test_a_deadlock_runs_again_only_when_asked_and_at_most_three_times() -> None:
    def deadlock() -> exc.DBAPIError:
        return exc.DBAPIError("INSERT", None, _Deadlock())

    assert _run(Reruns(after_rollback=True), [deadlock() for _ in range(3)]) == ("done", 4)
    with pytest.raises(exc.DBAPIError):
        _run(Reruns(after_rollback=True), [deadlock() for _ in range(4)])
    with pytest.raises(exc.DBAPIError):
        _run(Reruns(after_rollback=False), [deadlock()])


def test_a_slot_index_refusal_is_slot_taken_and_not_run_again() -> None:
    refused = exc.IntegrityError("INSERT", None, ValueError("duplicate key"))
    with pytest.raises(SlotTaken):
        _run(Reruns(after_rollback=True), [refused])


def test_any_other_error_propagates_unchanged() -> None:
    with pytest.raises(KeyError):
        _run(Reruns(after_rollback=True), [KeyError("x")])


def test_a_connection_dropped_at_commit_after_the_result_runs_it_again() -> None:
    """A relaxed ledger's durable statement commits when its block exits, after the
    result was taken: a connection dropped then reruns the statement all the same."""
    commits = [_dropped()]

    @contextmanager
    def connected() -> Iterator[None]:
        yield
        if commits:
            raise commits.pop(0)

    reruns, runs = Reruns(after_rollback=False), 0

    def run() -> str:
        nonlocal runs
        for attempt in reruns.attempts():
            with attempt, connected():
                runs += 1
                return "done"
        raise AssertionError("the loop ended without a result")

    assert (run(), runs, reruns.reconnected) == ("done", 2, True)


def test_the_asyncio_executor_reruns_by_the_same_loop() -> None:
    failures = [_dropped()]

    @asynccontextmanager
    async def connected() -> AsyncIterator[None]:
        await asyncio.sleep(0)
        yield
        if failures:
            raise failures.pop(0)

    async def run() -> int:
        runs = 0
        for attempt in Reruns(after_rollback=False).attempts():
            with attempt:
                async with connected():
                    runs += 1
                    return runs
        raise AssertionError("the loop ended without a result")

    assert asyncio.run(run()) == 2
