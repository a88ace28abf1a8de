"""The `pytest11` entry point of questpie_celery's pytest plugin (`questpie_celery.testing`).

pytest loads this module in every run of every environment the package is installed in,
so it lives outside the `questpie_celery` package: importing it imports neither the
package nor Celery, SQLAlchemy or pydantic. Until a project enables the plugin it only
declares its ini options: no fixture exists and no hook has an effect.

A project enables it in one of two ways:

- `questpie_celery = true` in its pytest configuration (`pytest.ini`, or
  `[tool.pytest.ini_options]` in `pyproject.toml`);
- or by naming the fixtures module, `pytest_plugins = ["questpie_celery.testing.fixtures"]`
  in its top-level `conftest.py` (or `-p questpie_celery.testing.fixtures`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

#: The module whose fixtures the plugin turns on.
FIXTURES = "questpie_celery.testing.fixtures"


def pytest_addoption(parser: pytest.Parser) -> None:
    # Declared even while the plugin is off, so that a project's ini naming them is not
    # warned about as unknown before it turns the plugin on.
    parser.addini(
        "questpie_celery",
        "questpie_celery.testing: turn the fixtures on (questpie_ledger, questpie_eager, "
        "questpie_worker)",
        type="bool",
        default=False,
    )
    parser.addini(
        "questpie_app",
        "questpie_celery.testing: the project's Questpie, as module:attribute",
        default="",
    )
    parser.addini(
        "questpie_postgres_url",
        "questpie_celery.testing: a PostgreSQL server URL; each test's ledger is then a "
        "fresh database on it (default: a SQLite file). QUESTPIE_TEST_POSTGRES_URL if unset",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getini("questpie_celery") and not config.pluginmanager.has_plugin(FIXTURES):
        config.pluginmanager.import_plugin(FIXTURES)
