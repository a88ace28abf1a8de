"""Errors say what happened and what to do, in their own text."""

from __future__ import annotations

import asyncio
import functools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner
from pydantic import BaseModel
from sqlalchemy import exc

from questpie_celery import (
    ConfigurationError,
    JobContext,
    JobDefinitionError,
    LedgerUnavailableError,
    Questpie,
    UnknownJobError,
    job,
)
from questpie_celery.cli.commands import main
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


@pytest.mark.parametrize(
    ("call", "method"),
    [
        ("publish", lambda c, **kw: c.publish({"tag": "x"}, **kw)),
        ("apublish", lambda c, **kw: asyncio.run(c.apublish({"tag": "x"}, **kw))),
        ("publish_many", lambda c, **kw: c.publish_many([{"tag": "x"}], **kw)),
        ("apublish_many", lambda c, **kw: asyncio.run(c.apublish_many([{"tag": "x"}], **kw))),
    ],
)
def test_every_publishing_call_refuses_an_unknown_keyword_and_writes_nothing(
    questpie: Questpie, ledger_url: str, call: str, method: Callable[..., object]
) -> None:
    options: dict[str, Any] = {"countdown": 5, "priority": 1}
    with pytest.raises(TypeError, match=rf"^{call}\(\) got an unexpected keyword argument "):
        method(questpie.queue.record, **options)
    ledger = open_ledger(ledger_url)
    assert row_count(ledger) == 0
    ledger.close()


@pytest.mark.parametrize("name", ["idempotency_key", "singleton_key"])
def test_publish_many_given_one_key_says_to_pass_one_per_payload(
    questpie: Questpie, name: str
) -> None:
    options: dict[str, Any] = {name: "k"}
    with pytest.raises(TypeError, match=rf"publish_many\(\) takes {name}s=\[\.\.\.\]"):
        questpie.queue.record.publish_many([{"tag": "x"}], **options)


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


# --- names and definitions ------------------------------------------------------------


class Widget(BaseModel):
    widget_id: str


def rename_widget_job(payload: Widget, ctx: JobContext) -> None:
    del payload, ctx


def test_an_unknown_job_attribute_suggests_the_job_and_its_name_form() -> None:
    questpie = Questpie(
        Celery("names", broker="memory://"),
        ledger_url="sqlite://",
        jobs=[job(name="demoapp.rename-widget", schema=Widget)(rename_widget_job)],
    )
    writes = 'Write questpie.queue.demoapp_rename_widget or questpie.queue["demoapp.rename-widget"]'
    with pytest.raises(AttributeError) as by_handler:
        _ = questpie.queue.rename_widget_job  # the function's name, not the job's
    assert "rename_widget_job is the handler of job 'demoapp.rename-widget'" in str(
        by_handler.value
    )
    assert writes in str(by_handler.value)
    with pytest.raises(AttributeError) as misspelt:
        _ = questpie.queue.demoapp_rename_widgt
    assert "did you mean job 'demoapp.rename-widget'?" in str(misspelt.value)
    assert writes in str(misspelt.value)
    with pytest.raises(UnknownJobError) as by_attribute:
        questpie.queue["demoapp_rename_widget"]  # the attribute's spelling, as a name
    assert writes in str(by_attribute.value)
    with pytest.raises(AttributeError) as unlike:
        _ = questpie.queue.zzz
    assert "Write" not in str(unlike.value)
    assert "Known jobs: demoapp.rename-widget" in str(unlike.value)
    questpie.close()


def takes_the_payload_only(payload: Widget) -> None:
    del payload


def wants_a_keyword(payload: Widget, ctx: JobContext, *, dry_run: bool) -> None:
    del payload, ctx, dry_run


def without_ctx(handler: Callable[[Widget], None]) -> Callable[[Widget, JobContext], None]:
    """A decorator adapting a payload-only function into a handler, as projects write."""

    @functools.wraps(handler)
    def adapted(payload: Widget, ctx: JobContext) -> None:
        del ctx
        handler(payload)

    return adapted


def passed_through(handler: Callable[..., None]) -> Callable[..., None]:
    """A decorator that calls what it wraps with whatever it is given."""

    @functools.wraps(handler)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        handler(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("handler", "named"),
    [
        (takes_the_payload_only, "takes_the_payload_only(payload: 'Widget')"),
        # a wrapper taking anything hands both on: what it wraps must take them
        (passed_through(takes_the_payload_only), "takes_the_payload_only(payload: 'Widget')"),
        (wants_a_keyword, "wants_a_keyword(payload: 'Widget', ctx: 'JobContext', *, dry_run"),
        (lambda: None, "<lambda>()"),
    ],
)
def test_a_handler_that_cannot_take_payload_and_ctx_is_refused_naming_it(
    handler: Any, named: str
) -> None:
    with pytest.raises(JobDefinitionError) as caught:
        job(name="bad-handler", schema=Widget)(handler)
    assert f"job 'bad-handler': its handler {named}" in str(caught.value)
    assert "cannot be called as handler(payload, ctx)" in str(caught.value)


