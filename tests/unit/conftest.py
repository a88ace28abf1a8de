"""Fixtures of the fast lane: no servers, no worker process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from questpie_celery.ledger import Ledger, open_ledger
from tests.unit.helpers import IdleApp, sqlite_url


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IdleApp]:
    """A Questpie on a SQLite file and memory://, publishing to a queue nobody reads."""
    made = IdleApp.build(tmp_path_factory.mktemp("idle"))
    yield made
    made.close()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A migrated, empty SQLite ledger of this test's own."""
    made = open_ledger(sqlite_url(tmp_path))
    made.migration.migrate()
    yield made
    made.close()
