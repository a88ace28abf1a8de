"""A Django site with questpie_celery's read-only admin, for its tests and its bench.

Django's settings are configured once per process; `use_database(url)` then points
Django's `default` connection at a ledger database (SQLite or PostgreSQL) and creates
Django's own tables there (users, sessions, the admin's log), as a project's
`manage.py migrate` would. The ledger's tables come from the package's own
`ledger.migration.migrate()`, never from Django.
"""

from __future__ import annotations

import contextlib
from typing import Any

import django
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections
from sqlalchemy.engine import make_url

APP = "questpie_celery.contrib.django"


def configure() -> None:
    """Django settings for a minimal admin site (once per process)."""
    if not settings.configured:
        settings.configure(
            DEBUG=False,
            SECRET_KEY="questpie-celery-tests",
            USE_TZ=True,
            TIME_ZONE="UTC",
            ALLOWED_HOSTS=["testserver", "localhost"],
            INSTALLED_APPS=[
                "django.contrib.admin",
                "django.contrib.auth",
                "django.contrib.contenttypes",
                "django.contrib.sessions",
                "django.contrib.messages",
                APP,
            ],
            MIDDLEWARE=[
                "django.contrib.sessions.middleware.SessionMiddleware",
                "django.middleware.common.CommonMiddleware",
                "django.middleware.csrf.CsrfViewMiddleware",
                "django.contrib.auth.middleware.AuthenticationMiddleware",
                "django.contrib.messages.middleware.MessageMiddleware",
            ],
            ROOT_URLCONF="tests.support.django_urls",
            TEMPLATES=[
                {
                    "BACKEND": "django.template.backends.django.DjangoTemplates",
                    "APP_DIRS": True,
                    "OPTIONS": {
                        "context_processors": [
                            "django.template.context_processors.request",
                            "django.contrib.auth.context_processors.auth",
                            "django.contrib.messages.context_processors.messages",
                        ]
                    },
                }
            ],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
            DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        )
    django.setup()
    if APP not in settings.INSTALLED_APPS:  # configured by someone else, without the admin
        raise RuntimeError(f"Django is configured without {APP}")


def database_settings(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a SQLAlchemy URL of the ledger."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parsed.database}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
    }


def use_database(url: str) -> None:
    """Point Django's default connection at `url`'s database and create Django's own
    tables in it."""
    configure()
    connections.close_all()
    connections.settings["default"] = connections.configure_settings(
        {"default": database_settings(url)}
    )["default"]
    with contextlib.suppress(AttributeError):  # no connection made yet
        del connections["default"]
    call_command("migrate", run_syncdb=True, verbosity=0, interactive=False)


def superuser(name: str = "admin", password: str = "pw") -> Any:
    user_model = get_user_model()
    found = user_model.objects.filter(username=name).first()
    return found or user_model.objects.create_superuser(name, f"{name}@example.com", password)


def admin_url(model_name: str) -> str:
    """The URL of a model's list in the admin (its app label is the app config's)."""
    from django.apps import apps  # noqa: PLC0415  (the registry, once configured)

    configure()
    config = next(config for config in apps.get_app_configs() if config.name == APP)
    model = config.get_model(model_name)
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
