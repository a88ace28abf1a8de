from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, create_engine, delete, func, select, text

from questpie_celery import Questpie
from questpie_celery.ledger import Ledger, create_ledger_engine, dispatch_table, open_ledger
from tests import jobapp
from tests.services import Worker, postgres_server, redis_server


@dataclass
class Stack:
    """One configuration of the real parts: broker, ledger, a worker, and a client app."""

    env: dict[str, str]
    celery_app: Celery
    questpie: Questpie
    engine: Engine
    worker: Worker
    ledger: Ledger

    def runs(self, tag: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(jobapp.runs_table)
                .where(jobapp.runs_table.c.tag == tag)
                .order_by(jobapp.runs_table.c.id)
            ).mappings()
            return [dict(r) for r in rows]

    def wait_runs(self, tag: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until `count` runs of `tag` are recorded, then a little more for extras."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.runs(tag)) >= count:
                break
            time.sleep(0.1)
        # A duplicate run would land right after the first; give it the chance to.
        time.sleep(0.5)
        return self.runs(tag)

    def wait_status(self, dispatch_id: str, status: str, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        row = None
        while time.monotonic() < deadline:
            row = self.ledger.get(dispatch_id)
            if row is not None and row.status == status:
                return row
            time.sleep(0.1)
        raise AssertionError(f"dispatch {dispatch_id} is {row and row.status}, not {status}")

    def dispatch_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(dispatch_table)).scalar_one())


def tag() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.fixture(scope="session")
def pg_unit_url(pg_url: str) -> str:
    """A database of its own on the suite's server, for tests that empty the ledger."""
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS qp_unit"))
        conn.execute(text("CREATE DATABASE qp_unit"))
    admin.dispose()
    return pg_url.rsplit("/", 1)[0] + "/qp_unit"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


def make_stack(env: dict[str, str], *, loglevel: str = "info") -> Iterator[Stack]:
    """The parts `env` describes: this process's app and Questpie, and a worker process."""
    celery_app, questpie = jobapp.build(
        broker=env["QP_TEST_BROKER"],
        ledger=env["QP_TEST_LEDGER"],
        backend=env.get("QP_TEST_BACKEND"),
        fs_dir=env.get("QP_TEST_FS_DIR"),
        secret=env.get("QP_TEST_SECRET"),
        extended=bool(env.get("QP_TEST_EXTENDED")),
    )
    questpie.migrate()
    engine = create_ledger_engine(env["QP_TEST_LEDGER"])
    jobapp.runs_metadata.create_all(engine)
    worker = Worker(env, loglevel=loglevel).start()
    ledger = open_ledger(env["QP_TEST_LEDGER"])
    try:
        yield Stack(env, celery_app, questpie, engine, worker, ledger)
    finally:
        worker.stop()
        engine.dispose()
        ledger.close()
        questpie.close()


@pytest.fixture(scope="session")
def pg_redis(pg_url: str, redis_url: str) -> Iterator[Stack]:
    """PostgreSQL ledger, Redis broker and result backend, a prefork worker."""
    backend = redis_url.rsplit("/", 1)[0] + "/1"
    yield from make_stack(
        {"QP_TEST_BROKER": redis_url, "QP_TEST_BACKEND": backend, "QP_TEST_LEDGER": pg_url}
    )


@pytest.fixture(scope="session")
def sqlite_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The embedded default: SQLite ledger file, filesystem broker, two prefork children."""
    folder: Path = tmp_path_factory.mktemp("embedded")
    yield from make_stack(
        {
            "QP_TEST_BROKER": "filesystem://",
            "QP_TEST_FS_DIR": str(folder / "broker"),
            "QP_TEST_LEDGER": f"sqlite:///{folder / 'ledger.sqlite3'}",
        }
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A migrated, emptied ledger database on each dialect (no broker, no worker)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    else:
        url = request.getfixturevalue("pg_unit_url")
    engine = create_ledger_engine(url)
    Ledger(engine).migrate()
    with engine.begin() as conn:
        conn.execute(delete(dispatch_table))
    yield engine
    engine.dispose()
