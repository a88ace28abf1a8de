"""Concurrent single publishes sharing one insert: who runs which statement, in what
order, with which answer, and what a failing or held statement, an interruption, a
signal handler's publish or a fork does to the others.

The inserts here are recording functions; the same rules on a real PostgreSQL (keys and
policies decided as one thread would, commits shared) are in
tests/integration/test_send_behind.py and tests/integration/test_policies.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from questpie_celery.errors import LedgerBusyError, LedgerUnavailableError
from questpie_celery.ledger.rows import NewDispatch
from questpie_celery.publish import shared_inserts
from questpie_celery.publish.shared_inserts import SharedInserts
from tests.support.tracing import at_line
from tests.support.waiting import wait_until
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
        self.hold_only: str | None = None  # the one id held, when not every one is
        self.entered = threading.Event()
        self.fail_many_with: BaseException | None = None
        self.refused: set[str] = set()  # ids whose statement fails, alone or shared
        self.written: set[str] = set()
        self.fail_after_writing = False  # a shared statement raises once it wrote its rows
        self._lock = threading.Lock()

    def insert(self, row: NewDispatch, *, again: bool = False) -> bool:
        self._record([row])
        self.entered.set()
        if self.hold_only in (None, row.id):
            assert self.hold.wait(10)
        if row.id in self.refused:
            raise LedgerBusyError("a row lock is held")
        if row.id in self.taken:
            return False
        if row.id in self.written:
            return again  # written by a statement that failed after: ours, if told so
        self.written.add(row.id)
        return True

    def insert_many(self, rows: Sequence[NewDispatch]) -> set[str]:
        self._record(rows)
        if self.fail_many_with is not None:
            raise self.fail_many_with
        if any(row.id in self.refused for row in rows):
            raise LedgerBusyError("a row lock is held")
        inserted = {row.id for row in rows if row.id not in self.taken | self.written}
        self.written |= inserted
        if self.fail_after_writing:
            raise LedgerUnavailableError("the connection dropped during the commit")
        return inserted

    def _record(self, rows: Sequence[NewDispatch]) -> None:
        with self._lock:
            self.statements.append([row.id for row in rows])
            self.threads.append(threading.current_thread().name)


@pytest.fixture
def patient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishes wait for a held statement as long as a test holds it."""
    monkeypatch.setattr(shared_inserts, "WAIT_SECONDS", 30.0)


def queued(shared: SharedInserts) -> int:
    return len(shared._queue)


def publish_behind_a_held_insert(
    ledger: Ledger, shared: SharedInserts, rows: list[NewDispatch]
) -> tuple[dict[int, Any], list[threading.Thread]]:
    """A first publish held inside its insert, then `rows` published one by one from
    threads of their own (each queued before the next starts). Returns each publish's
    answer (or error) by its row's position in `rows` (the first's is -1), filled in once
    the threads are joined, and the threads."""
    answers: dict[int, Any] = {}
    ledger.hold.clear()

    def publish(number: int, row: NewDispatch) -> None:
        try:
            answers[number] = shared.insert(row)
        except BaseException as exc:  # the answer under test
            answers[number] = exc

    threads = [threading.Thread(target=publish, args=(-1, new_dispatch()), name="first")]
    threads[0].start()
    assert ledger.entered.wait(10)
    for number, row in enumerate(rows):
        thread = threading.Thread(target=publish, args=(number, row), name=f"t{number}")
        thread.start()
        threads.append(thread)
        wait_until(lambda number=number: queued(shared) == number + 1, "the row queued", 10, 0.001)
    return answers, threads


def release(ledger: Ledger, threads: list[threading.Thread]) -> None:
    ledger.hold.set()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)


def test_a_publish_alone_inserts_at_once_on_its_own_statement() -> None:
    ledger = Ledger(taken={"known"})
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    row = new_dispatch()
    assert shared.insert(row) is True
    assert shared.insert(new_dispatch(id="known")) is False
    assert ledger.statements == [[row.id], ["known"]]
    assert queued(shared) == 0 and shared._busy is False


def test_publishes_behind_one_in_flight_share_the_next_statement_in_arrival_order(
    patient: None,
) -> None:
    rows = [new_dispatch() for _ in range(5)]
    ledger = Ledger(taken={rows[2].id})
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    release(ledger, threads)
    assert ledger.statements[1:] == [[row.id for row in rows]]
    # One of them ran it; each got its own answer.
    assert ledger.threads[1] in {f"t{number}" for number in range(len(rows))}
    assert [answers[number] for number in range(5)] == [True, True, False, True, True]
    assert shared._busy is False and queued(shared) == 0


def test_a_key_twice_in_one_statement_is_inserted_by_its_first_publish(patient: None) -> None:
    """As one after the other: the second publish of a key answers with its id and sends
    nothing (two `True`s would send its message twice)."""
    first = new_dispatch()
    again = NewDispatch(**{**vars(new_dispatch()), "id": first.id})
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, [first, again])
    release(ledger, threads)
    assert ledger.statements[1:] == [[first.id, first.id]]
    assert [answers[0], answers[1]] == [True, False]


