"""The `questpie-celery` command line."""

from __future__ import annotations

import importlib
import sys

import click

from .app import Questpie
from .errors import QuestpieError
from .ledger import Ledger, create_ledger_engine


def load_questpie(spec: str) -> Questpie:
    """Import `module:attribute` (default attribute `questpie`) and return it."""
    module_name, _, attribute = spec.partition(":")
    sys.path.insert(0, "")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute or "questpie", None)
    if not isinstance(value, Questpie):
        raise click.BadParameter(f"{spec!r} is not a Questpie instance", param_hint="--app")
    return value


def _ledger(app: str | None, ledger_url: str | None) -> Ledger:
    if (app is None) == (ledger_url is None):
        raise click.UsageError("pass exactly one of --app and --ledger-url")
    if app is not None:
        return load_questpie(app).ledger
    return Ledger(create_ledger_engine(str(ledger_url)))


@click.group()
def main() -> None:
    """Operate the questpie dispatch ledger of a Celery project."""


@main.command()
@click.option("-A", "--app", help="module:attribute of your Questpie instance")
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
def migrate(app: str | None, ledger_url: str | None) -> None:
    """Create or upgrade the ledger schema (safe to run again)."""
    try:
        version = _ledger(app, ledger_url).migrate()
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ledger schema at version {version}")