class Handlers:
    def method(self, payload: Widget, ctx: JobContext) -> None:
        del payload, ctx

    def __call__(self, payload: Widget, ctx: JobContext) -> None:
        del payload, ctx


@pytest.mark.parametrize(
    "handler",
    [
        rename_widget_job,
        Handlers().method,
        Handlers(),
        lambda *args: None,
        lambda payload, ctx, extra=1: None,
        functools.partial(lambda services, payload, ctx: None, "services"),
        # its own signature is what is called, not the one functools.wraps copied
        without_ctx(takes_the_payload_only),
        passed_through(rename_widget_job),
    ],
)
def test_a_handler_that_can_take_payload_and_ctx_is_accepted(handler: Any) -> None:
    assert job(name="good-handler", schema=Widget)(handler).handler is handler


# --- every ledger URL a user may paste --------------------------------------------------


@pytest.mark.parametrize(
    ("pasted", "runs_on"),
    [
        ("postgresql+psycopg2://app:s3cret@db.example/app", "postgresql+psycopg://app:***@db.example/app"),
        ("postgresql+asyncpg://app:s3cret@db.example/app", "postgresql+psycopg://app:***@db.example/app"),
        ("postgresql+pg8000://app@db.example:6543/app", "postgresql+psycopg://app@db.example:6543/app"),
        ("postgresql+psycopg_async://app@db.example/app", "postgresql+psycopg://app@db.example/app"),
        ("postgres://app@db.example/app?sslmode=require", "postgresql+psycopg://app@db.example/app?sslmode=require"),
        # asyncpg's ssl= is libpq's sslmode=, in the same words
        ("postgresql+asyncpg://app@db.example/app?ssl=verify-full", "postgresql+psycopg://app@db.example/app?sslmode=verify-full"),
        ("postgresql://app@/app?host=/var/run/postgresql", "postgresql+psycopg://app@/app?host=%2Fvar%2Frun%2Fpostgresql"),
        ("postgresql://app@/app?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
         "postgresql+psycopg://app@/app?host=h1%3A5432&host=h2%3A5433&target_session_attrs=read-write"),
        ("  postgresql://app@db.example/app\n", "postgresql+psycopg://app@db.example/app"),
        ("sqlite+aiosqlite:////var/lib/ledger.sqlite3", "sqlite:////var/lib/ledger.sqlite3"),
        ("sqlite:////var/lib/ledger.sqlite3?timeout=30", "sqlite:////var/lib/ledger.sqlite3?timeout=30"),
        ("sqlite:///file:ledger.db?mode=rwc&uri=true", "sqlite:///file%3Aledger.db?mode=rwc&uri=true"),
    ],
)  # fmt: skip
def test_a_pasted_ledger_url_runs_on_psycopg3_or_sqlite3(pasted: str, runs_on: str) -> None:
    engine = create_ledger_engine(pasted)
    assert engine.url.render_as_string(hide_password=True) == runs_on
    engine.dispose()


