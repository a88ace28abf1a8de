"""The real servers and stacks the integration tests run against.

One PostgreSQL, one Redis and one RabbitMQ server serve the whole session; every
stack gets a database, a Redis database and a queue of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from questpie_celery.ledger import Ledger, dispatch_table, open_ledger
from tests.support.faultproxy import FaultProxy
from tests.support.faults import SHORT_LEASE
from tests.support.services import PgBouncerServer, PostgresServer, RabbitServer, RedisServer
from tests.support.stack import Stack, build_stack

StackFactory = Callable[..., Stack]
#: The secret of `pooled_stack`.
POOLED_SECRET = "pooled " * 6


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def pgbouncer(postgres: PostgresServer) -> Iterator[PgBouncerServer]:
    """PgBouncer in transaction mode, stock settings otherwise, in front of `postgres`."""
    server = PgBouncerServer(postgres).start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def rabbit() -> Iterator[RabbitServer]:
    server = RabbitServer().start()
    yield server
    server.close()


def broker_env(request: pytest.FixtureRequest, broker: str, folder: Path) -> dict[str, str]:
    """Broker (and, for Redis, result backend) settings of a new stack."""
    if broker == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        return {
            "QP_TEST_BROKER": redis.url(redis.new_db()),
            "QP_TEST_BACKEND": redis.url(redis.new_db()),
        }
    if broker == "rabbitmq":
        rabbit: RabbitServer = request.getfixturevalue("rabbit")
        return {"QP_TEST_BROKER": rabbit.url()}
    if broker == "filesystem":
        return {"QP_TEST_BROKER": "filesystem://", "QP_TEST_FS_DIR": str(folder / "broker")}
    raise ValueError(broker)


def new_stack(
    request: pytest.FixtureRequest,
    folder: Path,
    broker: str,
    *,
    ledger: str = "postgresql",
    env: dict[str, str] | None = None,
    **worker: Any,
) -> Stack:
    settings = broker_env(request, broker, folder)
    if ledger == "postgresql":
        settings["QP_TEST_LEDGER"] = request.getfixturevalue("postgres").create_database()
    elif ledger == "pooled":
        # The ledger through PgBouncer; the handlers' own table of runs (the tests'
        # plumbing, not under test) directly.
        direct = request.getfixturevalue("postgres").create_database()
        pooler: PgBouncerServer = request.getfixturevalue("pgbouncer")
        settings["QP_TEST_LEDGER"] = pooler.url(direct)
        settings["QP_TEST_RUNS"] = direct
        settings["QP_TEST_POOLED"] = "1"
    else:
        settings["QP_TEST_LEDGER"] = f"sqlite:///{folder / 'ledger.sqlite3'}"
    settings.update(env or {})
    return build_stack(settings, folder, broker, **worker)


@pytest.fixture
def make_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StackFactory]:
    """A factory of stacks for one test: `make_stack("redis", env={...}, concurrency=1)`."""
    made: list[Stack] = []

    def make(broker: str = "redis", **kwargs: Any) -> Stack:
        stack = new_stack(request, tmp_path_factory.mktemp("stack"), broker, **kwargs)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


@pytest.fixture(scope="module", params=["redis", "rabbitmq"])
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """PostgreSQL ledger, a prefork worker (two children), on Redis and on RabbitMQ."""
    made = new_stack(request, tmp_path_factory.mktemp("stack"), request.param)
    yield made
    made.close()


@pytest.fixture(scope="module")
def pg_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """PostgreSQL ledger, Redis broker and result backend, a prefork worker."""
    made = new_stack(request, tmp_path_factory.mktemp("stack"), "redis")
    yield made
    made.close()


@pytest.fixture(scope="module")
def pooled_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """PostgreSQL ledger through PgBouncer in transaction mode (`pooled=True`), Redis, a
    prefork worker, a secret: the pooled lane (tests/integration/test_pooled.py)."""
    made = new_stack(
        request,
        tmp_path_factory.mktemp("pooled"),
        "redis",
        ledger="pooled",
        env={"QP_TEST_SECRET": POOLED_SECRET},
    )
    yield made
    made.close()


@pytest.fixture(scope="module")
def sqlite_fs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The embedded default: SQLite ledger file, filesystem broker, two prefork children."""
    made = new_stack(request, tmp_path_factory.mktemp("embedded"), "filesystem", ledger="sqlite")
    yield made
    made.close()


@pytest.fixture
def proxy(postgres: PostgresServer) -> Iterator[FaultProxy]:
    """A TCP proxy in front of the suite's PostgreSQL that can lose replies or cut every
    connection (tests/support/faultproxy.py)."""
    made = FaultProxy(postgres.port)
    yield made
    made.close()


@pytest.fixture
def via_proxy(
    make_stack: StackFactory, postgres: PostgresServer, proxy: FaultProxy
) -> StackFactory:
    """A factory of stacks whose worker and publisher reach the ledger through `proxy`,
    with a short lease (`via_proxy("redis", start_worker=False)`); the test's own
    `stack.ledger` and the `test_runs` table (in a database of its own) are reached
    directly, so only the worker's and the publisher's traffic meets the faults."""

    def make(broker: str, env: dict[str, str] | None = None, **worker: Any) -> Stack:
        direct = postgres.create_database("faults")
        settings = {
            "QP_TEST_LEDGER": proxy.url(direct, postgres.port),
            "QP_TEST_RUNS": postgres.create_database("runs"),
            **SHORT_LEASE,
            **(env or {}),
        }
        stack = make_stack(broker, env=settings, **worker)
        stack.ledger.close()
        stack.ledger = open_ledger(direct)
        return stack

    return make


@pytest.fixture
def pg_db(postgres: PostgresServer) -> str:
    """A fresh, empty PostgreSQL database of this test's own."""
    return postgres.create_database("unit")


@pytest.fixture
def pg_ledger(pg_db: str) -> Iterator[Ledger]:
    """A migrated PostgreSQL ledger of this test's own."""
    made = open_ledger(pg_db)
    made.migration.migrate()
    yield made
    made.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """A migrated, empty ledger on each dialect (no broker, no worker)."""
    url = (
        f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_db")
    )
    made = open_ledger(url)
    made.migration.migrate()
    with made.engine.begin() as conn:
        conn.execute(dispatch_table.delete())
    yield made
    made.close()
