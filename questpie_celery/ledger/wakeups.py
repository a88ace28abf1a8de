"""Waking the relays when a caller's transaction commits rows for them (PostgreSQL).

A row written by `publish(connection=...)` has no after-commit hook to send it, so the
relay sends it. Its publish also notifies `RELAY_WAKE_CHANNEL` inside the caller's
transaction (`ledger.relay.wake_relays`); PostgreSQL delivers the notification only when that
transaction commits, which is exactly when the row becomes visible. Each relay listens
on a connection of its own and makes a pass when notified, instead of waiting out its
interval. Notifications are only a hint: a relay still polls, and a lost notification or
listening connection costs at most an interval.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from sqlalchemy import Engine, exc

from ..errors import LedgerUnavailableError
from .errors import translate_errors
from .statements import LISTEN_FOR_SENDS


class SendWakeups:
    """One relay's listening connection: `open()`, then `wait()` for notifications."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        # The psycopg module, as SQLAlchemy loaded it: psycopg is an optional dependency.
        self._driver: Any = engine.dialect.loaded_dbapi
        self._conn: Any = None  # a psycopg.Connection while open

    @classmethod
    def for_engine(cls, engine: Engine) -> SendWakeups | None:
        """A listener on `engine`'s database, or None where it cannot listen: SQLite has
        no notifications, and waiting for one with a timeout needs psycopg 3.2 or later."""
        if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
            return None
        notifies = engine.dialect.loaded_dbapi.Connection.notifies
        if "timeout" not in inspect.signature(notifies).parameters:
            return None
        return cls(engine)

    def open(self) -> None:
        """(Re)open the listening connection; raises `LedgerUnavailableError` if it cannot.

        The connection comes from the engine's pool, whose idle connections may all be
        dead after a server restart: LISTEN failing on one is tried again on the next (a
        few times), so only a database that cannot be reached fails here.
        """
        self.close()
        for _ in range(_OPEN_TRIES - 1):
            with contextlib.suppress(_ListenFailed):
                self._conn = self._listening()
                return
        try:
            self._conn = self._listening()
        except _ListenFailed as failed:
            raise _unavailable(failed.error) from failed.error

    def _listening(self) -> Any:
        with translate_errors():
            try:
                pooled = self._engine.raw_connection()
            except self._driver.Error as error:
                # The pool hands the driver's own error on (only a Connection wraps it):
                # wrapped as a statement's would be, it says why as every ledger error does.
                raise exc.DBAPIError.instance(
                    None, None, error, self._driver.Error, connection_invalidated=True
                ) from error
        # Out of the pool for good: a listening connection is never free to hand to a
        # statement, and the pool keeps its whole size for statements.
        pooled.detach()
        conn: Any = pooled.dbapi_connection
        try:
            # LISTEN takes effect when its transaction commits: in autocommit, at once.
            conn.autocommit = True
            conn.execute(LISTEN_FOR_SENDS)
        except self._driver.Error as error:
            conn.close()
            raise _ListenFailed(error) from error
        return conn

    def wait(self, timeout: float) -> bool:
        """Whether a notification arrived within `timeout` seconds. Every notification
        that has arrived is consumed: one pass serves them all. Raises
        `LedgerUnavailableError` (and closes) when the connection was lost."""
        if self._conn is None:
            raise LedgerUnavailableError("the relay's listening connection is not open")
        try:
            woken = bool(list(self._conn.notifies(timeout=timeout, stop_after=1)))
            if woken:
                list(self._conn.notifies(timeout=0))  # those that arrived meanwhile
        except self._driver.Error as error:
            self.close()
            raise _unavailable(error) from error
        return woken

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # A connection the server already dropped closes as well as it can.
            with contextlib.suppress(Exception):
                conn.close()


#: Pooled connections LISTEN is tried on before the listener gives up for now.
_OPEN_TRIES = 4


class _ListenFailed(Exception):
    """LISTEN failed on a connection the pool handed out (dead, most likely)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _unavailable(error: Exception) -> LedgerUnavailableError:
    # The driver's first line says why (the server closed it, a timeout); connection
    # errors carry no statement values.
    lines = str(error).strip().splitlines()
    reason = f": {lines[0]}" if lines else ""
    return LedgerUnavailableError(
        f"the relay's listening connection to the ledger was lost: {type(error).__name__}{reason}"
    )
