"""The Celery app of the project, and its `Questpie`."""

import os

from celery import Celery
from django.conf import settings

from questpie_celery import Questpie

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
# Every CELERY_* setting of shop/settings.py, e.g. CELERY_BROKER_URL.
app.config_from_object("django.conf:settings", namespace="CELERY")
# Imports each installed app's tasks.py: the @jobs of orders/tasks.py register themselves.
app.autodiscover_tasks()

# No ledger_url: with "questpie_celery.contrib.django" in INSTALLED_APPS, the ledger lives
# in DATABASES["default"], on Django's own connections, and `manage.py migrate` makes it.
questpie = Questpie(app, secret=settings.QUESTPIE_SECRET)
