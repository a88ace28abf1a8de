"""The ledger tables, created from `questpie_celery.ledger.schema` by the same
`Ledger.migrate()` that `questpie-celery migrate` runs: one definition, no copy of the
DDL. A later schema version is a new migration calling the same idempotent function.

Only the ledger's database (`QUESTPIE_DATABASE`, "default") gets the tables; on any
other alias the operation does nothing. Reversing it drops nothing: the ledger holds
the keys' promises, so dropping its tables stays a deliberate act of yours.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations


def create_or_upgrade_ledger(apps: Any, schema_editor: Any) -> None:
    from questpie_celery.contrib.django.binding import migrate_ledger  # noqa: PLC0415

    migrate_ledger(schema_editor.connection.alias)


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        migrations.RunPython(create_or_upgrade_ledger, migrations.RunPython.noop, elidable=False),
    ]
