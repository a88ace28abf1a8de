"""One connection kept open for the hottest statements.

A keyed publish makes one statement on the driver's cursor, a fenced run two (see
`direct.py`). Checking a connection out of SQLAlchemy's pool and back in around each
cost about as much CPU again as running the statement, most of it after the thread had
waited on the server's answer. So the process keeps one connection open between those
statements, for whichever thread runs one next: a thread that finds it in use by another
takes a connection from the pool, as every statement did before.

The kept connection is the process's own, outside the pool (detached from it when
opened): one more connection than the pool's, for as long as the process runs them. It
is closed as soon as a statement on it raises anything, or is handed to SQLAlchemy's
execution: what is kept has only ever run statements that succeeded on the driver's
cursor, in autocommit, so it holds no transaction and no lock, and an interrupted
statement that the server still works on is never followed by another on it. A
connection the server closed while it was kept is found by the next statement as an idle
pooled one would be: dead, and the statement rerun on a fresh connection
(`Executor._run`).

Nothing here waits for a lock: a signal's exception (Celery's soft time limit) landing
anywhere in it costs at most the short cut, never a hang. A forked child drops its
parent's connection without a word on the socket (psycopg closes only what its own
process opened) and without touching the pool, which another thread of the parent may
have held locked at the fork.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine

from .._runtime.forking import reset_in_child

#: In a forked child, the connections its parent kept: never used, closed or collected.
_INHERITED: list[Connection] = []


class HotConnection:
    """The connection `engine`'s hottest statements run on (see the module's text)."""

    _turn: threading.Lock

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The kept connection (none, or one), in a box the finalizer shares: it must not
        # hold `self`.
        self._kept: list[Connection] = []
        self._forked()
        reset_in_child(self._forked)
        weakref.finalize(self, _close_all, self._kept)

    def _forked(self) -> None:
        # Also the first set-up. A fork may come while another thread has the turn: the
        # child starts with it free. The parent's connection is left as it is, referenced
        # so that nothing of it runs in the child, not even its collection.
        _INHERITED.extend(self._kept)
        self._kept.clear()
        self._turn = threading.Lock()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection for one statement: the kept one unless another thread has it,
        else one from the pool. Kept afterwards only if the block ended without an
        exception and left it open; a caller that closes it lets it go."""
        if not self._turn.acquire(blocking=False):
            with self._engine.connect() as conn:
                yield conn
            return
        try:
            conn = self._kept.pop() if self._kept else self._open()
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            if not conn.closed:
                self._kept.append(conn)
        finally:
            self._turn.release()

    def _open(self) -> Connection:
        conn = self._engine.connect()
        conn.detach()  # the process's own from now on: closed, not pooled, when let go
        return conn

    def close(self) -> None:
        """Close the kept connection (a statement running on it now keeps it until the
        object is collected, or the interpreter exits)."""
        _close_all(self._kept)


def _close_all(kept: list[Connection]) -> None:
    while kept:
        try:
            conn = kept.pop()
        except IndexError:  # taken meanwhile by a statement, which keeps it
            return
        conn.close()
