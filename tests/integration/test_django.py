"""questpie_celery.contrib.django in a real Django project (tests/support/djangoproj).

On PostgreSQL and on SQLite: `manage.py migrate` makes the ledger; a `celery -A proj
worker` finds the `@job`s of `shop/tasks.py` without a list; `publish()` inside
`transaction.atomic()` writes in that transaction and sends after the outermost commit;
keys, a policy, a secret payload and schedules work on Django's connection; a
publisher that dies between its commit and its send is made good by the relay; a worker
whose database connections were killed goes on working. Behind PgBouncer in transaction
mode (`QUESTPIE_POOLED = True`) the project works, and its system check refuses
prepared statements.

The Django side runs in subprocesses (`manage.py`, `scenario.py`, the worker): Django's
settings are per process. This process looks at the database with SQLAlchemy only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    inspect,
    make_url,
    select,
    text,
)

from questpie_celery.ledger import DispatchRow, Ledger, dispatch_table, metadata, open_ledger
from tests.support.services import ROOT, PgBouncerServer, PostgresServer, RedisServer, Worker
from tests.support.waiting import wait_until

PROJECT = ROOT / "tests" / "support" / "djangoproj"
PYTHONPATH = f"{PROJECT}{os.pathsep}{ROOT}"

#: The test app's table of handler runs (shop.models.Run), as this process reads it.
runs_table = Table(
    "shop_run",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("tag", String),
    Column("dispatch_id", String),
    Column("attempt", Integer),
    Column("ran_at", DateTime(timezone=True)),
)


@dataclass
class DjangoProject:
    env: dict[str, str]
    url: str  # the database, as a SQLAlchemy URL
    worker: Worker
    ledger: Ledger  # this process's own look at the ledger tables
    engine: Engine

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env, "PYTHONPATH": PYTHONPATH}
        return subprocess.run(
            [sys.executable, *args], cwd=PROJECT, env=env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def scenario(self, name: str, arg: str) -> dict[str, Any]:
        done = self.run("scenario.py", name, arg)
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def runs(self, tag: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(runs_table).where(runs_table.c.tag.startswith(tag)))
            return [dict(row) for row in rows.mappings()]

    def wait_status(self, dispatch_id: str, status: str, timeout: float = 30) -> None:
        last: list[DispatchRow | None] = [None]

        def reached() -> bool:
            last[0] = row = self.ledger.get(dispatch_id)
            return row is not None and row.status == status

        wait_until(
            reached,
            f"dispatch {dispatch_id} to be {status}",
            timeout,
            0.05,
            explain=lambda: f"it is {last[0] and last[0].status}:\n{self.log}",
        )

    def wait_taken(self) -> None:
        """Wait until the worker has taken every message sent so far (see
        `Stack.wait_taken`): a control dispatch published now has completed. Redis's
        queue is first in, first out, and the worker logs each message's receipt as it
        takes it."""
        control = self.scenario("publish", f"control-{uuid.uuid4().hex[:8]}")["id"]
        self.wait_status(control, "completed")

    def rows_of(self, tag: str) -> list[str]:
        """The ids of the ledger's shop.record rows whose payload has `tag`."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(dispatch_table.c.id, dispatch_table.c.payload).where(
                    dispatch_table.c.job_name == "shop.record"
                )
            )
            return [row.id for row in rows if (row.payload or {}).get("tag") == tag]

    @property
    def log(self) -> str:
        return self.worker.log()[-4000:]


def database_url(request: pytest.FixtureRequest, dialect: str, folder: Path, name: str) -> str:
    if dialect == "postgresql":
        postgres: PostgresServer = request.getfixturevalue("postgres")
        return postgres.create_database("dj")
    return f"sqlite:///{folder / name}"


