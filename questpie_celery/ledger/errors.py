"""SQLAlchemy's errors turned into the package's own, once, at the ledger's boundary."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, event, exc
from sqlalchemy.engine import ExceptionContext

from ..errors import LedgerBusyError, LedgerError, LedgerSchemaError, LedgerUnavailableError

_PG_LOCK_NOT_AVAILABLE = "55P03"
#: The server rolled the whole statement back to break a deadlock (or a serialization
#: conflict): running it again is safe.
_PG_ROLLED_BACK = ("40P01", "40001")
#: A table or a column the statement names is not there: `migrate` has not run (or not
#: since the package was upgraded).
_PG_UNDEFINED = ("42P01", "42703")
_SQLITE_UNDEFINED = ("no such table", "no such column")
#: A server that only reads: a standby, or a primary being demoted mid-failover.
_PG_READ_ONLY = "25006"
#: A server-side prepared statement that this server connection has under the same name
#: already, or has not: what a pooler in transaction mode does to psycopg's prepared
#: statements (the ledger prepares none by name of its own).
_PG_PREPARED_STATEMENT = ("42P05", "26000")
#: A statement prepared on a connection before a migration changed the type of a column
#: it returns ("cached plan must not change result type"): PostgreSQL refuses it there
#: each time, before it reads or writes anything.
_PG_STALE_PLAN = ("0A000", "cached plan must not change result type")
#: How PgBouncer (and poolers that copy it) refuses a startup parameter it does not know.
_REFUSED_STARTUP = re.compile(r"unsupported startup parameter:?\s*(\w*)")
#: What to do about either, in every entry point's words.
POOLED_HINT = "pass pooled=True (--pooled, QUESTPIE_POOLED)"


class SlotTaken(Exception):
    """A statement met a queue-policy slot index (internal to the ledger)."""


def drop_stale_plans(engine: Engine) -> None:
    """Take a statement that PostgreSQL refuses as prepared before a migration (see
    `_PG_STALE_PLAN`) for a lost connection: SQLAlchemy then drops that connection and
    every other one the pool opened before it (which prepared the same statements), and
    `Reruns` runs the statement again on a fresh one. Without this, every process that
    ran before `migrate` (a worker, a publisher) would fail those statements until its
    connections closed. psycopg prepares a statement on its sixth run on a connection."""
    if not event.contains(engine, "handle_error", _stale_plan_is_a_disconnect):
        event.listen(engine, "handle_error", _stale_plan_is_a_disconnect)


def _stale_plan_is_a_disconnect(context: ExceptionContext) -> None:
    error = context.original_exception
    sqlstate, message = _PG_STALE_PLAN
    if getattr(error, "sqlstate", None) == sqlstate and message in str(error):
        context.is_disconnect = True


def was_rolled_back(error: BaseException) -> bool:
    """The server undid the statement to let a concurrent one finish."""
    return getattr(getattr(error, "orig", None), "sqlstate", None) in _PG_ROLLED_BACK


def is_disconnect(error: BaseException) -> bool:
    """The statement's connection was found dead (the server restarted or killed it)."""
    return isinstance(error, exc.DBAPIError) and error.connection_invalidated


class Reruns:
    """When one ledger statement runs again: once on a fresh connection when its
    connection was found dead, and (`after_rollback`) up to three times when the server
    undid it to break a deadlock, which a multi-row insert meeting another in the
    opposite order can cause. Nothing of an undone statement was written."""

    def __init__(self, *, after_rollback: bool, log: logging.Logger | None = None) -> None:
        self._after_rollback = after_rollback
        self._log = log  # where a reconnect is told, if anywhere
        self._deadlocks = 0
        #: It ran on a second connection: its first run may have landed unseen.
        self.reconnected = False

    def again(self, error: exc.DBAPIError) -> bool:
        """Whether to run the statement again after `error`."""
        if self._after_rollback and was_rolled_back(error) and self._deadlocks < 3:
            self._deadlocks += 1
            return True
        if self.reconnected or not is_disconnect(error):
            return False
        self.reconnected = True
        if self._log is not None:
            self._log.info("ledger connection was dropped by the server; reconnecting")
        return True


#: What creates the ledger's tables, unless the connections' owner says otherwise.
MIGRATE_COMMAND = "questpie-celery migrate"


def schema_missing(migrate_command: str = MIGRATE_COMMAND) -> LedgerSchemaError:
    """The error of a ledger whose tables are missing or out of date, saying what to run."""
    return LedgerSchemaError(
        f"The dispatch ledger tables are missing or out of date; run `{migrate_command}`."
    )


@contextmanager
def translate_errors(migrate_command: str = MIGRATE_COMMAND) -> Iterator[None]:
    """Raise `LedgerError` subclasses for whatever SQLAlchemy raises inside the block
    (`migrate_command`: what a missing table's error tells the user to run)."""
    try:
        yield
    except exc.DBAPIError as error:
        raise _translate(error, migrate_command) from error
    except exc.SQLAlchemyError as error:
        raise LedgerError(f"ledger statement failed: {type(error).__name__}") from error


def _translate(error: exc.DBAPIError, migrate_command: str) -> LedgerError:
    sqlstate = getattr(error.orig, "sqlstate", None)
    refused = _REFUSED_STARTUP.search(str(error.orig))
    if refused is not None:
        # Permanent, but a LedgerUnavailableError all the same: a worker then sends its
        # delivery back to the broker instead of acknowledging it unrun.
        parameter = f" {refused.group(1)!r}" if refused.group(1) else ""
        return LedgerUnavailableError(
            f"the ledger's database refused the startup parameter{parameter}: it is "
            f"reached through a connection pooler in transaction mode (PgBouncer); "
            f"{POOLED_HINT}"
        )
    if sqlstate in _PG_PREPARED_STATEMENT:
        return LedgerUnavailableError(
            "a prepared statement went missing or met another client's between "
            "statements: the ledger's database is reached through a connection pooler "
            f"in transaction mode (PgBouncer); {POOLED_HINT}, and make an engine= of "
            "your own with connect_args={'prepare_threshold': None}"
        )
    if sqlstate in _PG_UNDEFINED or any(text in str(error.orig) for text in _SQLITE_UNDEFINED):
        return schema_missing(migrate_command)
    if sqlstate == _PG_LOCK_NOT_AVAILABLE:
        return LedgerBusyError(
            "a ledger row is held by another open transaction (lock_timeout reached); "
            "try again once it ends"
        )
    if sqlstate in _PG_ROLLED_BACK:
        return LedgerBusyError(
            "concurrent publishes of the same keys or slots met head-on (the database "
            "rolled this statement back); try again"
        )
    if sqlstate == _PG_READ_ONLY:
        return LedgerUnavailableError(
            "the dispatch ledger database is read-only just now (a standby, or a failover "
            "in progress)"
        )
    if error.connection_invalidated or isinstance(error, exc.OperationalError | exc.InterfaceError):
        # The driver's first line says why (refused, timed out, auth failed); connection
        # errors carry no statement parameters, so nothing of a payload.
        reason = str(error.orig).strip().splitlines()[0] if str(error.orig).strip() else ""
        return LedgerUnavailableError(
            "the dispatch ledger database cannot be reached: "
            f"{type(error.orig).__name__}{': ' + reason if reason else ''}"
        )
    # Other driver messages may quote statement values: keep only the class.
    return LedgerError(f"ledger statement failed: {type(error.orig).__name__}")
