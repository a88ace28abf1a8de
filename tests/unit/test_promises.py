"""Promises the documentation makes that need no server: each one held to a test."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery import Celery
from sqlalchemy import create_engine, text

from questpie_celery import LedgerUnavailableError, Questpie
from questpie_celery.ledger import open_ledger
from tests.support import jobapp


def test_close_writes_the_batched_acceptance_marks(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    app = Celery("promise", broker="memory://")
    questpie = Questpie(app, ledger_url=url, jobs=jobapp.JOBS)
    questpie.migrate()
    dispatch_id = questpie.queue.record.publish({"tag": "x"}, idempotency_key="close-flush")
    assert dispatch_id is not None
    questpie.close()  # at once: the background batch has had no time to run
    ledger = open_ledger(url)
    row = ledger.get(dispatch_id)
    ledger.close()
    assert row is not None
    assert (row.status, row.queued_at is not None) == ("queued", True)


def test_an_engine_you_pass_is_left_as_it_is(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'yours.sqlite3'}")
    app = Celery("promise", broker="memory://")
    questpie = Questpie(app, engine=engine, jobs=jobapp.JOBS)
    questpie.migrate()
    assert questpie.queue.record.publish({"tag": "x"}, idempotency_key="yours") is not None
    with engine.connect() as conn:
        # Our own SQLite engines turn WAL on; yours keeps SQLite's default journal.
        assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "delete"
        assert conn.get_isolation_level() != "AUTOCOMMIT"
    assert engine.dialect.name == "sqlite"
    questpie.close()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and then never says a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(listener.getsockname()[1])
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_silent_postgresql_fails_a_publish_by_its_connect_timeout(
    silent_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The publish gives up when the ledger's connect timeout (5 s; psycopg may try the
    address twice) runs out, never after the OS's minutes: the error says so, and its
    cause is psycopg's own timeout. (How long it takes is a figure of bench/outages.py.)"""
    app = Celery("promise", broker="memory://")
    questpie = Questpie(
        app,
        ledger_url=f"postgresql+psycopg://nobody@127.0.0.1:{silent_server}/none",
        jobs=jobapp.JOBS,
    )
    with caplog.at_level(logging.INFO), pytest.raises(LedgerUnavailableError) as caught:
        questpie.queue.record.publish({"tag": "x"}, idempotency_key="silent")
    assert "before the connect timeout" in str(caught.value)
    causes = []
    cause: BaseException | None = caught.value
    while cause is not None:
        causes.append(type(cause))
        cause = cause.__cause__
    assert psycopg.errors.ConnectionTimeout in causes, causes
    questpie.close()


def test_redis_priority_settings_that_differ_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("promise", broker="redis://127.0.0.1:1/0")
    app.conf.broker_transport_options = {"priority_steps": [0, 3, 6, 9]}
    with caplog.at_level(logging.WARNING, logger="questpie_celery"):
        Questpie(app, ledger_url="sqlite://").close()
        # Celery configures an app lazily, on first use; questpie's settings follow then.
        options = app.conf.broker_transport_options
    warnings = [r.getMessage() for r in caplog.records if "priority_steps" in r.getMessage()]
    assert len(warnings) == 1
    # The user's choice stays; the missing one is added.
    assert options["priority_steps"] == [0, 3, 6, 9]
    assert options["queue_order_strategy"] == "priority"
