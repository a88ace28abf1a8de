"""The Django project's ledger as `Questpie` finds it: `Questpie(django_database=alias)`,
or no ledger named at all in a project that installs this app.

Imported by `questpie_celery.config.settings` only when a Django ledger is asked for or may be
implied; Django itself only once a project has imported it or named its settings.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from sqlalchemy import Engine


@dataclass(frozen=True)
class DjangoLedger:
    """The ledger in `DATABASES[alias]`, on the connections Django holds."""

    alias: str

    def relaxed_refusal(self) -> str | None:
        return (
            "durability='relaxed' sets how the ledger's own connections commit, so it "
            "needs ledger_url=; on Django's connections, set synchronous_commit in "
            "DATABASES' OPTIONS"
        )

    def open(self, *, relaxed: bool, pooled: bool) -> tuple[Engine, bool]:
        # Imported only here: Django is an optional extra.
        from .binding import django_ledger_engine  # noqa: PLC0415
        from .settings import pooled_setting  # noqa: PLC0415

        return django_ledger_engine(self.alias), pooled or pooled_setting()


def installed() -> DjangoLedger | None:
    """The ledger of this Django project when it installs `questpie_celery.contrib.django`;
    None otherwise. Django is not imported by a project that has not imported it or named
    its settings."""
    if "django" not in sys.modules and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return None
    from .settings import installed_database  # noqa: PLC0415

    alias = installed_database()
    return DjangoLedger(alias) if alias is not None else None
