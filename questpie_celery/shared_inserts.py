"""Concurrent publishes of one process share an insert: a group commit.

A keyed publish returns once its row is on disk, so each waits for a commit. When
threads of one process publish at the same moment, each would otherwise send its own
statement and wait for its own commit in turn. Here a publish that finds another's insert
in flight waits for that one to end, and then goes into one multi-row insert with every
row that queued meanwhile: one statement and one commit for all of them. A publish that
finds nothing in flight inserts its row at once, so a thread publishing alone never waits
for another.

The rows of one statement are decided in the order their publishes arrived, as that many
publishes one after another would decide them: a key inserted earlier in the statement
comes back not inserted (that publish answers with the key's id), and a policy slot taken
earlier in it is refused. Rows that cannot share a statement (another job, other options,
a start of their own) go in statements of their own, in the same order. An error of a
shared statement is raised by each publish whose row was in it; none of them returns an
id for a row it cannot vouch for.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import LedgerError
from .forking import reset_in_child
from .ledger.inserts import same_statement
from .ledger.rows import NewDispatch

InsertOne = Callable[[NewDispatch], bool]
InsertMany = Callable[[Sequence[NewDispatch]], set[str]]


@dataclass(eq=False)
class _Queued:
    """One publish's row, waiting for a statement."""

    row: NewDispatch
    inserted: bool = False
    error: BaseException | None = None
    answered: bool = False


class SharedInserts:
    """One process's inserts of single publishes (see the module's text).

    No publish is ever named to run another's statement: whoever finds nothing in flight
    runs every row queued at that moment, its own among them, and wakes the others when
    it ends. So a publish interrupted while it waits (a KeyboardInterrupt) only takes its
    own row out of the queue, and leaves nobody waiting for it.
    """

    _changed: threading.Condition
    _busy: bool  # a statement is in flight
    _queue: list[_Queued]
    _running: int | None

    def __init__(self, insert_one: InsertOne, insert_many: InsertMany) -> None:
        self._insert_one = insert_one
        self._insert_many = insert_many
        self._forked()
        reset_in_child(self._forked)

    def _forked(self) -> None:
        # A child forked while a statement was in flight inherits neither that statement's
        # thread nor the publishes waiting for it: it starts with nothing in flight.
        self._changed = threading.Condition(threading.Lock())
        self._busy = False
        self._queue = []
        self._running: int | None = None  # the thread running the statement in flight

    def insert(self, row: NewDispatch) -> bool:
        """Insert `row` as `Ledger.insert` does (True if inserted), in a statement shared
        with the rows of concurrent publishes when one is already in flight."""
        if self._running == threading.get_ident():
            # A publish made while this thread runs the statement in flight (a signal
            # handler's): waiting for that statement to end would wait for ever.
            return self._insert_one(row)
        queued = _Queued(row)
        with self._changed:
            self._queue.append(queued)
            try:
                while self._busy and not queued.answered:
                    self._changed.wait()
            except BaseException:
                if queued in self._queue:  # not taken into a statement: not written
                    self._queue.remove(queued)
                raise
            if not queued.answered:
                rows, self._queue = self._queue, []
                self._busy = True
                self._running = threading.get_ident()
        if not queued.answered:
            try:
                self._run(rows, queued)
            finally:
                with self._changed:
                    self._busy = False
                    self._running = None
                    self._changed.notify_all()
        if queued.error is not None:
            raise queued.error
        return queued.inserted

    def _run(self, rows: list[_Queued], mine: _Queued) -> None:
        """Insert `rows` (a statement for each run of rows that can share one) and give
        each its answer; `mine` is the row of the publish running them."""
        try:
            for group in _groups(rows):
                try:
                    if len(group) == 1:
                        group[0].inserted = self._insert_one(group[0].row)
                    else:
                        inserted = self._insert_many([queued.row for queued in group])
                        for queued in group:
                            queued.inserted = queued.row.id in inserted
                except BaseException as exc:
                    for queued in group:
                        queued.error = exc if queued is mine else _copied(exc)
                    if not isinstance(exc, Exception):
                        raise  # what ends a thread ends this one, once the others know
                finally:
                    for queued in group:
                        queued.answered = True
        finally:
            for queued in rows:
                if not queued.answered:
                    # Its statement never ran: the publish running them was interrupted.
                    queued.error = LedgerError(
                        "this dispatch was not written: the publish that was writing it "
                        "with others was interrupted; publish it again"
                    )
                    queued.answered = True


def _groups(rows: list[_Queued]) -> list[list[_Queued]]:
    """Consecutive rows that can share one statement, in order."""
    groups: list[list[_Queued]] = []
    for queued in rows:
        if groups and same_statement(groups[-1][0].row, queued.row):
            groups[-1].append(queued)
        else:
            groups.append([queued])
    return groups


def _copied(error: BaseException) -> BaseException:
    """Each publish raises an exception of its own: one object raised in several threads
    would gather all their tracebacks."""
    try:
        clone = copy.copy(error)
    except Exception:
        return error
    clone.__cause__ = error.__cause__
    return clone
