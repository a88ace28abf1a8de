"""One pooled connection kept out of the pool for the hottest statements.

A keyed publish makes one statement on the driver's cursor, a fenced run two (see
`direct.py`). Checking a connection out of SQLAlchemy's pool and back in around each
cost about as much CPU again as running the statement, most of it after the thread had
waited on the server's answer. So the process keeps one connection checked out between
those statements, for whichever thread runs one next: a thread that finds it in use by
another takes a connection from the pool, as every statement did before.

The connection goes back to the pool (which resets it, or finds it dead and drops it) as
soon as a statement on it raises anything, or is handed to SQLAlchemy's execution: what
is kept has only ever run statements that succeeded on the driver's cursor, in
autocommit, so it holds no transaction and no lock. A connection the server closed while
it was kept is found by the next statement as an idle pooled one would be: dead, rerun on
a fresh connection (`Executor._run`).

A child process never touches its parent's connection (a rollback sent on the shared
socket would corrupt the parent's session): it forgets it, and opens its own. The kept
connection goes back to the pool when the ledger closes, and when it is collected or the
interpreter exits without that (a checked-out connection collected unreturned makes
SQLAlchemy warn, and the server's session would end without a goodbye).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, Engine

from ..forking import reset_in_child


class HotConnection:
    """The connection `engine`'s hottest statements run on (see the module's text)."""

    _lock: threading.Lock

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The kept connection (none, or one), in a box the finalizer shares: it must not
        # hold `self`.
        self._kept: list[Connection] = []
        self._forked()
        reset_in_child(self._forked)
        weakref.finalize(self, _give_back, self._kept)

    def _forked(self) -> None:
        # Also the first set-up. A fork may come while another thread runs a statement on
        # the kept connection: the child starts with the lock free and no connection.
        # The parent's is taken out of the pool's care without a word on its socket: once
        # collected, neither the pool nor psycopg (which closes only connections its own
        # process opened) sends anything on it.
        while self._kept:
            self._kept.pop().detach()
        self._lock = threading.Lock()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        """A connection for one statement: the kept one unless another thread has it,
        else one from the pool. Kept afterwards only if the block ended without an
        exception and left it open; a caller that closes it gives it back to the pool."""
        if not self._lock.acquire(blocking=False):
            with self._engine.connect() as conn:
                yield conn
            return
        try:
            conn = self._kept.pop() if self._kept else self._engine.connect()
            try:
                yield conn
            except BaseException:
                conn.close()  # back to the pool, which resets it or drops it
                raise
            if not conn.closed:
                self._kept.append(conn)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Give the kept connection back to the pool (before the pool is disposed)."""
        with self._lock:
            _give_back(self._kept)


def _give_back(box: list[Connection]) -> None:
    """Give the connection in `box` (if any) back to its pool."""
    while box:
        box.pop().close()