@contextmanager
def running_project(env: dict[str, str], url: str) -> Iterator[DjangoProject]:
    """The project migrated on the database at `url` (reached directly), its worker
    running; stopped and its connections closed on the way out."""
    worker = Worker(env, app="proj", cwd=PROJECT, pythonpath=PYTHONPATH)
    made = DjangoProject(env, url, worker, open_ledger(url), create_engine(url, pool_pre_ping=True))
    try:
        migrated = made.run("manage.py", "migrate", "-v0")
        assert migrated.returncode == 0, migrated.stderr
        worker.start()
        yield made
    finally:
        worker.stop()
        made.ledger.close()
        made.engine.dispose()


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def project(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DjangoProject]:
    folder = tmp_path_factory.mktemp("django")
    url = database_url(request, request.param, folder, "project.sqlite3")
    env = {
        "DJ_DB": url,
        "DJ_BROKER": redis_server.url(redis_server.new_db()),
        "DJANGO_SETTINGS_MODULE": "proj.settings",
    }
    with running_project(env, url) as made:
        yield made


def run_in_project(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A command of the test project against a SQLite file of its own, never migrated."""
    full = {
        **os.environ,
        "DJ_DB": f"sqlite:///{folder / 'unmigrated.sqlite3'}",
        "DJ_BROKER": "memory://",
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "PYTHONPATH": PYTHONPATH,
        **env,
    }
    return subprocess.run(
        [sys.executable, *args], cwd=PROJECT, env=full, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


#: The SQLite options docs/django.md asks for when several processes write one file.
SAFE_SQLITE = {
    "timeout": 15,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL",
}
WITH_ADMIN = [
    "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
    "django.contrib.messages", "django.contrib.sessions", "questpie_celery.contrib.django",
    "shop",
]  # fmt: skip


ADMIN_MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ADMIN_TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def with_jobs(folder: Path, jobs: dict[str, Any], **settings: Any) -> dict[str, str]:
    """The test project with a second alias, `jobs`, beside a well-configured default."""
    default = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(folder / "default.sqlite3")}
    databases = {"default": {**default, "OPTIONS": SAFE_SQLITE}, "jobs": jobs}
    return {"DJ_SETTINGS": json.dumps({"DATABASES": databases, **settings})}


def settings_of(**settings: Any) -> dict[str, str]:
    return {"DJ_SETTINGS": json.dumps(settings)}


#: Every configuration mistake docs/django.md names, as the test project's environment
#: makes it (for a project folder), the check that must report it, and words of its fix.
MISTAKES: dict[str, tuple[Callable[[Path], dict[str, str]], str, str]] = {
    "an alias DATABASES lacks": (
        lambda _: settings_of(QUESTPIE_DATABASE="jobs"),
        "questpie_celery.E002",
        "add DATABASES['jobs']",
    ),
    "an alias that is not a str": (
        lambda _: settings_of(QUESTPIE_DATABASE=1),
        "questpie_celery.E001",
        'QUESTPIE_DATABASE = "default"',
    ),
    "neither PostgreSQL nor SQLite": (
        lambda folder: with_jobs(
            folder, {"ENGINE": "django.db.backends.dummy"}, QUESTPIE_DATABASE="jobs"
        ),
        "questpie_celery.E003",
        "django.db.backends.postgresql",
    ),
    "autocommit off": (
        lambda _: {"DJ_DATABASE_EXTRA": json.dumps({"AUTOCOMMIT": False})},
        "questpie_celery.E005",
        "remove AUTOCOMMIT",
    ),
    "Questpie(django_database=) naming another alias than the setting": (
        lambda folder: {
            **with_jobs(
                folder,
                {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": str(folder / "jobs.sqlite3"),
                    "OPTIONS": SAFE_SQLITE,
                },
            ),
            "DJ_DJANGO_DATABASE": "jobs",
        },
        "questpie_celery.E006",
        "set QUESTPIE_DATABASE = 'jobs'",
    ),
    "SQLite without the options for several processes": (
        lambda _: {"DJ_DATABASE_EXTRA": json.dumps({"OPTIONS": {}})},
        "questpie_celery.W001",
        '"transaction_mode": "IMMEDIATE"',
    ),
    "the admin reading another database than the ledger's": (
        lambda _: settings_of(
            INSTALLED_APPS=WITH_ADMIN,
            DATABASE_ROUTERS=["proj.routers.QuestpieElsewhere"],
            MIDDLEWARE=ADMIN_MIDDLEWARE,
            TEMPLATES=ADMIN_TEMPLATES,
        ),
        "questpie_celery.W002",
        "route the questpie_celery app's models to 'default'",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_manage_py_check_reports_each_configuration_mistake_with_its_fix(
    mistake: str, tmp_path: Path
) -> None:
    make_env, check_id, fix = MISTAKES[mistake]
    checked = run_in_project(tmp_path, "manage.py", "check", **make_env(tmp_path))
    report = checked.stdout + checked.stderr
    assert "Traceback" not in report, report
    lines = report.splitlines()
    found = next((n for n, line in enumerate(lines) if f"({check_id})" in line), None)
    assert found is not None, report
    assert "HINT" in lines[found + 1] and fix in lines[found + 1], report
    assert (checked.returncode != 0) == (".E" in check_id), report


def test_manage_py_check_finds_nothing_in_a_well_configured_project(tmp_path: Path) -> None:
    checked = run_in_project(tmp_path, "manage.py", "check")
    assert checked.returncode == 0, checked.stderr
    assert "questpie_celery" not in checked.stdout + checked.stderr


#: A keyed publish in the test project: prints the error it raised.
PUBLISH_KEYED = (
    "import django; django.setup()\n"
    "from proj.celery import questpie\n"
    "try:\n"
    "    questpie.queue['shop.record'].publish({'tag': 'x'}, idempotency_key='k')\n"
    "except Exception as exc:\n"
    "    print(type(exc).__name__, exc)\n"
)


def test_a_misconfigured_django_ledger_refuses_publishes_with_the_fix(tmp_path: Path) -> None:
    """The project still imports (so `manage.py check` runs); its ledger is unreachable
    until the setting is fixed, saying how."""
    done = run_in_project(tmp_path, "-c", PUBLISH_KEYED, **settings_of(QUESTPIE_DATABASE="jobs"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("LedgerUnavailableError"), done.stdout
    assert "add DATABASES['jobs']" in done.stdout and "manage.py check" in done.stdout


def test_an_unmigrated_django_ledger_says_to_run_manage_py_migrate(tmp_path: Path) -> None:
    done = run_in_project(tmp_path, "-c", PUBLISH_KEYED)
    assert done.returncode == 0, done.stderr
    assert "LedgerSchemaError" in done.stdout, done.stdout
    assert "run `python manage.py migrate`" in done.stdout, done.stdout
    assert "questpie-celery migrate" not in done.stdout


def schema(url: str) -> dict[str, Any]:
    """The ledger tables of a database: columns, keys and indexes, comparable."""
    engine = create_engine(url)
    try:
        found = inspect(engine)
        return {
            table: {
                "columns": [
                    (c["name"], str(c["type"]), c["nullable"]) for c in found.get_columns(table)
                ],
                "primary_key": found.get_pk_constraint(table)["constrained_columns"],
                "indexes": sorted(
                    (i["name"] or "", tuple(i["column_names"]), bool(i["unique"]))
                    for i in found.get_indexes(table)
                ),
            }
            for table in sorted(found.get_table_names())
            if table in metadata.tables
        }
    finally:
        engine.dispose()


def test_manage_py_migrate_makes_the_ledger_questpie_celery_migrate_makes(
    project: DjangoProject, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    # Idempotent: a second run (and the one the fixture made) changes nothing.
    again = project.run("manage.py", "migrate", "-v0")
    assert again.returncode == 0, again.stderr
    dialect = "sqlite" if project.url.startswith("sqlite") else "postgresql"
    plain = database_url(request, dialect, tmp_path, "plain.sqlite3")
    cli = str(Path(sys.executable).parent / "questpie-celery")
    made = subprocess.run(
        [cli, "migrate", "--ledger-url", plain], capture_output=True, text=True, check=False
    )
    assert made.returncode == 0, made.stderr
    ours = schema(project.url)
    assert set(ours) == set(metadata.tables)
    assert ours == schema(plain)
    assert project.ledger.schema_version() == Ledger(create_engine(plain)).schema_version()
    with project.engine.connect() as conn:
        applied = conn.execute(
            text("SELECT name FROM django_migrations WHERE app = 'questpie_celery'")
        ).scalars()
        assert list(applied) == [
            "0001_ledger",
            "0002_admin_models",
            "0003_dispatch_ids",
            "0004_claim_generation",
            "0005_canvas",
        ]


def test_the_worker_finds_the_apps_jobs_without_a_list(project: DjangoProject) -> None:
    log = project.worker.log()
    for name in ("shop.record", "shop.exclusive", "shop.magic-link"):
        assert name in log
    # The relay, its listener (PostgreSQL) and the policy records ran on Django's
    # connections without a complaint.
    assert "Traceback" not in log and "cannot listen" not in log, log


def test_publish_inside_atomic_rides_the_transaction(project: DjangoProject) -> None:
    tag = f"t{uuid.uuid4().hex[:8]}"
    seen = project.scenario("atomic", tag)
    assert seen["orders"] == 1
    # Invisible to any other connection until the outermost commit, then there.
    assert seen["a_seen_before_commit"] is False
    assert seen["a_seen_after_commit"] is True
    # The rows that committed each ran once, and only after the commit: the worker
    # received each one's message after the marker sent at the end of the block, so
    # none was sent before the commit.
    sent = [seen["a"], seen["b"], *seen["many"], seen["e"]]
    for dispatch_id in sent:
        project.wait_status(dispatch_id, "completed")
    received = [line for line in project.worker.log().splitlines() if "] received" in line]
    marker = next(n for n, line in enumerate(received) if seen["marker"] in line)
    for dispatch_id in sent:
        first = next(n for n, line in enumerate(received) if dispatch_id in line)
        assert first > marker, f"{dispatch_id} was sent before the commit:\n{project.log}"
    runs = project.runs(tag)
    assert sorted(run["dispatch_id"] for run in runs) == sorted(sent), project.log
    committed_at = seen["committed_at"]
    for run in runs:
        if run["dispatch_id"] != seen["e"]:
            ran_at = run["ran_at"]
            if ran_at.tzinfo is None:  # SQLite: Django stores UTC, naive
                ran_at = ran_at.replace(tzinfo=UTC)
            assert ran_at.timestamp() >= committed_at - 0.05
    # The rolled-back savepoint dropped only its own row; the rolled-back block all.
    assert project.ledger.get(seen["c"]) is None
    assert project.ledger.get(seen["d"]) is None
    assert seen["d_status"] == "None"
    # Every row that committed ended for good (a completed row can be claimed no more),
    # so the runs above are all there will be; and nothing was sent for the rolled-back
    # ones: the worker, having taken every message sent until now, never received them.
    project.wait_taken()
    for dropped in (seen["c"], seen["d"]):
        assert project.worker.log_about(dropped) == [], project.log
    assert len(project.runs(tag)) == len(sent)


def test_keys_policies_secrets_and_schedules_on_djangos_connection(
    project: DjangoProject,
) -> None:
    tag = f"f{uuid.uuid4().hex[:8]}"
    seen = project.scenario("features", tag)
    first, again = seen["key"]
    assert first == again == seen["key_after"]
    kept, suppressed = seen["exclusive"]
    assert kept is not None and suppressed is None
    assert seen["receipt"] in ("queued", "completed")  # the worker may be that quick
    assert seen["schedules"] == ["shop.record"] and seen["schedules_after"] == []
    for dispatch_id in (first, kept, seen["secret"]):
        project.wait_status(dispatch_id, "completed")
    secret = project.ledger.get(seen["secret"])
    assert secret is not None and secret.payload is None and secret.secret
    assert project.scenario("receipt", seen["secret"])["status"] == "completed"
    assert len(project.runs(f"{tag}-k")) == 1
    assert len(project.runs(f"{tag}-s")) == 1


def test_threads_publishing_at_once_each_write_on_their_own_connection(
    project: DjangoProject,
) -> None:
    """Django's connections are each thread's own, and may be in that thread's
    transaction: threads publishing at the same moment never share a statement there (a
    row written on another thread's connection would be undone by that thread's
    rollback). Each publish is a write transaction of its own, and each row is there."""
    tag = f"h{uuid.uuid4().hex[:8]}"
    seen = project.scenario("threads", tag)
    ids = seen["ids"]
    assert len(ids) == 200 and None not in ids and len(set(ids)) == 200
    if seen["writes"] is not None:  # PostgreSQL
        assert seen["writes"] >= len(ids)
    for dispatch_id in ids:
        assert project.ledger.get(dispatch_id) is not None
    for dispatch_id in ids[-5:]:
        project.wait_status(dispatch_id, "completed")


def test_a_schedule_fires_once_on_djangos_connection(project: DjangoProject) -> None:
    tag = f"s{uuid.uuid4().hex[:8]}"
    seen = project.scenario("fire", tag)
    assert seen["dispatch"] is not None
    # The fires ran in the scenario, before it returned: one row, ended for good (a
    # completed row can be claimed no more), so its one run is all there will be.
    assert project.rows_of(tag) == [seen["dispatch"]]
    project.wait_status(seen["dispatch"], "completed")
    assert [run["dispatch_id"] for run in project.runs(tag)] == [seen["dispatch"]]


def test_a_ledger_error_caught_inside_atomic_rolls_the_block_back(
    project: DjangoProject,
) -> None:
    """On PostgreSQL a failed statement aborts the transaction: Django must be told, or
    it would "commit" (a rollback, server side) and run the block's on_commit callbacks
    for work that never committed."""
    seen = project.scenario("swallowed", f"w{uuid.uuid4().hex[:8]}")
    assert seen["caught"] == "LedgerBusyError"
    assert seen["fired"] == seen["order"]
    if project.url.startswith("postgresql"):
        assert (seen["fired"], seen["order"]) == (False, False)


def test_a_publisher_dying_after_commit_is_made_good_by_the_relay(
    project: DjangoProject,
) -> None:
    tag = f"d{uuid.uuid4().hex[:8]}"
    died = project.run("scenario.py", "die", tag)
    assert died.returncode == 0, died.stderr
    dispatch_id = json.loads(died.stdout.strip().splitlines()[0])["id"]
    row = project.ledger.get(dispatch_id)
    # Committed, never sent: pending, left to its publisher for the grace period.
    assert row is not None and row.status == "pending" and row.send_count == 0
    assert project.runs(tag) == []
    # The grace (PENDING_GRACE_SECONDS, 30 s) is not configurable: move the row's relay
    # time to now instead of waiting it out. The relay does the rest on its own.
    with project.ledger.engine.begin() as conn:
        conn.execute(
            dispatch_table.update()
            .where(dispatch_table.c.id == dispatch_id)
            .values(next_send_at=row.created_at)
        )
    project.wait_status(dispatch_id, "completed")
    assert [run["dispatch_id"] for run in project.runs(tag)] == [dispatch_id]


def test_a_worker_whose_connections_were_killed_goes_on(
    project: DjangoProject, request: pytest.FixtureRequest
) -> None:
    if project.url.startswith("sqlite"):
        pytest.skip("SQLite has no server to lose")
    first = project.scenario("publish", f"k{uuid.uuid4().hex[:8]}")["id"]
    project.wait_status(first, "completed")
    postgres: PostgresServer = request.getfixturevalue("postgres")
    assert postgres.terminate_backends(project.url) > 0  # the worker's, and its relay's
    tag = f"k{uuid.uuid4().hex[:8]}"
    second = project.scenario("publish", tag)["id"]
    project.wait_status(second, "completed")
    assert len(project.runs(tag)) == 1
    assert project.worker.alive()


def worker_backends(watch: Engine, database: str | None) -> dict[int, Any]:
    """The worker's connections to `database` (but its LISTEN one): pid, last query's start."""
    with watch.connect() as conn:
        found = conn.execute(
            text(
                "SELECT pid, query_start FROM pg_stat_activity "
                "WHERE datname = :db AND query NOT LIKE 'LISTEN%'"
            ),
            {"db": database},
        )
        return {int(row.pid): row.query_start for row in found}


def sessions_opened(watch: Engine, database: str | None) -> int:
    """How many connections to `database` were ever opened (PostgreSQL 14 on)."""
    with watch.connect() as conn:
        found = conn.execute(
            text("SELECT sessions FROM pg_stat_database WHERE datname = :db"), {"db": database}
        )
        return int(found.scalar_one())


@pytest.mark.parametrize("max_age", [0, 600])
def test_the_workers_connections_follow_conn_max_age(
    max_age: int, request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path
) -> None:
    """With `CONN_MAX_AGE = 0` no connection of the worker (its children's, its relay's)
    outlives a unit of work; with a positive one they are kept and reused. The relay's
    LISTEN connection is its own, held for good, and left out."""
    postgres: PostgresServer = request.getfixturevalue("postgres")
    url = postgres.create_database("dj")
    env = {
        "DJ_DB": url,
        "DJ_BROKER": redis_server.url(redis_server.new_db()),
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "DJ_CONN_MAX_AGE": str(max_age),
    }
    with running_project(env, url) as made:
        for _ in range(3):
            dispatch_id = made.scenario("publish", f"m{uuid.uuid4().hex[:8]}")["id"]
            made.wait_status(dispatch_id, "completed")
        made.ledger.close()  # this test's own connections: only the worker's are left
        # Looked at from another database, so that no connection of this test is counted.
        watch = create_engine(make_url(url).set(database="postgres"))
        try:
            database = make_url(url).database
            before = worker_backends(watch, database)
            opened = sessions_opened(watch, database)
            if max_age == 0:
                # The relay's later passes (its units of work, every couple of seconds)
                # each open a connection of their own, and none made before is left.
                wait_until(
                    lambda: sessions_opened(watch, database) >= opened + 2,
                    "two relay passes on connections of their own (one kept instead?)",
                )
                kept = set(before) & set(worker_backends(watch, database))
                assert not kept, f"connections {kept} outlived their unit of work"
            else:
                # A connection made before is used again by a later pass.
                wait_until(
                    lambda: any(
                        pid in before and started > before[pid]
                        for pid, started in worker_backends(watch, database).items()
                    ),
                    f"a connection reused with CONN_MAX_AGE={max_age} (of {before})",
                )
        finally:
            watch.dispose()


# --- behind a pooler -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pooled_project(
    postgres: PostgresServer, pgbouncer: PgBouncerServer, redis_server: RedisServer
) -> Iterator[DjangoProject]:
    """The project on PostgreSQL through PgBouncer in transaction mode, with its stock
    settings, and `QUESTPIE_POOLED = True`."""
    direct = postgres.create_database("djpooled")
    env = {
        "DJ_DB": pgbouncer.url(direct),
        "DJ_POOLED": "1",
        "DJ_BROKER": redis_server.url(redis_server.new_db()),
        "DJANGO_SETTINGS_MODULE": "proj.settings",
    }
    with running_project(env, direct) as made:
        yield made


def test_a_pooled_project_works_through_pgbouncer(pooled_project: DjangoProject) -> None:
    checked = pooled_project.run("manage.py", "check")
    assert checked.returncode == 0, checked.stderr
    assert pooled_project.scenario("listens", "-") == {"listens": False}  # its relays poll
    tag = f"p{uuid.uuid4().hex[:8]}"
    seen = pooled_project.scenario("features", tag)
    first, again = seen["key"]
    assert first == again == seen["key_after"]
    kept, suppressed = seen["exclusive"]
    assert kept is not None and suppressed is None
    for dispatch_id in (first, kept, seen["secret"]):
        pooled_project.wait_status(dispatch_id, "completed")
    assert len(pooled_project.runs(f"{tag}-k")) == 1
    assert len(pooled_project.runs(f"{tag}-s")) == 1


def test_the_system_check_refuses_prepared_statements_behind_a_pooler(
    pooled_project: DjangoProject,
) -> None:
    preparing = replace(pooled_project, env={**pooled_project.env, "DJ_PREPARE_THRESHOLD": "5"})
    checked = preparing.run("manage.py", "check")
    assert checked.returncode != 0
    assert "questpie_celery.E008" in checked.stderr
    assert "prepare_threshold" in checked.stderr
