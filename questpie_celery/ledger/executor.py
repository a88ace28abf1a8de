"""How every ledger operation runs its statement: the one executor the concepts share.

Each operation outside `migrate` is a single statement in autocommit: one round
trip, atomic on its own, and no transaction left open to hold row locks. The one
exception is a throttled publish's, two statements in a transaction of their own
(`_run_transaction`, with the same rerun and translation rules). A
statement that meets a connection the server dropped (restart, failover,
`pg_terminate_backend`, an idle timeout) runs once more on a fresh connection.
Where that second run cannot tell whether the first one landed (a conditional
write that now matches nothing), the operation reads the row back (`get`) and
decides from the fencing token it names.

The operations themselves live by concept beside their statements (`dispatches`,
`claims`, `slots`, `policies`, `relay`, `schedules`, `retention`, `views`,
`migration`), each a `Part` over the one `Executor` (which `store.Ledger` is), holding
it rather than being it. Each part builds its statements once per dialect in
`_prepare`, which the executor calls as the part attaches and again on every rebind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, Connection, Engine, Select, exc, func, select, text
from sqlalchemy.engine import CursorResult, RowMapping
from sqlalchemy.sql import ClauseElement, Executable
from sqlalchemy.sql.elements import TextClause

from .._runtime.outages import Outage
from ..jobs.ids import unstorable_id
from .direct import DriverStatement, LeftToSQLAlchemy, runs_direct
from .engine import (
    Ambient,
    borrowed_by,
    dispose_in_children,
    runs_in_autocommit,
    statement_settings,
)
from .errors import MIGRATE_COMMAND, Reruns, translate_errors
from .hot import HotConnection
from .rows import DispatchRow
from .schema import dispatch_table, schema_version_table
from .statements import by_id, db_time, in_own_transaction

T = TypeVar("T")

#: The logger the ledger always wrote under (operators filter on it): `store` made it.
log = logging.getLogger("questpie_celery.ledger.store")


@dataclass(frozen=True)
class Durably:
    """How one write is committed to disk before it returns on a relaxed ledger, whose
    other commits may not be: on PostgreSQL, in a transaction of its own with `at_commit`
    run after it, before the commit (where the setting counts, and after a pooled
    statement's preamble turned it off); on SQLite, on its connection, which syncs every
    commit from `before` until `after` (run however the write ended)."""

    in_transaction: bool
    before: TextClause | None = None
    at_commit: TextClause | None = None
    after: TextClause | None = None


class RunStatements:
    """What the executor itself runs: a transaction's settings, a durable commit, the
    read-back of one row, and the database's clock; and when a write commits durably.
    The sync executor and `aio.AsyncLedger` both run a statement by these rules."""

    def __init__(
        self, dialect: str, preamble: ColumnElement[bool] | None, *, relaxed: bool
    ) -> None:
        # The settings for the length of a transaction of the ledger's own (`migrate`'s),
        # behind a pooler: what an unpooled engine's connections have from startup, so a
        # schema upgrade waiting for a table lock gives up after the lock timeout instead
        # of queueing every ledger statement behind it for as long as the holder lasts.
        self.transaction_settings: Select[Any] | None = (
            select(preamble) if preamble is not None else None
        )
        # On a relaxed ledger, what makes one write durable anyway (see `Durably`).
        self._durably: Durably | None = None
        if relaxed:
            self._durably = (
                Durably(True, at_commit=text("SET LOCAL synchronous_commit TO on"))
                if dialect == "postgresql"
                else Durably(
                    False,
                    before=text("PRAGMA synchronous=FULL"),
                    after=text("PRAGMA synchronous=NORMAL"),
                )
            )
        self.get: Select[Any] = select(dispatch_table).where(by_id())
        self.now: Select[Any] = select(db_time().label("now"))

    def durably(self, durable: bool) -> Durably | None:
        """How a statement commits: None as every other does (it is not `durable`, or the
        ledger is not relaxed and every commit is on disk when it returns), which alone
        may take the driver's cursor (`direct.py`); else `Durably`."""
        return self._durably if durable else None


def returned(result: CursorResult[Any]) -> Any:
    """What a statement returned: its rows, or (a write that returns none) its row count."""
    return result.mappings().all() if result.returns_rows else result.rowcount


class Executor:
    """The connection to the ledger's database, and how one statement runs on it."""

    _hot: HotConnection  # where the statements on the driver's cursor run (see `hot.py`)

    def __init__(self, engine: Engine, *, relaxed: bool = False, pooled: bool = False) -> None:
        #: Commits may not be on disk when they return (see `create_ledger_engine`): the
        #: fence then takes back a delivery whose row a database crash lost.
        self.relaxed = relaxed
        #: The database is reached through a pooler in transaction mode: no statement
        #: leaves state on its connection, and relays poll instead of listening.
        self.pooled = pooled
        #: Whether this process reaches the database, as the parts that wait out an
        #: outage report it (see `_runtime/outages.py`): they tell the log, not the ledger.
        self.outage = Outage("the dispatch ledger")
        #: The parts whose statements are built for this executor's dialect (`attach`).
        self._parts: list[Part] = []
        self.rebind(engine)

    def rebind(self, engine: Engine) -> None:
        """Talk to the database of `engine` from now on, forgetting what was read from
        the previous one. For tests (see `Questpie.rebind_ledger`): every part of a
        `Questpie` shares this object, so rebinding it moves them all."""
        if hasattr(self, "_hot"):  # a rebind: the previous engine's kept connection closes
            self._hot.close()
        self.engine = engine
        self._autocommit: Engine
        self._transactional: Engine
        self._borrowed = borrowed_by(engine)
        if self._borrowed is not None:
            # Another framework's connections (Django's): their autocommit and any open
            # transaction are its own. Outside its transactions they are in autocommit,
            # so each statement stands alone; inside one, it rides that transaction.
            self._autocommit = self._transactional = engine
        elif runs_in_autocommit(engine):
            self._autocommit = engine
            self._transactional = engine.execution_options(isolation_level="READ COMMITTED")
        else:
            # An engine the caller passed in is left as it is; ours run in autocommit.
            self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            self._transactional = engine
        preamble = None
        if self.pooled and runs_in_autocommit(engine) and engine.dialect.name == "postgresql":
            # Our pooled engine starts its connections with no settings: each write sets
            # them for its own transaction instead (an engine passed in, or Django's,
            # gets none, as it gets no startup settings unpooled). Statements run in a
            # caller's transaction are built without them: it must not keep them.
            preamble = in_own_transaction(statement_settings(relaxed=self.relaxed))
        self._prepare(engine.dialect.name, preamble)
        self._hot = HotConnection(self._autocommit)
        dispose_in_children(engine)

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        """Build the statements of `dialect`, and forget what was read of the schema;
        then each attached part builds its own, in the order they attached. `preamble`:
        the pooled ledger's settings, for the writes that carry them (see
        `statements.in_own_transaction`)."""
        self._run_sql = RunStatements(dialect, preamble, relaxed=self.relaxed)
        self._direct: dict[int, DriverStatement] = {}
        self._prepared = (dialect, preamble)
        for part in self._parts:
            part._prepare(dialect, preamble)

    def attach(self, part: Part) -> None:
        """Build `part`'s statements now, and again on every rebind after those of the
        parts attached before it: a part that builds on another's statements (a debounced
        publish's insert is the plain one's) attaches after it."""
        self._parts.append(part)
        part._prepare(*self._prepared)

    def _run_on_driver(self, *stmts: ClauseElement) -> None:
        """Run these statements (the hottest ones) on the driver's cursor where the
        engine allows it (see `direct.py`): the ledger's own PostgreSQL engines."""
        if self._borrowed is None and runs_in_autocommit(self.engine) and runs_direct(self.engine):
            for stmt in stmts:
                self._direct[id(stmt)] = DriverStatement(stmt, self._autocommit)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def run_statements(self) -> RunStatements:
        """The executor's own statements of this ledger's dialect (for `aio.AsyncLedger`)."""
        return self._run_sql

    @property
    def migrate_command(self) -> str:
        """What creates or upgrades the tables of this ledger: `questpie-celery migrate`,
        or on Django's connections `manage.py migrate`."""
        return self._borrowed.migrate_command if self._borrowed is not None else MIGRATE_COMMAND

    @property
    def borrowed(self) -> bool:
        """Whether the connections belong to another framework (Django's)."""
        return self._borrowed is not None

    @property
    def ambient(self) -> Ambient | None:
        """Opens the caller's transaction in the framework that owns the connections
        (Django's atomic block), for a publish to write in; None on an ordinary engine."""
        return self._borrowed.ambient if self._borrowed is not None else None

    def close(self) -> None:
        """Release the pool's connections."""
        self._hot.close()
        self.engine.dispose()

    def idle(self) -> None:
        """The calling thread is between units of work (a relay pass, a round of lease
        renewals): on borrowed connections, their owner's rules apply now (Django closes
        one older than `CONN_MAX_AGE`, or unusable). Never raises."""
        if self._borrowed is not None:
            try:
                self._borrowed.idle()
            except Exception:
                log.exception("releasing the ledger's borrowed connection failed")

    # --- running statements ------------------------------------------------------------

    def _run(
        self,
        stmt: Executable,
        params: Any,
        *,
        durable: bool = False,
        rerun_if_rolled_back: bool = False,
    ) -> tuple[Any, bool]:
        """Run one statement in autocommit; once more if its connection was found dead.

        Returns its rows (or row count) and whether it ran twice: then its first run may
        have landed unseen, and a conditional write that now matches nothing is ambiguous.
        `durable` commits it to disk before returning even on a relaxed ledger.
        `rerun_if_rolled_back` runs it again when the server undid it to break a
        deadlock: a multi-row insert meeting another in the opposite order can.
        """
        durably = self._run_sql.durably(durable)
        direct = None if durably is not None else self._direct.get(id(stmt))
        reruns = None
        if direct is not None and not direct.observed():
            # The hottest statements' common case: one try, with none of the rerun
            # machinery below around it (on a busy worker it cost more than the driver's
            # own work); a failure is decided by the same rules, then left to it.
            try:
                with self._hot.connect() as conn:
                    try:
                        return direct.run(conn, params), False
                    except LeftToSQLAlchemy:
                        with conn:  # for SQLAlchemy to look at; not kept after
                            return self._through_sqlalchemy(conn, stmt, params), False
            except exc.SQLAlchemyError as error:
                reruns = Reruns(after_rollback=rerun_if_rolled_back, log=log)
                with translate_errors(self.migrate_command):
                    if not reruns.after(error):  # raises SlotTaken for a slot index
                        raise
        if reruns is None:
            reruns = Reruns(after_rollback=rerun_if_rolled_back, log=log)
        with translate_errors(self.migrate_command):
            for attempt in reruns.attempts():
                with attempt, self._connected(durably) as conn:
                    return self._through_sqlalchemy(conn, stmt, params), reruns.reconnected
        raise AssertionError("unreachable: every attempt returns or raises")

    @staticmethod
    def _through_sqlalchemy(conn: Connection, stmt: Executable, params: Any) -> Any:
        return returned(conn.execute(stmt, params))

    @contextmanager
    def _connected(self, durably: Durably | None) -> Iterator[Connection]:
        """A connection for one statement, committing as `durably` says (see `Durably`)."""
        if durably is None:
            with self._autocommit.connect() as conn:
                yield conn
            return
        opened = (
            self._transactional.begin() if durably.in_transaction else self._autocommit.connect()
        )
        with opened as conn:
            if durably.before is not None:
                conn.execute(durably.before)
            try:
                yield conn
                if durably.at_commit is not None:
                    conn.execute(durably.at_commit)
            finally:
                if durably.after is not None:
                    conn.execute(durably.after)

    def _run_transaction(
        self, work: Callable[[Connection], T], *, durable: bool = False
    ) -> tuple[T, bool]:
        """Run `work`'s statements in one transaction of their own (`_begin`), with
        `_run`'s rules: once more on a fresh connection if its connection was found
        dead (then `work` runs again from the start, and the flag returned says so),
        errors translated. An exception `work` raises rolls the transaction back and
        propagates. `durable`: committed to disk even on a relaxed PostgreSQL ledger."""
        durably = self._run_sql.durably(durable)
        # PostgreSQL's part of the rule only, as ever: SQLite's `before` and `after` are
        # not run around a transaction of its own.
        at_commit = durably.at_commit if durably is not None else None
        reruns = Reruns(after_rollback=True, log=log)
        with translate_errors(self.migrate_command):
            for attempt in reruns.attempts():
                with attempt, self._begin() as conn:
                    done = work(conn)
                    if at_commit is not None:
                        conn.execute(at_commit)
                    return done, reruns.reconnected
        raise AssertionError("unreachable: every attempt returns or raises")

    def _execute(self, stmt: Executable, params: Any) -> Any:
        return self._run(stmt, params)[0]

    def _first(self, stmt: Executable, params: Any) -> RowMapping | None:
        rows = self._execute(stmt, params)
        return rows[0] if rows else None

    def _row(self, stmt: Executable, params: Any) -> DispatchRow | None:
        found = self._first(stmt, params)
        return DispatchRow.from_mapping(found) if found is not None else None

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        """A connection in a transaction of its own, with the ledger's settings (or, on
        borrowed connections, in the owner's: Django's atomic block, nested in the
        caller's if one is open)."""
        if self._borrowed is None:
            with self._transactional.begin() as conn:
                if self._run_sql.transaction_settings is not None:
                    conn.execute(self._run_sql.transaction_settings)
                yield conn
            return
        with self._borrowed.atomic(), self.engine.connect() as conn:
            yield conn

    # --- what every concept reads -------------------------------------------------------

    def get(self, dispatch_id: str) -> DispatchRow | None:
        """The row as it is now: also how an ambiguous rerun finds out whether its first
        run landed. None for an id no row can have (`ids.unstorable_id`: not a string,
        empty, a NUL, a lone surrogate, too long), as for an unknown one: a statement
        naming it would fail."""
        if unstorable_id(dispatch_id) is not None:
            return None
        return self._row(self._run_sql.get, {"dispatch_id": dispatch_id})

    def now(self) -> datetime:
        """The database's clock: the one every due time is compared with."""
        row = self._first(self._run_sql.now, {})
        assert row is not None
        value: datetime = row["now"]
        return value

    def schema_version(self) -> int | None:
        with translate_errors(self.migrate_command), self._autocommit.connect() as conn:
            return conn.execute(select(func.max(schema_version_table.c.version))).scalar()


class Part:
    """One concept's operations (`claims`, `dispatches`, ...), run on the executor they
    hold (`_db`), never subclass: every part of one `Ledger` holds the same executor, so a
    rebind moves them all. A part another one needs is handed to it by `store.Ledger`."""

    def __init__(self, db: Executor) -> None:
        self._db = db
        db.attach(self)

    def _prepare(self, dialect: str, preamble: ColumnElement[bool] | None) -> None:
        """Build this part's statements of `dialect`, and forget what it read of the
        schema (see `Executor._prepare`). A part setting attributes its `_prepare` reads
        sets them before `Part.__init__` attaches it."""
