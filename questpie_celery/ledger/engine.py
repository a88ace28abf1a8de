"""Ledger engines: creation tuned per dialect, and their life across forks.

Every ledger statement stands alone in autocommit, so `BEGIN`/`COMMIT` round
trips would be pure cost. There is no `pool_pre_ping` either (a round trip per
checkout): a statement that meets a connection the server dropped is retried
once on a fresh one by the store, which SQLAlchemy provides after invalidating
the pool.

A pooled engine (`pooled=True`: PostgreSQL reached through a pooler in transaction
mode, such as PgBouncer) keeps no state between transactions, since its next one
may run on another client's server connection: no startup parameters and no
server-side prepared statements. The settings an unpooled engine gives each
connection at startup are then set by each write statement for its own
transaction (see `statement_settings` and `statements.in_own_transaction`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from ..errors import ConfigurationError
from .errors import MIGRATE_COMMAND, is_stale_plan
from .urls import ledger_url

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

SQLITE_BUSY_TIMEOUT_MS = 15_000
PG_CONNECT_TIMEOUT_SECONDS = 5
PG_LOCK_TIMEOUT_MS = 5_000

#: Engines made by create_ledger_engine(), which already run in autocommit.
_AUTOCOMMIT_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def create_ledger_engine(url: str, *, relaxed: bool = False, pooled: bool = False) -> Engine:
    """Create an engine tuned for the ledger's access pattern on its dialect.

    `relaxed` trades the last moment of commits before a database server crash for
    speed: PostgreSQL's `synchronous_commit=off` (a commit returns before its WAL
    reaches disk; a crash loses at most about three times `wal_writer_delay`, 0.6 s by
    default, and never corrupts) and SQLite's `synchronous=NORMAL` in WAL mode (a power
    loss may roll back the last commits). Without it, every commit is on disk when it
    returns.

    `pooled` is for a PostgreSQL server reached through a pooler in transaction mode: the
    engine sends no startup parameters and prepares no statements on the server (see the
    module's docstring). It changes nothing on SQLite.
    """
    parsed = ledger_url(url)
    try:
        if parsed.get_backend_name() == "sqlite":
            engine = create_engine(
                parsed,
                # The URL's own timeout, if it gives one, wins.
                connect_args={}
                if "timeout" in parsed.query
                else {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
                hide_parameters=True,  # errors name no statement value: no payload in logs
            )
            _configure_sqlite(engine, relaxed=relaxed)
            return engine
        engine = create_engine(
            parsed,
            connect_args=_pg_connect_args(relaxed=relaxed, pooled=pooled, query=parsed.query),
            isolation_level="AUTOCOMMIT",
            hide_parameters=True,  # errors name no statement value: no payload in logs
        )
    except (ArgumentError, NoSuchModuleError) as error:
        raise ConfigurationError(f"invalid ledger URL: {error}") from None
    _replan_on_fresh_connections(engine)
    _AUTOCOMMIT_ENGINES.add(engine)
    return engine


def create_async_ledger_engine(engine: Engine, *, relaxed: bool, pooled: bool) -> AsyncEngine:
    """The asyncio twin of a PostgreSQL ledger engine made by `create_ledger_engine`:
    psycopg's async driver, the same server settings, autocommit.

    One serves one event loop: its pool's connections belong to the loop that opened them.
    """
    # Imported here: SQLAlchemy's asyncio layer needs greenlet, an optional extra.
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415

    made = create_async_engine(
        engine.url,
        connect_args=_pg_connect_args(relaxed=relaxed, pooled=pooled, query=engine.url.query),
        isolation_level="AUTOCOMMIT",
        hide_parameters=True,
    )
    _replan_on_fresh_connections(made.sync_engine)
    return made


def _replan_on_fresh_connections(engine: Engine) -> None:
    """A statement whose prepared plan a migration made stale counts as met on a dead
    connection: SQLAlchemy then drops every connection the pool opened before (each has
    the same stale plan), and the store runs the statement once more on a fresh one, as
    after a server restart. Without it, every process running across a `migrate` would
    fail those statements, claims included, until restarted."""

    @event.listens_for(engine, "handle_error")
    def _on_error(context: ExceptionContext) -> None:
        if is_stale_plan(context.original_exception):
            context.is_disconnect = True

    # The driver's cursor (direct.py) tells stale plans itself: this one needs no detour.
    _on_error.questpie_ledger_own = True  # type: ignore[attr-defined]


def statement_settings(*, relaxed: bool) -> dict[str, str]:
    """The server settings the ledger's own PostgreSQL connections run with: at startup
    on an unpooled engine, and set by each write statement for its own transaction on a
    pooled one (a pooler in transaction mode carries no session state)."""
    settings = {
        # A caller's long transaction that holds a policy slot row makes a publish
        # wait this long at most, then fail with a LedgerBusyError.
        "lock_timeout": str(PG_LOCK_TIMEOUT_MS),
    }
    if relaxed:
        settings["synchronous_commit"] = "off"
    return settings


def _pg_connect_args(*, relaxed: bool, pooled: bool, query: Mapping[str, object]) -> dict[str, Any]:
    """The connection arguments of the ledger's own PostgreSQL connections. What the
    URL sets itself (`query`) wins: SQLAlchemy lets connect arguments override the URL's,
    so each one the URL gives is left out here, and its `options` come after ours."""
    args: dict[str, Any] = {
        "connect_timeout": PG_CONNECT_TIMEOUT_SECONDS,
        # A connection whose server vanished without a word (a host gone, a network
        # cut) is found dead in about 30 s, not after the kernel's two hours: the
        # lease renewer must not hang on one while leases lapse.
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
    }
    if pooled:
        # psycopg prepares a statement on the server after its fifth run, under a name
        # that only the server connection it ran on knows: through a pooler, the next
        # run may land on another one ("prepared statement ... does not exist"), or
        # meet another client's statement of the same name ("... already exists").
        args["prepare_threshold"] = None
    else:
        # A pooler refuses startup parameters it does not know (PgBouncer's stock
        # settings refuse `options`), and would hand them to other clients otherwise.
        args["options"] = " ".join(
            f"-c {name}={value}" for name, value in statement_settings(relaxed=relaxed).items()
        )
        if "options" in query:
            args["options"] += f" {query['options']}"
    return {k: v for k, v in args.items() if k == "options" or k not in query}


def runs_in_autocommit(engine: Engine) -> bool:
    return engine in _AUTOCOMMIT_ENGINES


class AmbientTransaction(Protocol):
    """A transaction the caller opened with another framework, on the ledger's own
    connection (Django's `transaction.atomic()`): a publish made inside it writes its
    rows there and sends them once it commits, as `publish(session=...)` does."""

    @property
    def connection(self) -> Connection:
        """A Connection of the ledger's engine on that transaction's connection."""
        ...

    def after_commit(
        self, dispatch_ids: Sequence[str], send: Callable[[Sequence[str]], None]
    ) -> None:
        """Call `send(ids)` once the outermost transaction commits; never if the
        transaction, or the savepoint the rows were written in, rolls back."""
        ...


#: Opens the caller's ambient transaction for one publish: yields it, or None when the
#: caller is not inside one.
Ambient = Callable[[], AbstractContextManager[AmbientTransaction | None]]


@dataclass(frozen=True)
class Borrowed:
    """An engine whose connections belong to another framework (Django's, see
    `questpie_celery.contrib.django`): its owner opens, commits and closes them.

    The ledger then never changes their isolation level or autocommit (the owner's
    transaction may be open on them), and tells the owner when a thread of its own is
    between units of work, so the owner can apply its connection rules.
    """

    #: The calling thread is between units of work (a relay pass, a renewal round): the
    #: owner may close its connection if it is too old or unusable.
    idle: Callable[[], None]
    #: An engine of dedicated connections to the same database, for a relay's LISTEN
    #: (a listening connection cannot be shared); None where there is none.
    listener: Callable[[], Engine | None]
    #: The caller's open transaction on the calling thread's connection, if any.
    ambient: Ambient
    #: A transaction of the owner's (Django's `atomic`), for `migrate`: nested in the
    #: caller's when one is open, as a savepoint.
    atomic: Callable[[], AbstractContextManager[object]]
    #: What creates the ledger's tables there, for the error that says they are missing.
    migrate_command: str = MIGRATE_COMMAND


#: Engines whose connections another framework owns.
_BORROWED: weakref.WeakKeyDictionary[Engine, Borrowed] = weakref.WeakKeyDictionary()


def mark_borrowed(engine: Engine, borrowed: Borrowed) -> Engine:
    """Record that `engine`'s connections belong to another framework; returns it."""
    _BORROWED[engine] = borrowed
    return engine


def borrowed_by(engine: Engine) -> Borrowed | None:
    """How `engine`'s connections are borrowed, or None for an ordinary engine."""
    return _BORROWED.get(engine)


def dispose_in_children(engine: Engine) -> None:
    """Never share the pool's connections across fork: each child opens its own.

    Prefork children, gunicorn workers and multiprocessing children all fork; a
    connection used from two processes corrupts both sides' protocol state.
    """
    ref = weakref.ref(engine)

    def drop() -> None:
        alive = ref()
        if alive is not None:
            alive.dispose(close=False)

    os.register_at_fork(after_in_child=drop)


def is_private_sqlite(engine: Engine) -> bool:
    """An in-memory SQLite database, which no other process can share."""
    return engine.dialect.name == "sqlite" and engine.url.database in (None, "", ":memory:")


def _configure_sqlite(engine: Engine, *, relaxed: bool) -> None:
    # Several prefork children write the same file: WAL lets readers run beside the
    # writer, and BEGIN IMMEDIATE takes the write lock up front, so two writers queue on
    # the busy timeout instead of failing with "database is locked" on lock upgrade.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # let SQLAlchemy's BEGIN below rule
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # FULL syncs the WAL on every commit; NORMAL only at checkpoints, which survives a
        # crash of the process but not of the machine.
        cursor.execute(f"PRAGMA synchronous={'NORMAL' if relaxed else 'FULL'}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        if connection.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            connection.exec_driver_sql("BEGIN IMMEDIATE")
