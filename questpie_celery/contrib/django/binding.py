"""The ledger on Django's database connections.

The ledger's statements stay in `questpie_celery.ledger`; only where they run changes.
`django_ledger_engine(alias)` is a SQLAlchemy engine whose connections ARE Django's:
each checkout hands SQLAlchemy the calling thread's `connections[alias]` DBAPI
connection (opened by Django if need be), behind a thin proxy that lets Django keep its
life and its transactions:

- `close()`, `commit()` and `rollback()` do nothing: Django opens and closes the
  connection (Celery's Django fixup around tasks and across forks, `CONN_MAX_AGE`),
  and Django's `atomic()` commits or rolls back. Outside an atomic block Django's
  connection is in autocommit, so each ledger statement stands alone, as on the
  ledger's own engines; inside one, it rides that transaction. SQLAlchemy never sets
  the isolation level or autocommit (the ledger marks the engine `Borrowed`), never
  emits BEGIN (its dialects leave that to the driver), and the pool never resets a
  connection (`pool_reset_on_return=None`, `NullPool`).
- On PostgreSQL each cursor is a plain `psycopg.Cursor` with psycopg's own loaders for
  `timestamptz` and `jsonb`: Django's connection binds parameters client-side and
  loads those types its own way (naive times without `USE_TZ`, JSON as text); the
  ledger's statements are written for psycopg's defaults.
- On SQLite, Django opens connections with `PARSE_DECLTYPES`, so `DATETIME` columns
  come back already parsed: the dialect here accepts either.
- A statement that finds the connection dead (a server restart, a killed backend)
  makes SQLAlchemy invalidate it; the proxy then closes Django's connection, so the
  ledger's one retry (and Django's next use) opens a fresh one.

Publishing inside `transaction.atomic(using=alias)` writes the rows on that same
connection and sends them from `transaction.on_commit(..., using=alias)`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from sqlalchemy import Connection, Engine

from ...errors import ConfigurationError, LedgerUnavailableError
from ...ledger import AmbientTransaction, Borrowed, Ledger, mark_borrowed
from ...ledger.borrowed import borrowing_engine, dedicated_postgres_engine, refusing_engine
from ...ledger.engine import PG_CONNECT_TIMEOUT_SECONDS
from .settings import DEFAULT_DATABASE, MIGRATE_COMMAND, Problem, ledger_database, problems

_ENGINES: dict[tuple[str, str], Engine] = {}
_LISTENERS: dict[str, Engine] = {}
_LOCK = threading.Lock()


def django_ledger_engine(alias: str) -> Engine:
    """The engine of the ledger in `DATABASES[alias]`, on Django's own connections
    (one per alias and database backend in a process; Django is not connected until a
    statement runs). Keyed by the backend too: a test suite may point an alias at
    another database, and the engine's dialect must follow.

    A `DATABASES` entry that cannot hold the ledger (see `problems`) gives an engine that
    refuses every connection with the problem and its fix, as `LedgerUnavailableError`:
    a worker then holds its deliveries as for a database that is down, and
    `manage.py check` (which could not run if this raised at import) reports it."""
    try:
        from django.db import connections  # noqa: PLC0415
    except ImportError:
        raise ConfigurationError(
            "django_database= needs Django: pip install 'questpie-celery[django]'"
        ) from None
    found = connections.settings.get(alias)
    key = (alias, str(found["ENGINE"]) if found is not None else "")
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            errors = [problem for problem in problems(alias) if problem.error]
            engine = _ENGINES[key] = _refusing(errors[0]) if errors else _make_engine(alias)
        return engine


def engine_aliases() -> set[str]:
    """The aliases this process built a ledger engine for (every `Questpie` on Django)."""
    with _LOCK:
        return {alias for alias, _ in _ENGINES}


def _refusing(problem: Problem) -> Engine:
    """An engine every connection of which fails with `problem` (see
    `django_ledger_engine`)."""

    def refuse() -> Any:
        raise LedgerUnavailableError(
            f"the dispatch ledger database cannot be used: {problem.message} ({problem.hint}; "
            "`manage.py check` reports it)"
        )

    return refusing_engine(refuse)


def upgrade_ledger(apps: Any, schema_editor: Any) -> None:
    """What each of the app's migrations runs (`RunPython`): `migrate_ledger` on the
    database Django migrates. Every schema version's migration calls the same idempotent
    function, so a project that skipped releases gets every version at once."""
    migrate_ledger(schema_editor.connection.alias)


def migrate_ledger(alias: str) -> int | None:
    """Create or upgrade the ledger tables in `DATABASES[alias]` when it is the ledger's
    database (`QUESTPIE_DATABASE`); the Django migrations call it. Returns the schema
    version, or None for another database."""
    if alias != ledger_database():
        return None
    return Ledger(django_ledger_engine(alias)).migration.migrate()


# --- the engine ----------------------------------------------------------------------------


def _make_engine(alias: str) -> Engine:
    """The engine on `DATABASES[alias]`, which `problems` found no error in."""
    from django.db import connections  # noqa: PLC0415

    wrapper = connections[alias]
    postgres = wrapper.vendor == "postgresql"
    engine = borrowing_engine(
        partial(_borrow, alias, postgres),
        postgres=postgres,
        sqlite_path="" if postgres else str(wrapper.settings_dict["NAME"]),
        on_invalidate=_on_invalidate,
        on_error=partial(_mark_for_rollback, alias),
    )
    return mark_borrowed(
        engine,
        Borrowed(
            idle=partial(_idle, alias),
            listener=partial(_listener, alias) if postgres else lambda: None,
            ambient=partial(_ambient, engine, alias),
            atomic=partial(_atomic, alias),
            # The project's migrations create the tables (0001_ledger), in this database.
            migrate_command=MIGRATE_COMMAND
            if alias == DEFAULT_DATABASE
            else f"{MIGRATE_COMMAND} --database={alias}",
        ),
    )


def _borrow(alias: str, postgres: bool) -> _BorrowedConnection:
    """SQLAlchemy's creator: the calling thread's Django connection, opened if need be."""
    from django.db import DatabaseError, connections  # noqa: PLC0415

    wrapper = connections[alias]
    try:
        wrapper.ensure_connection()
    except DatabaseError as exc:
        # Django wraps the driver's error; SQLAlchemy (and so the ledger's error
        # translation and its reconnect) knows the driver's own.
        if isinstance(exc.__cause__, Exception):
            raise exc.__cause__ from None
        raise
    return _BorrowedConnection(wrapper, wrapper.connection, postgres)


class _BorrowedConnection:
    """Django's DBAPI connection as SQLAlchemy sees it: everything passes through except
    what would take the connection's life or transaction out of Django's hands."""

    __slots__ = ("_conn", "_postgres", "_wrapper")

    def __init__(self, wrapper: Any, conn: Any, postgres: bool) -> None:
        object.__setattr__(self, "_wrapper", wrapper)
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_postgres", postgres)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        if not self._postgres or args or kwargs:
            return self._conn.cursor(*args, **kwargs)
        import psycopg  # noqa: PLC0415
        from psycopg.types.datetime import TimestamptzLoader  # noqa: PLC0415
        from psycopg.types.json import JsonbLoader  # noqa: PLC0415

        # Server-side binding and psycopg's own loaders, as on the ledger's own engines
        # (the adapters map is the cursor's copy: Django's connection is left as it is).
        cursor = psycopg.Cursor(self._conn)
        cursor.adapters.register_loader("timestamptz", TimestamptzLoader)
        cursor.adapters.register_loader("jsonb", JsonbLoader)
        return cursor

    def close(self) -> None:
        """Django closes its connections (CONN_MAX_AGE, Celery's fixup, forks)."""

    def commit(self) -> None:
        """Django commits: in autocommit each statement already has; in an atomic block,
        the block does."""

    def rollback(self) -> None:
        """Django rolls back (an atomic block that fails); in autocommit there is
        nothing to roll back."""

    def add_notice_handler(self, handler: Any) -> None:
        """SQLAlchemy's psycopg dialect adds one on every checkout: keep Django's
        connection from collecting them."""

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        """SQLAlchemy's SQLite dialect would replace Django's REGEXP; the ledger uses none."""

    def discard(self) -> None:
        """The connection was found dead: let Django close it, so the next use opens a
        fresh one (in an atomic block Django marks the block for rollback instead)."""
        if self._wrapper.connection is self._conn:
            with contextlib.suppress(Exception):
                self._wrapper.close()


def _on_invalidate(dbapi_connection: Any, _record: Any, _exception: Any) -> None:
    if isinstance(dbapi_connection, _BorrowedConnection):
        dbapi_connection.discard()


def _mark_for_rollback(alias: str, _context: Any) -> None:
    """A ledger statement failed inside the caller's atomic block: tell Django, as its
    own cursor does. PostgreSQL has aborted the transaction; unmarked, Django would
    commit (which the server turns into a rollback) and run the block's on_commit
    callbacks for work that never committed. Marked, the block rolls back and its
    callbacks are dropped, even if the caller catches the error."""
    from django.db import connections  # noqa: PLC0415

    wrapper = connections[alias]
    if wrapper.in_atomic_block:
        wrapper.needs_rollback = True


def _idle(alias: str) -> None:
    """Between units of work of a questpie thread (a relay pass, a lease round): apply
    Django's rules to its connection, as Django does between requests."""
    from django.db import connections  # noqa: PLC0415

    wrapper = connections[alias]
    if wrapper.connection is not None and not wrapper.in_atomic_block:
        wrapper.close_if_unusable_or_obsolete()


@contextlib.contextmanager
def _atomic(alias: str) -> Iterator[object]:
    from django.db import transaction  # noqa: PLC0415

    with transaction.atomic(using=alias) as block:
        yield block


# --- publishing in an atomic block ---------------------------------------------------------


class _DjangoAtomic:
    """The caller's `transaction.atomic(using=alias)` block, as a publish sees it."""

    def __init__(self, connection: Connection, alias: str) -> None:
        self._connection = connection
        self._alias = alias

    @property
    def connection(self) -> Connection:
        return self._connection

    def after_commit(
        self, dispatch_ids: Sequence[str], send: Callable[[Sequence[str]], None]
    ) -> None:
        from django.db import transaction  # noqa: PLC0415

        # Django runs it after the outermost commit, and drops it when the savepoint it
        # was registered in (or the whole block) rolls back.
        transaction.on_commit(partial(send, list(dispatch_ids)), using=self._alias)


@contextlib.contextmanager
def _ambient(engine: Engine, alias: str) -> Iterator[AmbientTransaction | None]:
    from django.db import connections  # noqa: PLC0415

    wrapper = connections[alias]
    if not wrapper.in_atomic_block:
        yield None
        return
    # As any query of Django's would: refuse to write in a block already doomed.
    wrapper.validate_no_broken_transaction()
    with engine.connect() as conn:
        yield _DjangoAtomic(conn, alias)


# --- the relay's listening connection ------------------------------------------------------


def _listener(alias: str) -> Engine | None:
    """An engine of dedicated psycopg connections to the ledger's PostgreSQL database,
    made from Django's settings for it: a relay's LISTEN holds its connection for
    good, which none of Django's may do."""
    with _LOCK:
        engine = _LISTENERS.get(alias)
        if engine is None:
            engine = _LISTENERS[alias] = _make_listener(alias)
        return engine


def _make_listener(alias: str) -> Engine:
    import psycopg  # noqa: PLC0415
    from django.db import connections  # noqa: PLC0415

    params = dict(connections[alias].get_connection_params())
    for django_only in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(django_only, None)
    params.setdefault("connect_timeout", PG_CONNECT_TIMEOUT_SECONDS)
    # A vanished server is noticed in about 30 s, as on the ledger's own engines.
    for key, value in (
        ("keepalives", 1),
        ("keepalives_idle", 10),
        ("keepalives_interval", 5),
        ("keepalives_count", 3),
    ):
        params.setdefault(key, value)
    return dedicated_postgres_engine(lambda: psycopg.connect(**params))