@pytest.mark.parametrize(
    ("pasted", "says"),
    [
        ("postgresql+asyncpg://app:s3cret@db/app?prepared_statement_cache_size=0",
         "for a pooler in transaction mode, pass pooled=True"),
        ("postgresql+asyncpg://app:s3cret@db/app?ssl=true", "write sslmode= with one of"),
        ("postgresql://app:s3cret@db/app?command_timeout=5", "statement_timeout"),
        ("postgresql://app:s3cret@db/app?sslmod=require", "'sslmod' is none of the"),
        ("postgresql://app:s3cret@db/app?sslmode=require&sslmode=allow", "more than once"),
        ("postgresql://app:s3cret@db1:5432,db2:5433/app", "?host=h1:5432&host=h2:5433"),
        ("postgresql://app:s3cr@t@db.example/app", "percent-encode its password"),
        ("postgresql+mysqlconnector://app@db.example/app", "write postgresql+psycopg://"),
        ("mysql://app:s3cret@db/app", "PostgreSQL or SQLite, not 'mysql'"),
        ("/var/lib/ledger.sqlite3", "write sqlite:////var/lib/ledger.sqlite3"),
        ("ledger.sqlite3", "is a file path: write sqlite:////"),
        # a slash or the scheme missing: not a file path, and the password stays out
        ("postgresql:/app:s3cret@db.example/app", "invalid ledger URL: write postgresql+psycopg://"),
        ("app:s3cret@db.example/app", "invalid ledger URL: write postgresql+psycopg://"),
        ("sqlite://ledger.sqlite3", "a SQLite URL has no host: write sqlite:////"),
        ("sqlite:///ledger.sqlite3?journal=wal", "'journal' is not one of Python's sqlite3"),
        ("sqlite+pysqlcipher:///ledger.db", "with Python's sqlite3, not 'pysqlcipher'"),
        ("", "the ledger URL is empty"),
        ("jdbc:postgresql://db.example/app", "invalid ledger URL: write postgresql+psycopg://"),
    ],
)  # fmt: skip
def test_a_ledger_url_that_cannot_be_used_says_what_to_write(pasted: str, says: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_ledger_engine(pasted)
    assert says in str(caught.value)
    assert "s3cr" not in str(caught.value)
    # Where the project builds its Questpie (at import), the same error.
    with pytest.raises(ConfigurationError, match=re.escape(says)):
        Questpie(Celery("urls", broker="memory://"), ledger_url=pasted)


def test_the_urls_own_connection_settings_win_over_the_ledgers_defaults() -> None:
    engine = create_ledger_engine(
        "postgresql://app@db.example/app?connect_timeout=30&options=-c%20search_path%3Dledger"
    )
    _, params = engine.dialect.create_connect_args(engine.url)
    assert params["connect_timeout"] == "30"
    assert params["options"] == "-c search_path=ledger"  # the URL's, before connect_args
    engine.dispose()


def test_migrate_given_a_url_it_cannot_use_prints_one_error_line(tmp_path: Path) -> None:
    runner = CliRunner()
    refused = runner.invoke(
        main, ["migrate", "--ledger-url", "postgresql+asyncpg://app@db.example/app?ssl=true"]
    )
    assert refused.exit_code == 1 and isinstance(refused.exception, SystemExit)
    assert refused.output.startswith("Error: the ledger URL's parameter 'ssl'")
    # ... and a project whose Questpie is built with one, at import.
    (tmp_path / "urlproj.py").write_text(
        "from celery import Celery\nfrom questpie_celery import Questpie\n"
        "questpie = Questpie(Celery('u'), ledger_url='sqlite://ledger.sqlite3')\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        imported = runner.invoke(main, ["migrate", "-A", "urlproj"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("urlproj", None)
    assert imported.exit_code == 1 and isinstance(imported.exception, SystemExit)
    assert imported.output.startswith("Error: importing urlproj: a SQLite URL has no host")


# --- connection errors say which ------------------------------------------------------

AT = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


@pytest.mark.parametrize(
    ("driver_says", "we_say"),
    [
        (AT + 'FATAL:  role "app" does not exist',
         ['refused the connection: the server has no role "app"', 'CREATE ROLE "app" LOGIN']),
        (AT + 'FATAL:  database "shop" does not exist',
         ['has no database "shop"', "then run questpie-celery migrate"]),
        (AT + 'FATAL:  password authentication failed for user "app"',
         ['authentication failed: the server refused the password of role "app"', "%40"]),
        (AT + "fe_sendauth: no password supplied",
         ["asks for a password and the ledger URL gives none"]),
        (AT + 'FATAL:  Ident authentication failed for user "app"',
         ['Ident authentication of role "app"', "pg_hba.conf"]),
        (AT + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "app", database "shop", '
              "no encryption",
         ["if it takes them over TLS, add sslmode=require", "otherwise add a rule"]),
        # sslmode=prefer tried TLS first, and was refused there too: TLS is not the way in
        (AT + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "app", database "shop", '
              "SSL encryption\n" + AT + 'FATAL:  no pg_hba.conf entry for host "10.0.0.9", '
              'user "app", database "shop", no encryption',
         ["pg_hba.conf lets no such connection in (this host, role and database)"]),
        (AT + "FATAL:  SSL connection is required. Please specify SSL options and retry.",
         ["only over TLS"]),
        (AT + "server does not support SSL, but SSL was required",
         ["requires TLS (its sslmode) and the server offers none"]),
        (AT + "FATAL:  sorry, too many clients already", ["no connection left"]),
        (AT + "Connection refused\n\tIs the server running on that host and accepting TCP/IP "
              "connections?",
         ['cannot be reached: nothing accepts connections at host "10.0.0.5", port 5432']),
        ('connection is bad: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '
         "No such file or directory",
         ['no server listens on the socket "/run/pg/.s.PGSQL.5432"']),
        ("failed to resolve host 'db.internal': [Errno -2] Name or service not known",
         ['cannot be reached: the host name "db.internal" does not resolve']),
        ("connection timeout expired", ["no answer from the ledger URL's host", "firewall"]),
        (AT + "No route to host", ['no route from here to host "10.0.0.5", port 5432']),
    ],
)  # fmt: skip
def test_a_connection_error_says_what_failed_and_what_to_do(
    driver_says: str, we_say: list[str]
) -> None:
    with pytest.raises(LedgerUnavailableError) as caught, translate_errors():
        raise exc.OperationalError(None, None, psycopg.OperationalError(driver_says))
    for phrase in we_say:
        assert phrase in str(caught.value)
    refused = "the dispatch ledger database refused the connection: "
    unreachable = "the dispatch ledger database cannot be reached: "
    assert str(caught.value).startswith(refused if refused in str(caught.value) else unreachable)
