"""The fixtures of `questpie_celery.testing` (loaded only once a project enables them).

The project says which `Questpie` is its own: `questpie_app = proj.celery:questpie` in its
pytest configuration, or a `questpie_app` fixture of its own. Each test that asks for
one of the fixtures below then gets that same object, the one the project's code
publishes through, pointed at a throwaway ledger for the test's duration.

- `questpie_ledger`: a fresh, migrated ledger (a SQLite file, or a new PostgreSQL
  database when `questpie_postgres_url` is set) and the app on the
  `questpie_celery_config` settings (Celery's in-memory broker by default). Publishes
  write their rows and their messages wait in the broker: nothing runs.
- `questpie_eager`: the same with `task_always_eager` on and `task_eager_propagates` off:
  `publish()` runs the handler inline through the fence and the ledger; a failed attempt
  is recorded there (read it with `dispatches()`), not raised into the test.
- `questpie_worker`: the same with a `celery worker` (solo pool; `questpie_worker_parameters`)
  and its relay running in threads of the test's process until the test ends.

Each gives a `Harness`: `.questpie`, `.dispatches(job)`, `.dispatch(id)`, `.wait_for(id)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ..app import Questpie
from .celery_app import DEFAULT_CELERY_CONFIG, celery_settings, in_process_worker
from .harness import Harness
from .ledgers import postgres_server_url, rebound, sqlite_ledger_url, throwaway_postgres

#: What `questpie_eager` turns on for its test.
EAGER_SETTINGS: Mapping[str, Any] = {"task_always_eager": True, "task_eager_propagates": False}


@pytest.fixture
def questpie_app(request: pytest.FixtureRequest) -> Questpie:
    """The project's `Questpie`, named by the ini option `questpie_app`
    (`module:attribute`). Override this fixture to hand it over some other way."""
    spec = str(request.config.getini("questpie_app")).strip()
    if not spec:
        pytest.fail(
            "questpie_celery.testing does not know the project's Questpie: set "
            "`questpie_app = proj.celery:questpie` in the pytest configuration, or define "
            "a `questpie_app` fixture that returns it",
            pytrace=False,
        )
    module_name, _, attribute = spec.partition(":")
    found: object = importlib.import_module(module_name)
    for part in attribute.split(".") if attribute else ():
        found = getattr(found, part)
    if not isinstance(found, Questpie):
        pytest.fail(f"questpie_app = {spec} is not a Questpie", pytrace=False)
    return found


@pytest.fixture
def questpie_celery_config() -> Mapping[str, Any]:
    """Celery settings the app has for each test (restored after it); override to run on
    the project's own broker (return `{}`) or to add settings."""
    return DEFAULT_CELERY_CONFIG


@pytest.fixture
def questpie_ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The throwaway ledger's URL: a SQLite file in the test's `tmp_path`, or a new
    database on the PostgreSQL server of `questpie_postgres_url` (ini option, else the
    `QUESTPIE_TEST_POSTGRES_URL` variable), dropped after the test."""
    server = postgres_server_url(str(request.config.getini("questpie_postgres_url")))
    if server is None:
        yield sqlite_ledger_url(tmp_path)
        return
    with throwaway_postgres(server) as url:
        yield url


@pytest.fixture
def questpie_ledger(
    questpie_app: Questpie,
    questpie_ledger_url: str,
    questpie_celery_config: Mapping[str, Any],
) -> Iterator[Harness]:
    """The project's Questpie on a fresh, migrated ledger for this test."""
    with (
        celery_settings(questpie_app.celery_app, questpie_celery_config),
        rebound(questpie_app, questpie_ledger_url),
    ):
        harness = Harness(questpie_app, questpie_ledger_url)
        try:
            yield harness
        finally:
            harness.close()


@pytest.fixture
def questpie_eager(questpie_ledger: Harness) -> Iterator[Harness]:
    """`questpie_ledger` in eager mode: `publish()` runs the handler inline."""
    with celery_settings(questpie_ledger.questpie.celery_app, EAGER_SETTINGS):
        yield questpie_ledger


@pytest.fixture
def questpie_worker_parameters() -> Mapping[str, Any]:
    """Keyword arguments for Celery's `start_worker` (pool, concurrency, ...)."""
    return {}


@pytest.fixture
def questpie_worker(
    questpie_ledger: Harness, questpie_worker_parameters: Mapping[str, Any]
) -> Iterator[Harness]:
    """`questpie_ledger` with a worker and its relay running in this process."""
    app = questpie_ledger.questpie.celery_app
    with in_process_worker(app, **questpie_worker_parameters) as worker:
        questpie_ledger.worker = worker
        try:
            yield questpie_ledger
        finally:
            questpie_ledger.worker = None
