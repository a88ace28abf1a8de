"""Receipts: what a program may learn about a secret dispatch (SPEC section 5)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

ReceiptStatus = Literal["queued", "completed", "failed"]


@dataclass(frozen=True)
class Receipt:
    """The life of one secret dispatch, without its payload or any key material."""

    dispatch_id: str
    job_name: str
    idempotency_key: str
    status: ReceiptStatus
    created_at: datetime
    queued_at: datetime | None
    handled_at: datetime | None


def receipt_status(ledger_status: str) -> ReceiptStatus:
    """Everything short of an outcome is `queued` (accepted, relaying, parked, running)."""
    if ledger_status in ("completed", "failed"):
        return ledger_status  # type: ignore[return-value]
    return "queued"
