"""The `questpie-celery` command line."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Protocol

import click

from .app import Questpie
from .errors import QuestpieError
from .ledger import open_ledger
from .policies import QueuePolicy


def load_questpie(spec: str) -> Questpie:
    """Import `module:attribute` (default attribute `questpie`) and return it."""
    module_name, _, attribute = spec.partition(":")
    sys.path.insert(0, "")
    module = importlib.import_module(module_name)
    value = getattr(module, attribute or "questpie", None)
    if not isinstance(value, Questpie):
        raise click.BadParameter(f"{spec!r} is not a Questpie instance", param_hint="--app")
    return value


class _Admin(Protocol):
    """What the ledger commands need; a `Questpie` and a bare `Ledger` both offer it."""

    def migrate(self) -> int: ...
    def set_policy(self, job_name: str, policy: QueuePolicy, /) -> None: ...
    def get_policy(self, job_name: str, /) -> QueuePolicy | None: ...
    def close(self) -> None: ...


def _admin(app: str | None, ledger_url: str | None) -> _Admin:
    if (app is None) == (ledger_url is None):
        raise click.UsageError("pass exactly one of --app and --ledger-url")
    admin: _Admin = load_questpie(app) if app is not None else open_ledger(str(ledger_url))
    # Close the pool when the command ends, not at interpreter exit.
    click.get_current_context().call_on_close(admin.close)
    return admin


@click.group()
def main() -> None:
    """Operate the questpie dispatch ledger of a Celery project."""


@main.command()
@click.option("-A", "--app", help="module:attribute of your Questpie instance")
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
def migrate(app: str | None, ledger_url: str | None) -> None:
    """Create or upgrade the ledger schema (safe to run again)."""
    try:
        version = _admin(app, ledger_url).migrate()
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"ledger schema at version {version}")


@main.group()
def policy() -> None:
    """Show or change the queue policy recorded for a job."""


@policy.command("set")
@click.argument("job_name")
@click.argument("policy_name", metavar="POLICY", type=click.Choice([str(p) for p in QueuePolicy]))
@click.option("-A", "--app", help="module:attribute of your Questpie instance")
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
def policy_set(job_name: str, policy_name: str, app: str | None, ledger_url: str | None) -> None:
    """Record POLICY for JOB_NAME; dispatches accepted from now on follow it."""
    try:
        _admin(app, ledger_url).set_policy(job_name, QueuePolicy(policy_name))
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{job_name}: {policy_name}")


@policy.command("show")
@click.argument("job_name")
@click.option("-A", "--app", help="module:attribute of your Questpie instance")
@click.option("--ledger-url", envvar="QUESTPIE_LEDGER_URL", help="SQLAlchemy URL of the ledger")
def policy_show(job_name: str, app: str | None, ledger_url: str | None) -> None:
    """Print the policy recorded for JOB_NAME (standard when none is)."""
    try:
        recorded = _admin(app, ledger_url).get_policy(job_name)
    except QuestpieError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"{job_name}: {recorded or 'standard (none recorded)'}")


@main.command()
@click.option("-A", "--app", required=True, help="module:attribute of your Questpie instance")
@click.option("--once", is_flag=True, help="make one pass and exit")
def relay(app: str, once: bool) -> None:
    """Run the relay in the foreground (workers also run it in the background)."""
    questpie = load_questpie(app)
    if once:
        click.echo(f"moved {questpie.run_relay(once=True)} dispatch(es)")
        return
    stop = threading.Event()
    click.echo(f"relay running every {questpie.relay_interval}s; Ctrl-C stops it")
    try:
        questpie.run_relay(stop=stop)
    except KeyboardInterrupt:
        stop.set()
