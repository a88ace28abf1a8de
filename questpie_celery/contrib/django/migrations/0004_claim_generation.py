"""Ledger schema version 8: each dispatch counts its claims (the handler's fencing
token). `ledger.migration.migrate()` adds the column (as `questpie-celery migrate` does), and with
it whatever an earlier schema version added since this project last migrated."""

from typing import Any, ClassVar

from django.db import migrations

from questpie_celery.contrib.django.binding import upgrade_ledger


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [
        ("questpie_celery", "0003_dispatch_ids"),
    ]

    operations: ClassVar[list[Any]] = [
        migrations.RunPython(upgrade_ledger, migrations.RunPython.noop, elidable=False),
    ]
