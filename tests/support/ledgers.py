"""What the tests of the ledger itself share (tests/integration/test_ledger_*.py, and
test_retention.py): rows written and read through its operations, a claim, the server
dropping its connections, and the statements that met PostgreSQL's lock timeout."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import update

from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.options import RunOptions, StoredOptions
from questpie_celery.ledger import DispatchRow, Ledger, NewDispatch, dispatch_table
from questpie_celery.ledger.statements import db_time
from tests.support.services import PostgresServer

JOB = "record"


def new_row(dispatch_id: str | None = None, **fields: Any) -> NewDispatch:
    values: dict[str, Any] = {
        "id": dispatch_id or random_dispatch_id(),
        "job_name": JOB,
        "idempotency_key": "k",
        "payload": {"tag": "x"},
        "options": StoredOptions(run=RunOptions(retry_limit=2)),
    }
    values.update(fields)
    return NewDispatch(**values)


def row_of(ledger: Ledger, dispatch_id: str) -> DispatchRow:
    row = ledger.get(dispatch_id)
    assert row is not None
    return row


def due_now(ledger: Ledger, dispatch_id: str) -> None:
    """Let the row's `run_after` come (a second ago, by the database's clock)."""
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(run_after=db_time(-1))
        )


def claimed(ledger: Ledger, lease: float = 60) -> tuple[str, str]:
    new = new_row()
    assert ledger.dispatches.insert(new) is True
    claim = ledger.claims.claim(new.id, JOB, 1, lease)
    assert claim.outcome == "claimed" and claim.token is not None
    return new.id, claim.token


def drop_connections(postgres: PostgresServer, ledger: Ledger) -> None:
    url = ledger.engine.url.render_as_string(hide_password=False)
    assert postgres.terminate_backends(url) >= 1, "the ledger held no connection to drop"


@contextmanager
def lock_timeouts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each statement that meets PostgreSQL's lock_timeout in the block, on psycopg's own
    cursor (the driver's cursor's statements and SQLAlchemy's alike)."""
    timeouts: list[str] = []
    real_execute = psycopg.Cursor.execute

    def execute(self: psycopg.Cursor[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return real_execute(self, query, *args, **kwargs)
        except psycopg.errors.LockNotAvailable:
            timeouts.append(str(query))
            raise

    with monkeypatch.context() as patched:
        patched.setattr(psycopg.Cursor, "execute", execute)
        yield timeouts
