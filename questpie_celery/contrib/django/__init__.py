"""questpie_celery in a Django project (`pip install 'questpie-celery[django]'`).

Add `"questpie_celery.contrib.django"` to `INSTALLED_APPS`, and `Questpie(celery_app)`
keeps its ledger in `DATABASES["default"]` (or `QUESTPIE_DATABASE`), on the connections
Django holds; `manage.py migrate` creates its tables; `publish()` inside
`transaction.atomic()` writes the row in that transaction and sends it after the
outermost commit. See docs/django.md.

Nothing here imports Django at import time but `apps.py` and the migrations, which
only Django loads.
"""
