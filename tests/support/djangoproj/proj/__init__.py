"""A minimal Django project with questpie_celery.contrib.django installed (tests only).

Configured from the environment, so the test process, `manage.py`, the scenario
publisher and `celery -A proj worker` all build the same project:

- DJ_DB: a SQLAlchemy-style URL of the one database (postgresql+psycopg://... or
  sqlite:////path), turned into `DATABASES["default"]`
- DJ_BROKER: the Celery broker URL
- DJ_CONN_MAX_AGE: `CONN_MAX_AGE` (seconds; default 0, Django's)
- DJ_DATABASE_EXTRA, DJ_SETTINGS: JSON merged into `DATABASES["default"]`, and into the
  settings (configuration mistakes for `manage.py check`)
- DJ_DJANGO_DATABASE: passed as `Questpie(django_database=...)`
"""

from .celery import app as celery_app

__all__ = ["celery_app"]
