"""Settings of the example shop.

Everything that differs between a laptop, CI and production comes from the environment:

- DATABASE_URL: `postgres://user:password@host:5432/name`, or unset for SQLite
  (`db.sqlite3` next to manage.py)
- CELERY_BROKER_URL: `redis://localhost:6379/0` unless set; `filesystem://` keeps the
  messages in files under `broker/` (one machine, development only)
- DJANGO_SECRET_KEY, QUESTPIE_SECRET, DJANGO_DEBUG, EMAIL_FILE_PATH
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-only-for-the-example")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # The ledger's tables (manage.py migrate), and its read-only pages in the admin.
    "questpie_celery.contrib.django",
    "orders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "shop.urls"
WSGI_APPLICATION = "shop.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def database(url: str | None) -> dict[str, object]:
    """`DATABASES["default"]` from a `postgres://` URL; SQLite when there is none."""
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "db.sqlite3",
            # A worker and the web process write the same file: WAL, a busy timeout,
            # and atomic blocks that take the write lock up front.
            "OPTIONS": {
                "timeout": 15,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL",
            },
        }
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL: expected postgres://..., got {parts.scheme}://")
    return {
        "ENGINE": "django.db.backends.postgresql",  # psycopg 3
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        # CONN_MAX_AGE is left at 0, Django's default; a positive value is fine in
        # production, but not under pytest-django (docs/django.md, "Testing").
    }


DATABASES = {"default": database(os.environ.get("DATABASE_URL"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"

# The magic links "sent" by orders.tasks.send_login_link land as files in this folder.
EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH", str(BASE_DIR / "sent-mail"))
DEFAULT_FROM_EMAIL = "shop@example.com"

# --- Celery: read by shop/celery.py (`namespace="CELERY"`) -------------------------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
if CELERY_BROKER_URL == "filesystem://":
    _broker = BASE_DIR / "broker"
    (_broker / "control").mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker),
        "data_folder_out": str(_broker),
        "control_folder": str(_broker / "control"),
        "store_processed": False,
    }

# --- questpie_celery ---------------------------------------------------------------------
# Encrypts secret payloads (the login links): 32 bytes or more, kept out of the code in
# production, the same in the web processes and the workers.
QUESTPIE_SECRET = os.environ.get(
    "QUESTPIE_SECRET", "insecure example secret: set QUESTPIE_SECRET in production"
)
# QUESTPIE_DATABASE = "default"  # the DATABASES alias of the ledger ("default" if unset)
