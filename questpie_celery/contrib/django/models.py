"""The ledger's tables as Django sees them, for the read-only admin.

Unmanaged (`Meta.managed = False`): Django's migrations never create, alter or drop
them; the package's own migration does (`ledger.migration.migrate()`), and the table names are
read from `questpie_celery.ledger.schema`. Each model maps only the columns the admin
shows. A dispatch's `payload`, `secret_ciphertext` and `secret_wrapped_key`, a
schedule's `payload` and the `options` of both are not fields, so no query Django
builds from these models reads them and no page can show them.
"""

from __future__ import annotations

from django.db import models

from ...ledger.schema import dispatch_table, policy_table, schedule_table


class Dispatch(models.Model):
    """One row of the dispatch ledger, short of its payload and secrets."""

    # Any task id a plain Celery call carries (schema version 5), not only a UUID.
    id = models.TextField(primary_key=True, verbose_name="dispatch id")
    job_name = models.CharField(max_length=200, verbose_name="job")
    idempotency_key = models.TextField(null=True, verbose_name="key")
    singleton_key = models.TextField(null=True)
    status = models.CharField(max_length=16)
    policy = models.CharField(max_length=16, null=True)
    slot = models.TextField(null=True)
    # The flow-control limits (schema version 6): its group, the seat it holds while it
    # runs, and what it waits for.
    group_key = models.TextField(null=True, verbose_name="group")
    seat = models.IntegerField(null=True)
    waiting_for = models.CharField(max_length=16, null=True, verbose_name="waiting for")
    # Cancellation and debounce (schema version 7): when a cancel found it running, and
    # the burst a debounced dispatch gathers while it waits.
    cancel_requested_at = models.DateTimeField(null=True, verbose_name="cancel requested")
    debounce_key = models.TextField(null=True, verbose_name="debounce key")
    secret = models.BooleanField()
    secret_key_id = models.CharField(max_length=64, null=True, verbose_name="secret key id")
    attempt = models.IntegerField(verbose_name="attempts")
    # Its claims so far (schema version 8): the fencing token of the latest.
    claim_generation = models.IntegerField(null=True, verbose_name="claims")
    # The chord or batch it is a member of (schema version 9). Its `result` is left out,
    # as its payload is: what a run returned is the application's data.
    canvas_id = models.TextField(null=True, verbose_name="chord or batch")
    send_count = models.IntegerField(verbose_name="sends of this attempt")
    last_error = models.CharField(max_length=200, null=True)
    run_after = models.DateTimeField()
    next_send_at = models.DateTimeField(null=True)
    lease_expires_at = models.DateTimeField(null=True)
    created_at = models.DateTimeField(verbose_name="created")
    queued_at = models.DateTimeField(null=True, verbose_name="queued")
    started_at = models.DateTimeField(null=True, verbose_name="started")
    finished_at = models.DateTimeField(null=True, verbose_name="finished")

    class Meta:
        managed = False
        db_table = dispatch_table.name
        verbose_name = "dispatch"
        verbose_name_plural = "dispatches"
        # Newest first, as the ledger's (created_at, id) index reads backwards.
        ordering = ("-created_at", "-id")

    def __str__(self) -> str:
        return f"{self.job_name} {self.id}"


class Schedule(models.Model):
    """A schedule of a job, short of the payload it fires with.

    The table's key is (job, source); Django 5.2's admin cannot register a model with a
    composite primary key, so `job_name` stands in for it here, and the admin lists
    schedules without a page per schedule.
    """

    job_name = models.CharField(max_length=200, primary_key=True, verbose_name="job")
    source = models.CharField(max_length=8)
    cron = models.CharField(max_length=200)
    tz = models.CharField(max_length=64, verbose_name="time zone")
    singleton_key = models.TextField(null=True)
    group_key = models.TextField(null=True, verbose_name="group")
    next_fire_at = models.DateTimeField(verbose_name="next fire")
    last_fire_at = models.DateTimeField(null=True, verbose_name="last fire")
    last_dispatch_id = models.TextField(null=True, verbose_name="last dispatch")
    updated_at = models.DateTimeField(verbose_name="updated")

    class Meta:
        managed = False
        db_table = schedule_table.name
        ordering = ("job_name", "source")

    def __str__(self) -> str:
        return f"{self.job_name} ({self.source}) {self.cron} {self.tz}"


class Policy(models.Model):
    """The queue policy recorded for a job."""

    job_name = models.CharField(max_length=200, primary_key=True, verbose_name="job")
    policy = models.CharField(max_length=16)
    updated_at = models.DateTimeField(verbose_name="updated")

    class Meta:
        managed = False
        db_table = policy_table.name
        verbose_name = "queue policy"
        verbose_name_plural = "queue policies"
        ordering = ("job_name",)

    def __str__(self) -> str:
        return f"{self.job_name}: {self.policy}"
