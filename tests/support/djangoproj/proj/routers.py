"""A database router that sends questpie's admin models away from the ledger (for the
check that reports it)."""

from __future__ import annotations

from typing import Any


class QuestpieElsewhere:
    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "questpie_celery" else None