def test_rows_that_cannot_share_a_statement_get_their_own_in_order(patient: None) -> None:
    a1, a2 = new_dispatch("a"), new_dispatch("a")
    b1 = new_dispatch("b")
    a3 = new_dispatch("a")
    later = new_dispatch("a", send_in=30.0)
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, [a1, a2, b1, a3, later])
    release(ledger, threads)
    assert ledger.statements[1:] == [[a1.id, a2.id], [b1.id], [a3.id], [later.id]]
    assert [answers[number] for number in range(5)] == [True] * 5


def test_a_failed_shared_statement_sends_each_row_back_to_be_inserted_on_its_own(
    patient: None,
) -> None:
    """Another row's lock must not fail a publish: each row of a statement that failed
    is inserted again by its own publish, which gets its own answer or its own error."""
    rows = [new_dispatch() for _ in range(4)]
    ledger = Ledger()
    ledger.refused = {rows[1].id}
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    release(ledger, threads)
    assert ledger.statements[1] == [row.id for row in rows]
    assert sorted(ledger.statements[2:]) == sorted([row.id] for row in rows)
    assert isinstance(answers[1], LedgerBusyError)
    assert [answers[0], answers[2], answers[3]] == [True, True, True]
    assert shared._busy is False and queued(shared) == 0


def test_rows_of_a_shared_statement_that_failed_after_writing_them_count_as_inserted(
    patient: None,
) -> None:
    """Its error may come after its commit (a connection lost then): each publish inserts
    its row again on its own, and the row found under its id is its own, so it is sent
    (a random id's row would otherwise be taken for a policy's refusal, and answered
    None while it runs)."""
    rows = [new_dispatch() for _ in range(3)]
    ledger = Ledger()
    ledger.fail_after_writing = True
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    release(ledger, threads)
    assert ledger.statements[1] == [row.id for row in rows]
    assert sorted(ledger.statements[2:]) == sorted([row.id] for row in rows)
    assert [answers[number] for number in range(3)] == [True, True, True]


def test_a_ledger_that_is_down_fails_each_publish_on_its_own(patient: None) -> None:
    rows = [new_dispatch() for _ in range(3)]
    ledger = Ledger()
    ledger.fail_many_with = LedgerUnavailableError("the ledger is down")
    ledger.refused = {row.id for row in rows}
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    release(ledger, threads)
    errors = [answers[number] for number in range(3)]
    assert all(isinstance(error, LedgerBusyError) for error in errors)
    assert len({id(error) for error in errors}) == 3  # one each: no shared traceback
    ledger.fail_many_with = None
    ledger.refused = set()
    row = new_dispatch()
    assert shared.insert(row) is True
    assert ledger.statements[-1] == [row.id]


def test_an_interrupted_statement_leaves_the_other_rows_to_their_own_publishes(
    patient: None,
) -> None:
    """The interruption is the publish's own that ran the statement (a KeyboardInterrupt,
    a signal handler's error): the others insert their rows on their own."""
    rows = [new_dispatch("a"), new_dispatch("a"), new_dispatch("b")]
    ledger = Ledger()
    ledger.fail_many_with = KeyboardInterrupt()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    answers, threads = publish_behind_a_held_insert(ledger, shared, rows)
    release(ledger, threads)
    interrupted = [n for n in range(3) if isinstance(answers[n], KeyboardInterrupt)]
    assert len(interrupted) == 1
    others = [rows[n] for n in range(3) if n not in interrupted]
    assert [answers[n] for n in range(3) if n not in interrupted] == [True, True]
    alone = [statement for statement in ledger.statements[2:] if len(statement) == 1]
    assert sorted(alone) == sorted([row.id] for row in others)
    assert shared._busy is False and queued(shared) == 0


def test_a_statement_held_up_by_a_lock_does_not_hold_up_the_next_publishes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A statement in flight for long waits for a lock another transaction holds: a
    publish behind it takes its row out and inserts it on its own meanwhile."""
    monkeypatch.setattr(shared_inserts, "WAIT_SECONDS", 0.05)
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    ledger.hold.clear()
    first = threading.Thread(target=shared.insert, args=(new_dispatch(),))
    first.start()
    assert ledger.entered.wait(10)
    ledger.hold.set = lambda: None  # type: ignore[method-assign]  # stays held below
    done: list[bool] = []
    row = new_dispatch()

    def go_alone(row: NewDispatch, *, again: bool = False) -> bool:
        ledger._record([row])
        return True

    shared._insert_one = go_alone
    later = threading.Thread(target=lambda: done.append(shared.insert(row)))
    later.start()
    later.join(10)
    assert done == [True]  # while the first statement is still held
    assert first.is_alive()
    assert ledger.statements[-1] == [row.id] and queued(shared) == 0
    threading.Event.set(ledger.hold)
    first.join(10)
    assert shared._busy is False


class Interrupted(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="setitimer")
def test_a_publish_interrupted_while_it_waits_leaves_nobody_waiting_for_it(
    patient: None,
) -> None:
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
    release(ledger, threads)
    assert [answers[0], answers[1]] == [True, True]
    assert all(mine.id not in statement for statement in ledger.statements)
    after = new_dispatch()
    assert shared.insert(after) is True
    assert ledger.statements[-1] == [after.id]


@contextlib.contextmanager
def nothing_in_flight(ledger: Ledger, shared: SharedInserts) -> Iterator[list[str]]:
    """This thread's publish finds nothing in flight: it runs its statement at once."""
    yield []


