"""How a durable write commits on a relaxed ledger: one rule (`RunStatements.durably`),
which the sync executor and the asyncio one (ledger/aio.py) both run."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from questpie_celery.ledger import Ledger, open_ledger
from questpie_celery.ledger.aio import AsyncLedger
from questpie_celery.ledger.executor import RunStatements


class _Result:
    returns_rows = False
    rowcount = 1


class _Connection:
    """An asyncio connection that records what runs on it."""

    def __init__(self, seen: list[str]) -> None:
        self._seen = seen

    async def __aenter__(self) -> _Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._seen.append("closed")

    async def execute(self, stmt: Any, params: Any = None) -> _Result:
        self._seen.append(str(stmt))
        return _Result()


class _Engine:
    """An asyncio engine whose connections record what runs on them."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def execution_options(self, **options: Any) -> _Engine:
        self.seen.append(f"options {options}")
        return self

    def connect(self) -> _Connection:
        self.seen.append("connect")
        return _Connection(self.seen)

    def begin(self) -> _Connection:
        self.seen.append("begin")
        return _Connection(self.seen)


def _awaited(ledger: Ledger, durable: bool) -> list[str]:
    """What `AsyncLedger` runs for one statement, on an engine that records it."""
    aledger, engine = AsyncLedger(ledger), _Engine()
    aledger._engine = lambda: engine  # type: ignore[assignment,method-assign,return-value]
    asyncio.run(aledger._run(text("SELECT 1"), {}, durable=durable))
    return engine.seen


@pytest.fixture
def relaxed_sqlite(tmp_path: Path) -> Any:
    ledger = open_ledger(f"sqlite:///{tmp_path / 'l.db'}", relaxed=True)
    yield ledger
    ledger.close()


def test_a_durable_write_on_a_relaxed_sqlite_ledger_syncs_and_relaxes_again_in_both(
    relaxed_sqlite: Ledger,
) -> None:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    event.listen(relaxed_sqlite.engine, "before_cursor_execute", record)
    try:
        relaxed_sqlite._run(text("SELECT 1"), {}, durable=True)
    finally:
        event.remove(relaxed_sqlite.engine, "before_cursor_execute", record)
    around = ["PRAGMA synchronous=FULL", "SELECT 1", "PRAGMA synchronous=NORMAL"]
    assert seen == around
    assert _awaited(relaxed_sqlite, durable=True) == ["connect", *around, "closed"]
    # Not durable: the statement alone, on an autocommit connection.
    assert _awaited(relaxed_sqlite, durable=False) == ["connect", "SELECT 1", "closed"]


def test_a_durable_write_on_a_relaxed_postgresql_ledger_commits_its_own_transaction() -> None:
    durably = RunStatements("postgresql", None, relaxed=True).durably(True)
    assert durably is not None and durably.in_transaction
    assert str(durably.at_commit) == "SET LOCAL synchronous_commit TO on"
    assert durably.before is None and durably.after is None
    # Only a relaxed ledger needs it: every other commit is on disk when it returns.
    for dialect in ("postgresql", "sqlite"):
        assert RunStatements(dialect, None, relaxed=True).durably(False) is None
        assert RunStatements(dialect, None, relaxed=False).durably(True) is None


def test_the_asyncio_ledger_commits_a_durable_write_as_postgresql_asks(
    relaxed_sqlite: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio executor runs PostgreSQL's rule as the sync one does: the write in
    a READ COMMITTED transaction of its own, the setting after it, before the commit."""
    postgresql = RunStatements("postgresql", None, relaxed=True)
    monkeypatch.setattr(Ledger, "run_statements", property(lambda self: postgresql))
    assert _awaited(relaxed_sqlite, durable=True) == [
        "options {'isolation_level': 'READ COMMITTED'}",
        "begin",
        "SELECT 1",
        "SET LOCAL synchronous_commit TO on",
        "closed",
    ]
