"""The ledger tables, created from `questpie_celery.ledger.schema` by the same
`ledger.migration.migrate()` that `questpie-celery migrate` runs: one definition, no copy of the
DDL. A later schema version is a new migration calling the same idempotent function.

Only the ledger's database (`QUESTPIE_DATABASE`, "default") gets the tables; on any
other alias the operation does nothing. Reversing it drops nothing: the ledger holds
the keys' promises, so dropping its tables stays a deliberate act of yours.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from questpie_celery.contrib.django.binding import upgrade_ledger


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(upgrade_ledger, migrations.RunPython.noop, elidable=False),
    ]
