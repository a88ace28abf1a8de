"""Errors say what happened and what to do, in their own text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from sqlalchemy import exc

from questpie_celery import ConfigurationError, LedgerUnavailableError, Questpie, UnknownJobError
from questpie_celery.ledger import create_ledger_engine, open_ledger
from questpie_celery.ledger.errors import translate_errors
from tests.support import jobapp
from tests.support.services import free_port
from tests.unit.helpers import row_count


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"


@pytest.fixture
def questpie(ledger_url: str) -> Iterator[Questpie]:
    made = Questpie(Celery("messages", broker="memory://"), ledger_url=ledger_url, jobs=jobapp.JOBS)
    made.migrate()
    yield made
    made.close()


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("countdown", "start_after"),
        ("eta", "start_after"),
        ("retries", "retry_limit"),
        ("max_retries", "retry_limit"),
        ("expires", "expire_in_seconds"),
        ("routing_key", "queue"),
        ("idempotency_kye", "idempotency_key"),
        ("singelton_key", "singleton_key"),
    ],
)
def test_an_unknown_option_names_the_one_meant_and_writes_nothing(
    questpie: Questpie, ledger_url: str, given: str, meant: str
) -> None:
    options: dict[str, Any] = {given: 5}
    with pytest.raises(TypeError) as caught:
        questpie.queue.record.publish({"tag": "x"}, idempotency_key="k", **options)
    message = str(caught.value)
    assert f"unexpected keyword argument {given!r}" in message
    assert f"did you mean {meant!r}" in message
    ledger = open_ledger(ledger_url)
    assert row_count(ledger) == 0
    ledger.close()


def test_an_unknown_job_says_how_to_register_one(questpie: Questpie) -> None:
    with pytest.raises(AttributeError, match=r"questpie\.register\(definition\)"):
        _ = questpie.queue.no_such_job
    with pytest.raises(UnknownJobError, match=r"jobs=\[\.\.\.\]"):
        questpie.queue["no-such-job"]


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgresql+psycopg"])
def test_postgres_urls_of_every_common_spelling_run_on_psycopg3(scheme: str) -> None:
    engine = create_ledger_engine(f"{scheme}://app:pw@db.example/app")
    assert engine.url.drivername == "postgresql+psycopg"
    engine.dispose()


def test_an_unsupported_or_malformed_url_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="PostgreSQL or SQLite"):
        create_ledger_engine("mysql://app@db.example/app")
    with pytest.raises(ConfigurationError, match="invalid ledger URL"):
        create_ledger_engine("not a url")


def test_an_unreachable_ledger_says_why() -> None:
    port = free_port()
    questpie = Questpie(
        Celery("messages", broker="memory://"),
        ledger_url=f"postgresql://app:secretpw@127.0.0.1:{port}/app",
        jobs=jobapp.JOBS,
    )
    with pytest.raises(LedgerUnavailableError) as caught:
        questpie.queue.record.publish({"tag": "x"}, idempotency_key="k")
    message = str(caught.value)
    assert "Connection refused" in message or "connection refused" in message
    assert str(port) in message
    assert "secretpw" not in message
    questpie.close()


@pytest.mark.parametrize(
    ("wrapper", "orig", "says"),
    [
        (
            exc.OperationalError,
            psycopg.OperationalError(
                'connection failed: connection to server at "10.0.0.1", port 6432 failed: '
                "FATAL:  unsupported startup parameter: options"
            ),
            "refused the startup parameter 'options'",
        ),
        (
            # PgBouncer 1.20 and later read `options`, and refuse a setting in it by name.
            exc.OperationalError,
            psycopg.OperationalError(
                'connection failed: connection to server at "10.0.0.1", port 6432 failed: '
                "FATAL:  unsupported startup parameter in options: lock_timeout"
            ),
            "refused the startup parameter 'lock_timeout'",
        ),
        (
            exc.ProgrammingError,
            psycopg.errors.DuplicatePreparedStatement('prepared statement "_pg3_0" already exists'),
            "prepared statement",
        ),
        (
            exc.ProgrammingError,
            psycopg.errors.InvalidSqlStatementName('prepared statement "_pg3_3" does not exist'),
            "prepared statement",
        ),
    ],
)
def test_a_poolers_refusal_names_the_setting_to_pass(
    wrapper: type[exc.DBAPIError], orig: Exception, says: str
) -> None:
    """A ledger reached through a pooler in transaction mode without pooled=True: the
    error says what to pass, as an unavailable ledger (a worker sends its delivery back
    to the broker rather than acknowledging it unrun)."""
    with pytest.raises(LedgerUnavailableError) as caught, translate_errors():
        raise wrapper("SELECT 1", {}, orig)
    assert "pass pooled=True (--pooled, QUESTPIE_POOLED)" in str(caught.value)
    assert says in str(caught.value)
