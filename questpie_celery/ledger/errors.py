"""SQLAlchemy's errors turned into the package's own, once, at the ledger's boundary."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from sqlalchemy import exc

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
#: A statement psycopg prepared on this connection whose result columns changed type since
#: (a `migrate` run while this process was up: schema version 5 widens the dispatch ids):
#: "cached plan must not change result type", raised before anything ran, on every run
#: of it on this connection. The function PostgreSQL names is not translated, its message is.
_PG_FEATURE_NOT_SUPPORTED = "0A000"
_STALE_PLAN_SOURCE = "RevalidateCachedQuery"
#: How PgBouncer (and poolers that copy it) refuses a startup parameter it does not know,
#: or (1.20 and later, which read `options`) a setting in `options` it does not carry.
_REFUSED_STARTUP = re.compile(r"unsupported startup parameter(?: in options)?:?\s*(\w*)")
#: What to do about either, in every entry point's words.
POOLED_HINT = "pass pooled=True (--pooled, QUESTPIE_POOLED)"


class SlotTaken(Exception):
    """A statement met a queue-policy slot index, or (`seat`) the concurrency limit's
    seat index (internal to the ledger)."""

    def __init__(self, *, seat: bool = False) -> None:
        super().__init__()
        self.seat = seat


#: The index of the concurrency limit's seats (`schema.py`), as PostgreSQL names it in the
#: error of a statement that meets it; SQLite names the index's columns instead.
SEAT_INDEX = "questpie_limit_seat"
_SEAT_COLUMN = "questpie_queue_dispatch.seat"


def _met_seat_index(message: str) -> bool:
    return SEAT_INDEX in message or _SEAT_COLUMN in message


def was_rolled_back(error: BaseException) -> bool:
    """The server undid the statement to let a concurrent one finish."""
    return getattr(getattr(error, "orig", None), "sqlstate", None) in _PG_ROLLED_BACK


def is_stale_plan(error: BaseException) -> bool:
    """A statement prepared on this connection no longer fits the tables (see
    `_STALE_PLAN_SOURCE`): it runs on a connection that has not prepared it."""
    orig = getattr(error, "orig", error)
    if getattr(orig, "sqlstate", None) != _PG_FEATURE_NOT_SUPPORTED:
        return False
    source = getattr(getattr(orig, "diag", None), "source_function", None)
    return source == _STALE_PLAN_SOURCE or "cached plan must not change" in str(orig)


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
        self._done = False
        #: It ran on a second connection: its first run may have landed unseen.
        self.reconnected = False

    def attempts(self) -> Iterator[Reruns]:
        """The runs of one statement, sync or asyncio alike::

            for attempt in reruns.attempts():
                with attempt:
                    ...  # run it; return its result

        A run that fails with an error `again` accepts is followed by another; one that
        meets a queue-policy slot index raises `SlotTaken`; anything else propagates.
        (Each attempt is this object: a plain `__exit__`, as cheap as the try it replaces
        on the ledger's hottest path.)
        """
        self._done = False
        while not self._done:
            yield self

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if error is None:
            self._done = True
            return False
        return self.after(error)

    def after(self, error: BaseException) -> bool:
        """Whether a run that failed with `error` is followed by another; raises
        `SlotTaken` for a queue-policy slot index's refusal."""
        if isinstance(error, exc.IntegrityError):
            # Only the queue-policy slot indexes and the seat index can refuse the ledger's
            # statements.
            raise SlotTaken(seat=_met_seat_index(str(error.orig))) from None
        return isinstance(error, exc.DBAPIError) and self.again(error)

    def again(self, error: exc.DBAPIError) -> bool:
        """Whether to run the statement again after `error`."""
        if self._after_rollback and was_rolled_back(error) and self._deadlocks < 3:
            self._deadlocks += 1
            return True
        if self.reconnected or not is_disconnect(error):
            return False
        self.reconnected = True
        if self._log is not None:
            self._log.info(
                "ledger connection was dropped by the server (or its prepared statements "
                "outlived a migration); reconnecting"
            )
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
    if is_stale_plan(error):
        # On an engine of the ledger's own the statement already ran again on a fresh
        # connection; an engine of one's own keeps the connection, and its stale plan.
        return LedgerUnavailableError(
            "a statement prepared before the ledger's tables were migrated no longer fits "
            "them; connections opened since run it (make an engine= of your own with "
            "connect_args={'prepare_threshold': None}, or restart this process)"
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
        # Connection errors carry no statement parameters, so nothing of a payload.
        said = connection_failure(str(error.orig))
        if said is not None:
            return LedgerUnavailableError(said)
        # Something else: the driver's first line says why.
        reason = str(error.orig).strip().splitlines()[0] if str(error.orig).strip() else ""
        return LedgerUnavailableError(
            "the dispatch ledger database cannot be reached: "
            f"{type(error.orig).__name__}{': ' + reason if reason else ''}"
        )
    # Other driver messages may quote statement values: keep only the class.
    return LedgerError(f"ledger statement failed: {type(error.orig).__name__}")


#: Where libpq says it tried to connect, in its connection errors.
_SERVER_AT = re.compile(
    r'connection to server (?:at "(?P<host>[^"]+)"(?: \([^)]*\))?, port (?P<port>\d+)'
    r'|on socket "(?P<socket>[^"]+)")'
)
_REFUSED = "the dispatch ledger database refused the connection: "
_UNREACHABLE = "the dispatch ledger database cannot be reached: "
_PG_HBA = (
    _REFUSED + "the server's pg_hba.conf lets no such connection in (this host, role and "
    "database); add a rule for it, or connect as a role that one allows"
)
#: libpq's (and psycopg's) reasons a connection failed, each with what it means and
#: what to do. A server localized with `lc_messages` says them in its language, and
#: gets the driver's first line instead.
_CONNECTION_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), said)
    for pattern, said in (
        (
            r'role "(?P<name>[^"]*)" does not exist',
            _REFUSED + 'the server has no role "{name}"; create it (CREATE ROLE "{name}" '
            "LOGIN PASSWORD '...') or put an existing role in the ledger URL",
        ),
        (
            r'database "(?P<name>[^"]*)" does not exist',
            _REFUSED + 'the server has no database "{name}"; create it (CREATE DATABASE '
            '"{name}" OWNER <role>), then run questpie-celery migrate',
        ),
        (
            r'password authentication failed for user "(?P<name>[^"]*)"',
            _REFUSED + 'authentication failed: the server refused the password of role "{name}"; '
            "correct it in the ledger URL (percent-encoded: '@' is %40) or reset the role's",
        ),
        (
            r"no password supplied",
            _REFUSED + "the server asks for a password and the ledger URL gives none; write "
            "postgresql+psycopg://role:password@host/db (or use PGPASSWORD, a .pgpass file)",
        ),
        (
            r'(?P<method>\w+) authentication failed for user "(?P<name>[^"]*)"',
            _REFUSED + 'authentication failed: {method} authentication of role "{name}", '
            "which the server's pg_hba.conf asks for from this host; connect as a role it "
            "allows, or change the rule",
        ),
        (
            # Refused over TLS too (libpq's sslmode=prefer tries it first): TLS is not it.
            r"(?:no pg_hba.conf entry|pg_hba.conf rejects connection)[^\n]*SSL encryption",
            _PG_HBA,
        ),
        (
            # PostgreSQL says this of every unencrypted connection its pg_hba.conf refuses,
            # a rule for TLS only (hostssl, hostnossl ... reject) or none at all alike.
            r"no encryption|SSL off",
            _REFUSED + "the server's pg_hba.conf lets no unencrypted connection in for this "
            "host, role and database: if it takes them over TLS, add sslmode=require to the "
            "ledger URL (sslmode=verify-full, with sslrootcert=, also checks whose "
            "certificate it is); otherwise add a rule for them to pg_hba.conf, or connect "
            "as a role one allows",
        ),
        (
            r"SSL connection is required",
            _REFUSED + "the server takes this connection only over TLS; add sslmode=require "
            "to the ledger URL (sslmode=verify-full, with sslrootcert=, also checks whose "
            "certificate it is)",
        ),
        (
            r"server does not support SSL, but SSL was required",
            _REFUSED + "the ledger URL requires TLS (its sslmode) and the server offers none; "
            "turn ssl on at the server, or lower sslmode in the URL",
        ),
        (r"no pg_hba.conf entry|pg_hba.conf rejects connection", _PG_HBA),
        (
            r"too many clients already|remaining connection slots are reserved",
            _REFUSED + "the server has no connection left for this role (max_connections); "
            "close idle clients, or put a pooler in front (pooled=True)",
        ),
        (
            r"connection refused",
            _UNREACHABLE + "nothing accepts connections at {where} (connection refused); is "
            "PostgreSQL running there, on that port? (the ledger URL's port, 5432 when none)",
        ),
        (
            r'socket "(?P<name>[^"]*)" failed: No such file or directory',
            _UNREACHABLE + 'no server listens on the socket "{name}"; is PostgreSQL running '
            "on this machine, and is the URL's host= the folder of its socket?",
        ),
        (
            r"failed to resolve host '(?P<name>[^']*)'|"
            r'could not translate host name "(?P<other>[^"]*)"',
            _UNREACHABLE + 'the host name "{name}" does not resolve; correct the host in the '
            "ledger URL (or its DNS)",
        ),
        (
            r"timeout expired|timed out",
            _UNREACHABLE + "no answer from {where} before the connect timeout; the host is "
            "down or a firewall drops the traffic to that port (check the ledger URL's host "
            "and port)",
        ),
        (
            r"no route to host|network is unreachable",
            _UNREACHABLE + "there is no route from here to {where}; check the host in the "
            "ledger URL, and this machine's network",
        ),
    )
)


def connection_failure(text: str) -> str | None:
    """What a driver's connection error means and what to do, or None for another error."""
    for pattern, said in _CONNECTION_FAILURES:
        found = pattern.search(text)
        if found is None:
            continue
        groups = found.groupdict()
        at = _SERVER_AT.search(text)
        where = "the ledger URL's host"
        if at is not None:
            host, port, socket = at.group("host", "port", "socket")
            where = f'socket "{socket}"' if socket else f'host "{host}", port {port}'
        name = groups.get("name") or groups.get("other") or ""
        return said.format(name=name, method=groups.get("method") or "", where=where)
    return None
