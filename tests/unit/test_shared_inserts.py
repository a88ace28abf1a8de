"""Concurrent single publishes sharing one insert: who runs which statement, in what
order, with which answer, and what an error or a fork does to the others.

The inserts here are recording functions; the same rules on a real PostgreSQL (keys and
policies decided as one thread would) are in tests/integration/test_send_behind.py and
tests/integration/test_policies.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from questpie_celery.errors import LedgerError, LedgerUnavailableError
from questpie_celery.ledger.rows import NewDispatch
from questpie_celery.shared_inserts import SharedInserts
from tests.unit.helpers import new_dispatch


class Ledger:
    """`insert` and `insert_many` that record each statement; the first `insert` can be
    held, so that publishes queue behind it."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.statements: list[list[str]] = []
        self.threads: list[str] = []
        self.taken = taken or set()  # ids "already in the ledger": not inserted
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.fail_many_with: BaseException | None = None
        self._lock = threading.Lock()

    def insert(self, row: NewDispatch) -> bool:
        self._record([row])
        self.entered.set()
        assert self.hold.wait(10)
        return row.id not in self.taken

    def insert_many(self, rows: Sequence[NewDispatch]) -> set[str]:
        self._record(rows)
        if self.fail_many_with is not None:
            raise self.fail_many_with
        return {row.id for row in rows if row.id not in self.taken}

    def _record(self, rows: Sequence[NewDispatch]) -> None:
        with self._lock:
            self.statements.append([row.id for row in rows])
            self.threads.append(threading.current_thread().name)


def queued(shared: SharedInserts) -> int:
    return len(shared._queue)


def wait_for(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def publish_behind_a_held_insert(
    ledger: Ledger, shared: SharedInserts, rows: list[NewDispatch]
) -> tuple[dict[str, Any], list[threading.Thread]]:
    """A first publish held inside its insert, then `rows` published one by one from
    threads of their own (each queued before the next starts). Returns each publish's
    answer (or error) by row id, filled in once the threads are joined, and the threads."""
    answers: dict[str, Any] = {}
    ledger.hold.clear()
    first = new_dispatch()

    def publish(row: NewDispatch) -> None:
        try:
            answers[row.id] = shared.insert(row)
        except BaseException as exc:  # the answer under test
            answers[row.id] = exc

    threads = [threading.Thread(target=publish, args=(first,), name="first")]
    threads[0].start()
    assert ledger.entered.wait(10)
    for number, row in enumerate(rows):
        thread = threading.Thread(target=publish, args=(row,), name=f"t{number}")
        thread.start()
        threads.append(thread)
        wait_for(lambda number=number: queued(shared) == number + 1)
    return answers, threads


def test_a_publish_alone_inserts_at_once_on_its_own_statement() -> None:
    ledger = Ledger(taken={"known"})
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    row = new_dispatch()
    assert shared.insert(row) is True
    assert shared.insert(new_dispatch(id="known")) is False
    assert ledger.statements == [[row.id], ["known"]]
    assert queued(shared) == 0 and shared._busy is False


def test_publishes_behind_one_in_flight_share_the_next_statement_in_arrival_order() -> None:
    rows = [new_dispatch() for _ in range(5)]
    ledger = Ledger(taken={rows[2].id})
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert ledger.statements[1:] == [[row.id for row in rows]]
    # One of them ran it; each got its own answer.
    assert ledger.threads[1] in {f"t{number}" for number in range(len(rows))}
    assert [answers[row.id] for row in rows] == [True, True, False, True, True]
    assert shared._busy is False and queued(shared) == 0


def test_rows_that_cannot_share_a_statement_get_their_own_in_order() -> None:
    a1, a2 = new_dispatch("a"), new_dispatch("a")
    b1 = new_dispatch("b")
    a3 = new_dispatch("a")
    later = new_dispatch("a", send_in=30.0)
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, [a1, a2, b1, a3, later])
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert ledger.statements[1:] == [[a1.id, a2.id], [b1.id], [a3.id], [later.id]]
    assert all(answers[row.id] is True for row in (a1, a2, b1, a3, later))


def test_an_error_of_a_shared_statement_is_raised_by_each_of_its_publishes() -> None:
    rows = [new_dispatch() for _ in range(3)]
    ledger = Ledger()
    ledger.fail_many_with = LedgerUnavailableError("the ledger is down")
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    errors = [answers[row.id] for row in rows]
    assert all(isinstance(error, LedgerUnavailableError) for error in errors)
    assert all(str(error) == "the ledger is down" for error in errors)
    assert len({id(error) for error in errors}) == 3  # one each: no shared traceback
    # Nothing is left in flight: the next publish inserts at once.
    ledger.fail_many_with = None
    row = new_dispatch()
    assert shared.insert(row) is True
    assert ledger.statements[-1] == [row.id]


def test_an_interrupted_shared_statement_fails_the_publishes_it_did_not_write() -> None:
    rows = [new_dispatch("a"), new_dispatch("a"), new_dispatch("b")]
    ledger = Ledger()
    ledger.fail_many_with = KeyboardInterrupt()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    # The publishes of the interrupted statement get the interruption (one of them the
    # original, the others a copy). The row whose statement never ran is not written: its
    # publish says so, or (when it was the one running the statements) is interrupted.
    assert isinstance(answers[rows[0].id], KeyboardInterrupt)
    assert isinstance(answers[rows[1].id], KeyboardInterrupt)
    last = answers[rows[2].id]
    assert isinstance(last, KeyboardInterrupt) or (
        isinstance(last, LedgerError) and "not written" in str(last)
    )
    assert [rows[2].id] not in ledger.statements
    assert shared._busy is False and queued(shared) == 0


class Interrupted(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="setitimer")
def test_a_publish_interrupted_while_it_waits_leaves_nobody_waiting_for_it() -> None:
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    behind = [new_dispatch() for _ in range(2)]
    answers, threads = publish_behind_a_held_insert(ledger, shared, behind)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGALRM, interrupt)
    mine = new_dispatch()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            shared.insert(mine)  # waits behind the held insert until the signal
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert queued(shared) == len(behind)  # its row left the queue; theirs wait on
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert [answers[row.id] for row in behind] == [True, True]
    assert all(mine.id not in statement for statement in ledger.statements)
    after = new_dispatch()
    assert shared.insert(after) is True
    assert ledger.statements[-1] == [after.id]


def test_a_publish_made_while_its_thread_runs_the_statement_goes_alone() -> None:
    """A publish from inside the running statement (a signal handler's) would otherwise
    wait for that statement to end: for ever."""
    ledger = Ledger()
    inner = new_dispatch()
    outer = new_dispatch()
    nested: list[bool] = []
    plain_insert = ledger.insert

    def insert_publishing_again(row: NewDispatch) -> bool:
        if row is outer:
            nested.append(shared.insert(inner))
        return plain_insert(row)

    shared = SharedInserts(insert_publishing_again, ledger.insert_many)
    assert shared.insert(outer) is True
    assert nested == [True]
    assert ledger.statements == [[inner.id], [outer.id]]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_while_an_insert_is_in_flight_inserts_at_once() -> None:
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, [new_dispatch()])
    assert shared._busy
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(10)
            ledger.hold.set()  # the child's copy: its own first insert is not held
            ok = shared.insert(new_dispatch()) is True and queued(shared) == 0
            os._exit(0 if ok else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert all(answer is True for answer in answers.values())
