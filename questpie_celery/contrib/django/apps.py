"""The Django app: `INSTALLED_APPS = [..., "questpie_celery.contrib.django"]`."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks

from .binding import engine_aliases
from .settings import DATABASE_SETTING, DEFAULT_DATABASE, problems


class QuestpieConfig(AppConfig):
    name = "questpie_celery.contrib.django"
    label = "questpie_celery"
    verbose_name = "questpie"
    default = True

    def ready(self) -> None:
        # Not tagged `database`: these read settings only, so a plain `manage.py check`
        # (and every command that runs the checks, `migrate` among them) reports them.
        checks.register(check_ledger_database)


def check_ledger_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """`manage.py check`: every mistake in the ledger's Django configuration, with its fix.

    The ledger's alias (`QUESTPIE_DATABASE`) must be a str naming a PostgreSQL (psycopg 3)
    or SQLite entry of `DATABASES` in autocommit; SQLite wants the options that let
    several processes write it; a `Questpie(django_database=...)` must agree with the
    setting (the migration reads the setting); the admin's pages must read the ledger's
    database."""
    from django.conf import settings  # noqa: PLC0415

    alias = getattr(settings, DATABASE_SETTING, DEFAULT_DATABASE)
    if not isinstance(alias, str):
        return [
            checks.Error(
                f"{DATABASE_SETTING} must name an alias of DATABASES (a str), not "
                f"{type(alias).__name__}",
                hint=f'{DATABASE_SETTING} = "default", or leave it out',
                id="questpie_celery.E001",
            )
        ]
    found = [_message(problem) for problem in problems(alias)]
    for other in sorted(engine_aliases() - {alias}):
        found.append(
            checks.Error(
                f"a Questpie keeps its ledger in DATABASES[{other!r}] (django_database=), "
                f"but {DATABASE_SETTING} is {alias!r}: `manage.py migrate` creates the "
                f"ledger's tables in {alias!r}",
                hint=f"set {DATABASE_SETTING} = {other!r}",
                id="questpie_celery.E006",
            )
        )
        found += [_message(problem) for problem in problems(other)]
    return found + _admin_reads_elsewhere(alias)


def _message(problem: Any) -> checks.CheckMessage:
    kind = checks.Error if problem.error else checks.Warning
    letter = "E" if problem.error else "W"
    return kind(problem.message, hint=problem.hint, id=f"questpie_celery.{letter}{problem.id:03}")


def _admin_reads_elsewhere(alias: str) -> list[checks.CheckMessage]:
    """The admin's pages read the app's models through Django's router: from the
    ledger's database, or they show another database's (empty) tables."""
    from django.apps import apps  # noqa: PLC0415
    from django.db import router  # noqa: PLC0415

    if not apps.is_installed("django.contrib.admin"):
        return []
    model = apps.get_model("questpie_celery", "Dispatch")
    reads = router.db_for_read(model) or DEFAULT_DATABASE
    if reads == alias:
        return []
    return [
        checks.Warning(
            f"the admin's questpie pages read DATABASES[{reads!r}], but the ledger is in "
            f"{alias!r}: they would show no dispatches",
            hint=f"route the questpie_celery app's models to {alias!r} in a database router",
            id="questpie_celery.W002",
        )
    ]