@contextlib.contextmanager
def one_in_flight(ledger: Ledger, shared: SharedInserts) -> Iterator[list[str]]:
    """Another thread's publish is in flight, and ends once this thread's row has queued
    behind it: this thread's publish then takes the lead. Yields the other's row id."""
    first = new_dispatch()
    ledger.hold_only = first.id
    ledger.hold.clear()
    publishing = threading.Thread(target=shared.insert, args=(first,))
    publishing.start()
    assert ledger.entered.wait(10)

    left = threading.Event()  # this thread's publish ended (before its row queued, maybe)

    def end_it() -> None:
        wait_until(lambda: queued(shared) == 1 or left.is_set(), "a row queued", 10, 0.001)
        ledger.hold.set()

    ending = threading.Thread(target=end_it)
    ending.start()
    try:
        yield [first.id]
    finally:
        left.set()
        for thread in (publishing, ending):
            thread.join(10)


#: Where a publish can be when a signal arrives: with nothing in flight (it runs its own
#: statement at once), or behind another's statement (it queues, then leads the next).
PLACES = [
    (SharedInserts.insert, "if alone:", nothing_in_flight),
    (SharedInserts.insert, "at once: its statement is the one in flight", nothing_in_flight),
    (SharedInserts._take_turn, "self._queue.append(queued)", one_in_flight),
    (SharedInserts._take_turn, "rows, self._queue", one_in_flight),
    (SharedInserts._take_turn, "self._busy = True", one_in_flight),
    (SharedInserts._take_turn, "self._run(rows)", one_in_flight),
]
PLACE_IDS = ["alone", "alone, running", "queueing", "taking the rows", "leading", "running"]


@pytest.mark.parametrize(("method", "where", "situation"), PLACES, ids=PLACE_IDS)
def test_a_signal_handler_publishing_while_its_thread_is_in_a_publish_goes_alone(
    patient: None, method: Callable[..., Any], where: str, situation: Any
) -> None:
    """Wherever the handler lands (the thread holding the lock, or about to run the
    statement), its publish neither waits for its own thread nor joins its statement."""
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)
    nested = new_dispatch()
    answers: list[bool] = []
    outer = new_dispatch()

    def publish_nested() -> None:
        answers.append(shared.insert(nested))

    with situation(ledger, shared) as before, at_line(method, where, publish_nested):
        assert shared.insert(outer) is True
    assert answers == [True]
    assert ledger.statements == [*([row] for row in before), [nested.id], [outer.id]]
    assert shared._busy is False and queued(shared) == 0


@pytest.mark.parametrize(("method", "where", "situation"), PLACES, ids=PLACE_IDS)
def test_an_interruption_in_a_publish_leaves_nothing_in_flight(
    patient: None, method: Callable[..., Any], where: str, situation: Any
) -> None:
    ledger = Ledger()
    shared = SharedInserts(ledger.insert, ledger.insert_many)

    def interrupt() -> None:
        raise KeyboardInterrupt

    with (
        situation(ledger, shared),
        at_line(method, where, interrupt),
        pytest.raises(KeyboardInterrupt),
    ):
        shared.insert(new_dispatch())
    assert shared._busy is False and queued(shared) == 0
    # Another thread's publish goes through (it would wait for ever on a statement
    # marked in flight that nobody runs).
    done: list[bool] = []
    row = new_dispatch()
    thread = threading.Thread(target=lambda: done.append(shared.insert(row)))
    thread.start()
    thread.join(10)
    assert done == [True]


def test_a_publish_made_while_its_thread_runs_the_statement_goes_alone() -> None:
    """A publish from inside the running statement (a signal handler's) would otherwise
    wait for that statement to end: for ever."""
    ledger = Ledger()
    inner = new_dispatch()
    outer = new_dispatch()
    nested: list[bool] = []
    plain_insert = ledger.insert

    def insert_publishing_again(row: NewDispatch, *, again: bool = False) -> bool:
        if row is outer:
            nested.append(shared.insert(inner))
        return plain_insert(row, again=again)

    shared = SharedInserts(insert_publishing_again, ledger.insert_many)
    assert shared.insert(outer) is True
    assert nested == [True]
    assert ledger.statements == [[inner.id], [outer.id]]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_while_an_insert_is_in_flight_inserts_at_once(patient: None) -> None:
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
    release(ledger, threads)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert all(answer is True for answer in answers.values())
