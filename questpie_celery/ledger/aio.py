"""The ledger operations a publisher in an event loop awaits.

On PostgreSQL (a `Questpie` made with `ledger_url=`), they run on SQLAlchemy's
asyncio engine over psycopg's async driver: the loop goes on while a statement
waits for the server. The statements are the sync ledger's own (its
`statements` and `run_statements`), run by its rules (`Reruns`, and how a durable write
commits: `RunStatements.durably`); only how they are awaited differs.

An asyncio engine's pooled connections belong to the event loop that opened
them, so each loop gets an engine of its own (a test suite may run many loops;
an ASGI server runs one). Where no async driver is used (the SQLite ledger,
whose driver is synchronous, and an `engine=` the caller built, whose settings
cannot be copied onto a new engine), the sync ledger's method runs in a worker
thread instead: the loop still goes on while it waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.sql import Executable

from ..errors import ConfigurationError
from ..jobs.ids import unstorable_id
from . import inserts
from .engine import create_async_ledger_engine, runs_in_autocommit
from .errors import Reruns, translate_errors
from .executor import Durably, returned
from .rows import DispatchRow, NewDispatch
from .store import Ledger

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

T = TypeVar("T")


def async_driver_available() -> bool:
    """SQLAlchemy's asyncio layer needs greenlet (the `asyncio` extra installs it)."""
    return importlib.util.find_spec("greenlet") is not None


#: Disposals scheduled on running loops, held until done (a loop holds tasks weakly).
_DISPOSING: set[concurrent.futures.Future[None]] = set()


class AsyncLedger:
    """Awaitable insert, existence checks and reads of one `Ledger`."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._engines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncEngine] = (
            weakref.WeakKeyDictionary()
        )
        self.rebound()

    def rebound(self) -> None:
        """Follow a `Ledger.rebind`: its dialect and engine may differ now. The async
        engines made from the previous one are closed on their loops: at once where a
        loop is idle, soon where it runs (this is called from it); a closed loop took its
        connections with it. For tests only, as the rebind is."""
        for loop, engine in list(self._engines.items()):
            if loop.is_closed():
                continue
            if loop.is_running():
                disposing = asyncio.run_coroutine_threadsafe(engine.dispose(), loop)
                _DISPOSING.add(disposing)
                disposing.add_done_callback(_DISPOSING.discard)
            else:
                loop.run_until_complete(engine.dispose())
        ledger = self._ledger
        self._sql = ledger.dispatches.statements
        self._run_sql = ledger.run_statements
        # Only an engine we made knows its own settings, and only PostgreSQL has a
        # driver that can wait without a thread.
        self.native = ledger.dialect == "postgresql" and runs_in_autocommit(ledger.engine)
        self._engines = weakref.WeakKeyDictionary()

    # --- the operations ---------------------------------------------------------------

    async def insert(self, new: NewDispatch) -> bool:
        """As `ledger.dispatches.insert` without a caller's connection."""
        if not self.native:
            return await asyncio.to_thread(self._ledger.dispatches.insert, new)
        return await self._drive(inserts.insert(self._sql, new))

    async def insert_many(self, batch: Sequence[NewDispatch]) -> set[str]:
        """As `ledger.dispatches.insert_many` without a caller's connection."""
        if not self.native or not batch:
            return await asyncio.to_thread(self._ledger.dispatches.insert_many, batch)
        return await self._drive(inserts.insert_many(self._sql, batch))

    async def existing(self, dispatch_ids: Sequence[str]) -> set[str]:
        if not self.native or not dispatch_ids:
            return await asyncio.to_thread(self._ledger.dispatches.existing, dispatch_ids)
        return await self._drive(inserts.existing(self._sql, dispatch_ids))

    async def exists(self, dispatch_id: str) -> bool:
        if not self.native:
            return await asyncio.to_thread(self._ledger.dispatches.exists, dispatch_id)
        return await self._drive(inserts.exists(self._sql, dispatch_id))

    async def get(self, dispatch_id: str) -> DispatchRow | None:
        """As `Ledger.get`: None also for an id no row can have."""
        if unstorable_id(dispatch_id) is not None:
            return None
        if not self.native:
            return await asyncio.to_thread(self._ledger.get, dispatch_id)
        rows, _ = await self._run(self._run_sql.get, {"dispatch_id": dispatch_id})
        return DispatchRow.from_mapping(rows[0]) if rows else None

    async def know_identity(self) -> None:
        """Read the ledger's identity (in a thread, once), which the sync path compares a
        caller's database with."""
        if not self._ledger.migration.knows_identity:
            await asyncio.to_thread(self._ledger.migration.ledger_id)

    async def close(self) -> None:
        """Close the connections of the running loop's engine."""
        engine = self._engines.pop(asyncio.get_running_loop(), None)
        if engine is not None:
            await engine.dispose()

    # --- running statements -------------------------------------------------------------

    async def _drive(self, plan: inserts.Plan[T]) -> T:
        """Await a plan's statements (see `inserts`) as `_run` runs one."""

        async def run(step: inserts.Run) -> inserts.Ran:
            return await self._run(
                step.stmt,
                step.params,
                durable=step.durable,
                rerun_if_rolled_back=step.rerun_if_rolled_back,
            )

        return await inserts.adrive(plan, run)

    async def _run(
        self,
        stmt: Executable,
        params: Any,
        *,
        durable: bool = False,
        rerun_if_rolled_back: bool = False,
    ) -> tuple[Any, bool]:
        """As `Ledger._run`: one statement in autocommit, once more on a fresh connection
        if its connection was found dead, again if the server undid it in a deadlock."""
        durably = self._run_sql.durably(durable)
        reruns = Reruns(after_rollback=rerun_if_rolled_back)
        with translate_errors():
            for attempt in reruns.attempts():
                with attempt:
                    async with self._connected(durably) as conn:
                        return returned(await conn.execute(stmt, params)), reruns.reconnected
        raise AssertionError("unreachable: every attempt returns or raises")

    @asynccontextmanager
    async def _connected(self, durably: Durably | None) -> AsyncIterator[AsyncConnection]:
        """As `Ledger._connected`: committing as `durably` says (see `Durably`)."""
        engine = self._engine()
        if durably is None:
            async with engine.connect() as conn:
                yield conn
            return
        # A relaxed ledger still waits for the disk where a secret's only copy is written.
        opened = (
            engine.execution_options(isolation_level="READ COMMITTED").begin()
            if durably.in_transaction
            else engine.connect()
        )
        async with opened as conn:
            if durably.before is not None:
                await conn.execute(durably.before)
            try:
                yield conn
                if durably.at_commit is not None:
                    await conn.execute(durably.at_commit)
            finally:
                if durably.after is not None:
                    await conn.execute(durably.after)

    def _engine(self) -> AsyncEngine:
        loop = asyncio.get_running_loop()
        engine = self._engines.get(loop)
        if engine is None:
            if not async_driver_available():
                raise ConfigurationError(
                    "publishing from asyncio on a PostgreSQL ledger needs greenlet: "
                    "pip install 'questpie-celery[asyncio]'"
                )
            engine = create_async_ledger_engine(
                self._ledger.engine, relaxed=self._ledger.relaxed, pooled=self._ledger.pooled
            )
            self._engines[loop] = engine
        return engine
