"""The Django app: `INSTALLED_APPS = [..., "questpie_celery.contrib.django"]`."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks

from .binding import DATABASE_SETTING, POOLED_SETTING, ledger_database, pooled_setting


class QuestpieConfig(AppConfig):
    name = "questpie_celery.contrib.django"
    label = "questpie_celery"
    verbose_name = "questpie"
    default = True

    def ready(self) -> None:
        checks.register(check_ledger_database, checks.Tags.database)


def check_ledger_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """`manage.py check`: the ledger's alias names a PostgreSQL or SQLite database, and
    with `QUESTPIE_POOLED`, Django's connections to it prepare no statements."""
    from django.db import connections  # noqa: PLC0415

    try:
        alias = ledger_database()
    except Exception as exc:
        return [checks.Error(str(exc), id="questpie_celery.E001")]
    try:
        pooled = pooled_setting()
    except Exception as exc:
        return [checks.Error(str(exc), id="questpie_celery.E004")]
    if alias not in connections:
        return [
            checks.Error(
                f"{DATABASE_SETTING} is {alias!r}, which DATABASES does not define",
                id="questpie_celery.E002",
            )
        ]
    vendor = connections[alias].vendor
    if vendor not in ("postgresql", "sqlite"):
        return [
            checks.Error(
                f"the questpie ledger runs on PostgreSQL or SQLite; DATABASES[{alias!r}] "
                f"is {vendor}",
                id="questpie_celery.E003",
            )
        ]
    options = connections[alias].settings_dict.get("OPTIONS") or {}
    if pooled and vendor == "postgresql" and options.get("prepare_threshold") is not None:
        # Django's default is None; a number makes psycopg prepare statements on the
        # server, which a pooler in transaction mode loses or mixes up between clients
        # (the ledger's statements run on these connections too).
        return [
            checks.Error(
                f"{POOLED_SETTING} is True, but DATABASES[{alias!r}]['OPTIONS'] sets "
                f"prepare_threshold to {options['prepare_threshold']!r}: behind a pooler in "
                "transaction mode, leave it out (Django's default, None)",
                id="questpie_celery.E005",
            )
        ]
    return []
