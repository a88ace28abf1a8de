"""The admin's models: unmanaged views of the ledger's tables (no DDL: 0001 made them)."""

from typing import Any, ClassVar

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies: ClassVar[list[tuple[str, str]]] = [
        ("questpie_celery", "0001_ledger"),
    ]

    operations: ClassVar[list[Any]] = [
        migrations.CreateModel(
            name="Dispatch",
            fields=[
                (
                    "id",
                    models.CharField(
                        max_length=36, primary_key=True, serialize=False, verbose_name="dispatch id"
                    ),
                ),
                ("job_name", models.CharField(max_length=200, verbose_name="job")),
                ("idempotency_key", models.TextField(null=True, verbose_name="key")),
                ("singleton_key", models.TextField(null=True)),
                ("status", models.CharField(max_length=16)),
                ("policy", models.CharField(max_length=16, null=True)),
                ("slot", models.TextField(null=True)),
                ("secret", models.BooleanField()),
                (
                    "secret_key_id",
                    models.CharField(max_length=64, null=True, verbose_name="secret key id"),
                ),
                ("attempt", models.IntegerField(verbose_name="attempts")),
                ("send_count", models.IntegerField(verbose_name="sends of this attempt")),
                ("last_error", models.CharField(max_length=200, null=True)),
                ("run_after", models.DateTimeField()),
                ("next_send_at", models.DateTimeField(null=True)),
                ("lease_expires_at", models.DateTimeField(null=True)),
                ("created_at", models.DateTimeField(verbose_name="created")),
                ("queued_at", models.DateTimeField(null=True, verbose_name="queued")),
                ("started_at", models.DateTimeField(null=True, verbose_name="started")),
                ("finished_at", models.DateTimeField(null=True, verbose_name="finished")),
            ],
            options={
                "verbose_name": "dispatch",
                "verbose_name_plural": "dispatches",
                "db_table": "questpie_queue_dispatch",
                "ordering": ("-created_at", "-id"),
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="Policy",
            fields=[
                (
                    "job_name",
                    models.CharField(
                        max_length=200, primary_key=True, serialize=False, verbose_name="job"
                    ),
                ),
                ("policy", models.CharField(max_length=16)),
                ("updated_at", models.DateTimeField(verbose_name="updated")),
            ],
            options={
                "verbose_name": "queue policy",
                "verbose_name_plural": "queue policies",
                "db_table": "questpie_queue_policy",
                "ordering": ("job_name",),
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="Schedule",
            fields=[
                (
                    "job_name",
                    models.CharField(
                        max_length=200, primary_key=True, serialize=False, verbose_name="job"
                    ),
                ),
                ("source", models.CharField(max_length=8)),
                ("cron", models.CharField(max_length=200)),
                ("tz", models.CharField(max_length=64, verbose_name="time zone")),
                ("singleton_key", models.TextField(null=True)),
                ("next_fire_at", models.DateTimeField(verbose_name="next fire")),
                ("last_fire_at", models.DateTimeField(null=True, verbose_name="last fire")),
                (
                    "last_dispatch_id",
                    models.CharField(max_length=36, null=True, verbose_name="last dispatch"),
                ),
                ("updated_at", models.DateTimeField(verbose_name="updated")),
            ],
            options={
                "db_table": "questpie_schedule",
                "ordering": ("job_name", "source"),
                "managed": False,
            },
        ),
    ]
