"""Ledger schema version 9: chords and batches (`questpie_queue_canvas`), each member's
canvas and each completed run's result. `ledger.migration.migrate()` adds them (as
`questpie-celery migrate` does)."""

from typing import Any, ClassVar

from django.db import migrations

from questpie_celery.contrib.django.binding import upgrade_ledger


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [
        ("questpie_celery", "0004_claim_generation"),
    ]

    operations: ClassVar[list[Any]] = [
        migrations.RunPython(upgrade_ledger, migrations.RunPython.noop, elidable=False),
    ]
