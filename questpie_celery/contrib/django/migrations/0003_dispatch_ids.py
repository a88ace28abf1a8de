"""Ledger schema version 5: a dispatch id may be any task id a plain Celery call carries,
not only a 36-character UUID. `ledger.migration.migrate()` widens the columns (as `questpie-celery
migrate` does); the unmanaged models follow, with no DDL of Django's own."""

from typing import Any, ClassVar

from django.db import migrations, models

from questpie_celery.contrib.django.binding import upgrade_ledger


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [
        ("questpie_celery", "0002_admin_models"),
    ]

    operations: ClassVar[list[Any]] = [
        migrations.RunPython(upgrade_ledger, migrations.RunPython.noop, elidable=False),
        migrations.AlterField(
            model_name="dispatch",
            name="id",
            field=models.TextField(primary_key=True, serialize=False, verbose_name="dispatch id"),
        ),
        migrations.AlterField(
            model_name="schedule",
            name="last_dispatch_id",
            field=models.TextField(null=True, verbose_name="last dispatch"),
        ),
    ]
