"""Settings of the test project: the database and broker come from the environment."""

from __future__ import annotations

import json
import os

from sqlalchemy.engine import make_url

SECRET_KEY = "django-insecure-questpie-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "Europe/Bratislava"  # not UTC: the ledger's times must not depend on it
INSTALLED_APPS = ["questpie_celery.contrib.django", "shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_url = make_url(os.environ["DJ_DB"])
_max_age = int(os.environ.get("DJ_CONN_MAX_AGE", "0"))
if _url.get_backend_name() == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _url.database,
            "CONN_MAX_AGE": _max_age,
            # Several processes write the file: WAL, a generous busy timeout, and atomic
            # blocks that take the write lock up front (docs/django.md).
            "OPTIONS": {
                "timeout": 15,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL",
            },
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": _url.database,
            "USER": _url.username or "",
            "HOST": _url.host or "",
            "PORT": str(_url.port or ""),
            "CONN_MAX_AGE": _max_age,
        }
    }
    if os.environ.get("DJ_PREPARE_THRESHOLD"):  # a project that turned prepares back on
        DATABASES["default"]["OPTIONS"] = {
            "prepare_threshold": int(os.environ["DJ_PREPARE_THRESHOLD"])
        }
# DJ_DB goes through PgBouncer in transaction mode.
QUESTPIE_POOLED = bool(os.environ.get("DJ_POOLED"))

CELERY_BROKER_URL = os.environ["DJ_BROKER"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

QUESTPIE_SECRET = "a test secret of at least thirty-two bytes"

# The configuration mistakes `manage.py check` must report, made by the tests: JSON
# merged into DATABASES["default"], then into these settings.
DATABASES["default"].update(json.loads(os.environ.get("DJ_DATABASE_EXTRA", "{}")))
globals().update(json.loads(os.environ.get("DJ_SETTINGS", "{}")))
