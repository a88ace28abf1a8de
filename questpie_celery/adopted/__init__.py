"""Existing Celery tasks adopted where they stand: `base=LedgerTask` gives a task's calls
the ledger (keys, queue policies, limits, secret payloads) with no call site changed."""

from .task import LedgerRefused, LedgerTask

__all__ = ["LedgerRefused", "LedgerTask"]
