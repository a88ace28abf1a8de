# Load the Celery app (and its Questpie) whenever Django starts, so that `publish()` and
# `@job`s use it: the usual Django + Celery layout.
from .celery import app as celery_app

__all__ = ["celery_app"]
