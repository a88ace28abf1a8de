"""`questpie_celery.testing`: a pytest plugin for projects that use questpie_celery.

This module is what the `pytest11` entry point loads, in every pytest run of every
environment the package is installed in. So it imports nothing heavy and, until a project
enables it, only declares its ini options: no fixture exists and no hook has an effect.

A project enables it in one of two ways:

- `questpie_celery = true` in its pytest configuration (`pytest.ini`, or
  `[tool.pytest.ini_options]` in `pyproject.toml`);
- or by naming the fixtures module, `pytest_plugins = ["questpie_celery.testing.fixtures"]`
  in its top-level `conftest.py` (or `-p questpie_celery.testing.fixtures`).

The fixtures are in `fixtures.py`; `Harness` and `Dispatch`, what they give a test, are
importable from here for type annotations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

    from ..ops.receipts import Dispatch
    from .harness import Harness

FIXTURES = "questpie_celery.testing.fixtures"

__all__ = ["FIXTURES", "Dispatch", "Harness"]


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


def __getattr__(name: str) -> object:
    if name == "Dispatch":
        return importlib.import_module("..ops.receipts", __name__).Dispatch
    if name == "Harness":
        return importlib.import_module(".harness", __name__).Harness
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
