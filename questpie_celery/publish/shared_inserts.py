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
a start of their own) go in statements of their own, in the same order.

What one publish cannot do to another:

- hold it up for long: a statement in flight for longer than `WAIT_SECONDS` waits for
  something other than the disk (a row lock another transaction holds), and a publish
  whose row still waits for a turn takes it out and inserts it on its own;
- fail it: when a shared statement fails, each of its rows is inserted again on its own,
  by its own publish, which so gets its own answer or its own error;
- leave it waiting: nobody is named to run another's statement (whoever finds nothing in
  flight runs every row queued at that moment and wakes the others when it ends), so a
  publish interrupted while it waits only takes its own row out, and one interrupted
  while it runs a statement leaves the others' rows to their own publishes;
- wait for itself: a publish made while its thread is already inside one (a signal
  handler's) inserts on its own.

Only connections that belong to no thread may carry another thread's row: on Django's
connections, each publish keeps its own statement (`ledger.dispatches.inserts_in_batches`). And only
the ledger's own engines share, whose statements give up on a row lock after the lock
timeout (5 s): a row in a shared statement cannot leave it, so a thread whose own open
transaction holds a key another thread publishes at that moment waits that long for a
publish of its own outside that transaction, where an engine without the timeout would
wait for ever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .._runtime.forking import reset_in_child
from ..errors import LedgerError
from ..ledger.inserts import same_statement
from ..ledger.rows import NewDispatch


class InsertOne(Protocol):
    """`ledger.dispatches.insert` without a caller's connection."""

    def __call__(self, new: NewDispatch, *, again: bool = False) -> bool: ...


InsertMany = Callable[[Sequence[NewDispatch]], set[str]]

#: How long a publish waits for the statement in flight before inserting on its own. A
#: commit takes milliseconds; a statement in flight this long waits for a lock.
WAIT_SECONDS = 0.1


@dataclass(eq=False)
class _Queued:
    """One publish's row, waiting for a statement."""

    row: NewDispatch
    inserted: bool = False
    error: BaseException | None = None
    #: Its statement failed, or never ran: its publish inserts it on its own, counting
    #: the row found under its id as its own (a failed statement may have written it).
    alone: bool = False
    answered: bool = False


class SharedInserts:
    """One process's inserts of single publishes (see the module's text)."""

    _changed: threading.Condition
    _busy: bool  # a statement is in flight
    _queue: list[_Queued]
    _inside: threading.local  # `inside`: this thread is in `insert` already

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
        self._inside = threading.local()

    def insert(self, row: NewDispatch) -> bool:
        """Insert `row` as `ledger.dispatches.insert` does (True if inserted), in a statement shared
        with the rows of concurrent publishes when one is already in flight."""
        inside = self._inside
        if getattr(inside, "inside", False):
            # A publish made while this thread is in one (a signal handler's): it may hold
            # the lock, or run the statement in flight; waiting would be for itself.
            return self._insert_one(row)
        inside.inside = True
        alone = False
        try:
            with self._changed:
                if not self._busy and not self._queue:
                    # Nothing in flight or waiting: this row's statement is the one in
                    # flight now, with no queue entry of its own to take or answer.
                    self._busy = alone = True
            if alone:
                return self._insert_one(row)  # at once: its statement is the one in flight
            queued = self._take_turn(row)
            if queued is None:
                return self._insert_one(row)
            if queued.alone:
                return self._insert_one(row, again=True)
            if queued.error is not None:
                raise queued.error
            return queued.inserted
        finally:
            if alone:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()  # rows that queued meanwhile: one leads
            inside.inside = False

    def _take_turn(self, row: NewDispatch) -> _Queued | None:
        """Wait for `row`'s statement and return its answer; None when the row is to be
        inserted on its own (the statement in flight took too long)."""
        queued = _Queued(row)
        rows: list[_Queued] = []
        leading = False
        try:
            with self._changed:
                self._queue.append(queued)
                try:
                    if not self._wait(queued):
                        self._queue.remove(queued)
                        return None
                except BaseException:
                    if queued in self._queue:  # not taken into a statement: not written
                        self._queue.remove(queued)
                    raise
                if queued.answered:
                    return queued
                leading = True  # before anything that can raise: see `finally`
                rows, self._queue = self._queue, []
                self._busy = True
            self._run(rows)
            return queued
        finally:
            if leading:
                for other in rows:
                    if not other.answered:
                        # Its statement never ran (this publish was interrupted): its own
                        # publish inserts it.
                        other.alone = other.answered = True
                with self._changed:
                    if self._queue is rows:  # interrupted while taking them: taken
                        self._queue = []
                    if queued in self._queue:  # interrupted before it took the rows
                        self._queue.remove(queued)
                    self._busy = False
                    self._changed.notify_all()

    def _wait(self, queued: _Queued) -> bool:
        """Under the lock: wait until `queued` is answered or may lead (nothing in flight).
        False when the statement in flight took too long while `queued` still waits for
        a turn: it then goes on its own."""
        deadline = time.monotonic() + WAIT_SECONDS
        while self._busy and not queued.answered:
            if queued not in self._queue:
                self._changed.wait()  # in the statement in flight: wait for its answer
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(left)
        return True

    def _run(self, rows: list[_Queued]) -> None:
        """Insert `rows` (a statement for each run of rows that can share one) and give
        each its answer, in the publish of one of them. The rows of a
        shared statement that failed go back to their own publishes, to be inserted on
        their own; a row alone gets its statement's error. Anything else raised here is
        this publish's own (an interruption): it propagates, and `_take_turn` gives the
        rows not answered yet back to their publishes."""
        for group in _groups(rows):
            try:
                if len(group) == 1:
                    inserted = {group[0].row.id} if self._insert_one(group[0].row) else set()
                else:
                    inserted = self._insert_many([queued.row for queued in group])
            except LedgerError as exc:
                if len(group) == 1:
                    group[0].error = exc  # its own: raised by its own publish only
                for queued in group:
                    queued.alone = len(group) > 1
                    queued.answered = True
                continue
            answered: set[str] = set()
            for queued in group:
                # A key twice in one statement: the first publish of it inserted it.
                queued.inserted = queued.row.id in inserted and queued.row.id not in answered
                answered.add(queued.row.id)
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
