"""An existing Celery project: `celery -A proj worker` finds its app here, as Celery's
own layout has it."""

from .celery import app as celery_app

__all__ = ("celery_app",)
