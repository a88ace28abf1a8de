"""`questpie_celery.testing` with `questpie_postgres_url`: the documented example project run
with each test's ledger a fresh database on a real PostgreSQL server, dropped after."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.support.services import PostgresServer

EXAMPLE = Path(__file__).parents[2] / "examples" / "testing"

pytestmark = pytest.mark.timeout(120)


def _test_databases(postgres: PostgresServer) -> list[str]:
    engine = create_engine(postgres.url())
    with engine.connect() as conn:
        names = conn.execute(
            text("SELECT datname FROM pg_database WHERE datname LIKE 'questpie_test_%'")
        ).scalars()
        found = list(names)
    engine.dispose()
    return found


def test_each_test_gets_a_database_of_its_own(
    pytester: pytest.Pytester, postgres: PostgresServer
) -> None:
    for name in ("pytest.ini", "signup.py", "test_signup.py"):
        (pytester.path / name).write_text((EXAMPLE / name).read_text())
    pytester.makepyfile(
        test_where="""
        def test_the_ledger_is_a_postgresql_database(questpie_ledger):
            url = questpie_ledger.ledger_url
            assert url.startswith("postgresql+psycopg://")
            assert "/questpie_test_" in url
            assert "questpie_test_" in questpie_ledger.questpie.operator.ledger_label
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-o", f"questpie_postgres_url={postgres.url()}"
    )
    result.assert_outcomes(passed=6)
    assert _test_databases(postgres) == []
