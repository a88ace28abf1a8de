"""Throwaway ledgers: a SQLite file per test, or a fresh PostgreSQL database per test.

A SQLite file rather than `sqlite://` in memory: the in-process worker's threads, its
relay and the test must all see the same ledger, and an in-memory database is private
to one connection (secret payloads are refused on it for that reason).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from ..app import Questpie

#: Read when the ini option `questpie_postgres_url` is not set.
POSTGRES_URL_VARIABLE = "QUESTPIE_TEST_POSTGRES_URL"


def postgres_server_url(ini_value: str) -> str | None:
    """The PostgreSQL server the ledgers go to, if one is configured."""
    return ini_value.strip() or os.environ.get(POSTGRES_URL_VARIABLE, "").strip() or None


def sqlite_ledger_url(folder: Path) -> str:
    return f"sqlite:///{folder / 'questpie-ledger.sqlite3'}"


@contextmanager
def throwaway_postgres(server_url: str) -> Iterator[str]:
    """A new database on the server of `server_url` (whose own database is only used to
    create and drop it), dropped on leaving; yields its URL."""
    server = make_url(server_url)
    name = f"questpie_test_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield server.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                # FORCE (PostgreSQL 13+) ends sessions a test left open, such as a
                # relay's listening connection that has not noticed its end yet.
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextmanager
def rebound(questpie: Questpie, ledger_url: str) -> Iterator[None]:
    """`questpie` on the ledger at `ledger_url`, migrated; on leaving, back on the ledger
    it had, with the throwaway's connections closed."""
    previous = questpie.rebind_ledger(ledger_url=ledger_url)
    try:
        questpie.migrate()
        yield
    finally:
        questpie.rebind_ledger(engine=previous).dispose()
