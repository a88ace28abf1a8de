"""`Questpie(django_database=...)`'s configuration errors, without a Django project
(the integration tests run a real one: tests/integration/test_django.py). That a
Questpie with no ledger at all points to the Django app is checked in a fresh process by
tests/unit/test_public_api.py: the suite's Django admin tests configure Django in theirs."""

from __future__ import annotations

import pytest
from celery import Celery

from questpie_celery import ConfigurationError, Questpie


def test_one_ledger_only() -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        Questpie(Celery("dj", broker="memory://"), ledger_url="sqlite://", django_database="x")


def test_relaxed_durability_is_refused_on_djangos_connections() -> None:
    with pytest.raises(ConfigurationError, match="synchronous_commit"):
        Questpie(Celery("dj", broker="memory://"), django_database="default", durability="relaxed")


def test_the_alias_must_be_a_string() -> None:
    with pytest.raises(ConfigurationError, match="alias"):
        Questpie(Celery("dj", broker="memory://"), django_database=1)  # type: ignore[arg-type]
