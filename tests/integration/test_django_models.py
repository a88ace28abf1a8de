"""The Django models of the ledger map its tables as they are, and never a payload or a
secret's ciphertext or wrapped key.

Here, not in the fast lane, though it needs no server: it configures Django in the test
process, and a configured Django with this app installed gives every later
`Questpie(app)` without a ledger Django's database, which the fast lane's tests of
configuration errors must not meet."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.db import models as django_models
from sqlalchemy import String, Table, Text

from questpie_celery.ledger.schema import dispatch_table, metadata
from tests.support import django_site

# What may hold the application's data or key material: never in the admin.
FORBIDDEN = {
    "payload", "result", "secret_ciphertext", "secret_wrapped_key", "options", "claim_token",
}  # fmt: skip


@pytest.fixture(scope="module")
def models() -> list[Any]:
    django_site.configure()
    config = next(c for c in apps.get_app_configs() if c.name == django_site.APP)
    return list(config.get_models())


def test_every_model_maps_existing_columns_of_a_ledger_table(models: list[Any]) -> None:
    assert {m._meta.db_table for m in models} == {
        "questpie_queue_dispatch",
        "questpie_schedule",
        "questpie_queue_policy",
    }
    for model in models:
        meta = model._meta
        assert meta.managed is False
        table: Table = metadata.tables[meta.db_table]
        for field in meta.concrete_fields:
            column = table.c[field.column]
            assert field.column not in FORBIDDEN, (meta.db_table, field.column)
            if not field.primary_key:
                assert field.null == column.nullable, (meta.db_table, field.column)
            # The widths agree: a bounded string is a CharField of its length, an
            # unbounded one a TextField (a dispatch id, since schema version 5).
            kind = getattr(column.type, "impl", column.type)
            if isinstance(field, django_models.CharField):
                assert isinstance(kind, String) and not isinstance(kind, Text)
                assert kind.length == field.max_length, (meta.db_table, field.column)
            if isinstance(field, django_models.TextField):
                assert isinstance(kind, Text), (meta.db_table, field.column)


def test_the_dispatch_model_leaves_out_payload_and_secrets(models: list[Any]) -> None:
    dispatch = next(m for m in models if m._meta.db_table == dispatch_table.name)
    mapped = {f.column for f in dispatch._meta.concrete_fields}
    assert mapped.isdisjoint(FORBIDDEN)
    # Everything else of a dispatch is there to see.
    assert mapped | FORBIDDEN == set(dispatch_table.c.keys())


def test_the_admin_refuses_every_write_to_everyone(models: list[Any]) -> None:
    import questpie_celery.contrib.django.admin  # noqa: F401, PLC0415  (registers the models)

    for model in models:
        model_admin = admin.site._registry[model]
        assert not model_admin.has_add_permission(None)
        assert not model_admin.has_change_permission(None)
        assert not model_admin.has_delete_permission(None)
        assert model_admin.actions is None
