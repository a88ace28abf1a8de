"""The Django settings the ledger reads, and what `manage.py check` finds wrong in them.

Read only: nothing here opens a connection, so a project whose `Questpie` is built at
import with a mistake in its settings still starts, and the check can report it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigurationError

#: The app's name in INSTALLED_APPS.
APP_NAME = "questpie_celery.contrib.django"
#: The setting naming the DATABASES alias the ledger lives in.
DATABASE_SETTING = "QUESTPIE_DATABASE"
DEFAULT_DATABASE = "default"
#: The setting saying that database is reached through a pooler in transaction mode.
POOLED_SETTING = "QUESTPIE_POOLED"
#: What creates the ledger's tables in a Django project.
MIGRATE_COMMAND = "python manage.py migrate"


def installed_database() -> str | None:
    """The alias of the ledger's database when this Django project installs the app
    (`QUESTPIE_DATABASE`, `"default"` unless set); None when it does not, or when
    Django or its settings are missing. Never raises for a setting that is wrong: that
    is `manage.py check`'s to report (see `problems`), and building a `Questpie` at
    import must not keep the check from running."""
    try:
        from django.conf import settings  # noqa: PLC0415
        from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415
    except ImportError:
        return None
    try:
        apps = list(settings.INSTALLED_APPS)
    except (ImproperlyConfigured, ImportError):
        return None  # no settings, or a DJANGO_SETTINGS_MODULE that does not import
    if not any(app == APP_NAME or app.startswith(APP_NAME + ".") for app in apps):
        return None
    alias = getattr(settings, DATABASE_SETTING, DEFAULT_DATABASE)
    return alias if isinstance(alias, str) else repr(alias)  # no such alias: refused below


def ledger_database() -> str:
    """`settings.QUESTPIE_DATABASE`, or `"default"`."""
    from django.conf import settings  # noqa: PLC0415

    alias = getattr(settings, DATABASE_SETTING, DEFAULT_DATABASE)
    if not isinstance(alias, str):
        raise ConfigurationError(f"{DATABASE_SETTING} must be an alias of DATABASES (a str)")
    return alias


def pooled_setting() -> bool:
    """`settings.QUESTPIE_POOLED`, or False: the ledger's database is reached through a
    pooler in transaction mode, so its relays poll instead of holding a LISTEN (Django's
    own connections must be pooler-safe too: see the system check)."""
    from django.conf import settings  # noqa: PLC0415

    # Anything but True is not pooled; `manage.py check` reports a value that is not a
    # bool (see `problems`), rather than an import of the project failing on it.
    return getattr(settings, POOLED_SETTING, False) is True


@dataclass(frozen=True)
class Problem:
    """A configuration mistake `manage.py check` reports, with its fix."""

    id: int  # questpie_celery.E0nn or W0nn
    message: str
    hint: str
    error: bool = True  # else a warning: the ledger works, not as well as it should


def problems(alias: str) -> list[Problem]:
    """What keeps `DATABASES[alias]` from holding the ledger (errors), or from holding it
    well (warnings). Reads settings only: no connection is opened."""
    from django.db import connections  # noqa: PLC0415

    known = sorted(connections.settings)
    if alias not in connections.settings:
        return [
            Problem(
                2,
                f"the questpie ledger's database {alias!r} is not in DATABASES",
                f"add DATABASES[{alias!r}], or set {DATABASE_SETTING} (and any "
                f"Questpie(django_database=...)) to one of: {', '.join(known)}",
            )
        ]
    try:
        wrapper = connections[alias]  # imports the backend; opens no connection
        vendor = wrapper.vendor
    except Exception as exc:  # a backend that does not import: Django says why
        return [Problem(3, f"DATABASES[{alias!r}] cannot be loaded: {exc}", "fix its ENGINE")]
    if vendor not in ("postgresql", "sqlite"):
        return [
            Problem(
                3,
                f"the questpie ledger runs on PostgreSQL or SQLite; DATABASES[{alias!r}] is "
                f"{vendor}",
                f"point {DATABASE_SETTING} at a django.db.backends.postgresql or "
                "django.db.backends.sqlite3 database",
            )
        ]
    found: list[Problem] = []
    if vendor == "postgresql":
        from django.db.backends.postgresql.psycopg_any import is_psycopg3  # noqa: PLC0415

        if not is_psycopg3:
            found.append(
                Problem(
                    4,
                    f"DATABASES[{alias!r}] runs on psycopg2; the questpie ledger needs psycopg 3",
                    "pip install 'psycopg[binary]' (Django then uses psycopg 3)",
                )
            )
    if wrapper.settings_dict.get("AUTOCOMMIT") is False:
        found.append(
            Problem(
                5,
                f"DATABASES[{alias!r}] turns AUTOCOMMIT off; the questpie ledger needs "
                "Django's default (autocommit outside atomic blocks)",
                f"remove AUTOCOMMIT from DATABASES[{alias!r}] (or keep the ledger in "
                "another alias)",
            )
        )
    found += _pooled_problems(alias, vendor, wrapper.settings_dict)
    if vendor == "sqlite" and not _sqlite_shared_safely(wrapper.settings_dict):
        found.append(
            Problem(
                1,
                f"DATABASES[{alias!r}] is SQLite without the options that let a worker "
                "and a web process write it at once: expect 'database is locked'",
                'set "OPTIONS": {"timeout": 15, "transaction_mode": "IMMEDIATE", '
                '"init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL"}',
                error=False,
            )
        )
    return found


def _pooled_problems(alias: str, vendor: str, settings_dict: Any) -> list[Problem]:
    """`QUESTPIE_POOLED` is a bool, and with it Django's connections to the ledger's
    database prepare no statements on the server."""
    from django.conf import settings  # noqa: PLC0415

    pooled = getattr(settings, POOLED_SETTING, False)
    if not isinstance(pooled, bool):
        return [
            Problem(
                7,
                f"{POOLED_SETTING} must be True or False, not {type(pooled).__name__}",
                f"{POOLED_SETTING} = True behind a pooler in transaction mode, else leave it out",
            )
        ]
    threshold = (settings_dict.get("OPTIONS") or {}).get("prepare_threshold")
    if pooled and vendor == "postgresql" and threshold is not None:
        # Django's default is None; a number makes psycopg prepare statements on the
        # server, which a pooler in transaction mode loses or mixes up between clients
        # (the ledger's statements run on these connections too).
        return [
            Problem(
                8,
                f"{POOLED_SETTING} is True, but DATABASES[{alias!r}]['OPTIONS'] sets "
                f"prepare_threshold to {threshold!r}: behind a pooler in transaction mode "
                "psycopg's prepared statements are lost or mixed up between clients",
                f"remove prepare_threshold from DATABASES[{alias!r}]['OPTIONS'] (Django's "
                "default, None)",
            )
        ]
    return []


def _sqlite_shared_safely(settings_dict: Any) -> bool:
    """The SQLite options docs/django.md asks for: a busy timeout, write locks taken up
    front, and WAL (an in-memory database is one process's own and needs none)."""
    options = settings_dict.get("OPTIONS") or {}
    name = str(settings_dict.get("NAME") or "")
    if name in ("", ":memory:") or name.startswith("file::memory:") or "mode=memory" in name:
        return True
    return (
        float(options.get("timeout") or 0) >= 1
        and str(options.get("transaction_mode", "")).upper() == "IMMEDIATE"
        and "journal_mode=wal" in str(options.get("init_command", "")).lower().replace(" ", "")
    )
