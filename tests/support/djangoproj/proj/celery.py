"""The usual proj/celery.py of a Django project, plus its `Questpie`."""

import os

from celery import Celery

from questpie_celery import Questpie

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# No ledger_url, no engine, no jobs listed: the ledger lives in DATABASES["default"]
# and the @jobs of shop/tasks.py are found by autodiscovery.
questpie = Questpie(
    app,
    secret=os.environ.get("DJ_SECRET", "a test secret of at least thirty-two bytes"),
    django_database=os.environ.get("DJ_DJANGO_DATABASE") or None,
)
