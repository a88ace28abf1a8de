"""What a program may learn about a dispatch: its status, and a secret one's receipt.

Neither holds a payload, a ciphertext, key material or an error message.
"""

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


@dataclass(frozen=True)
class DispatchStatus:
    """Where one ledgered dispatch stands (`questpie.queue.get_status`)."""

    dispatch_id: str
    job_name: str
    idempotency_key: str | None
    singleton_key: str | None
    status: str
    """pending, queued, parked, active, retry, completed or failed."""
    attempt: int
    """Claims so far: 1 once the first run started."""
    last_error: str | None
    """The exception class of the last failed attempt, never its message."""
    secret: bool
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None


def receipt_status(ledger_status: str) -> ReceiptStatus:
    """Everything short of an outcome is `queued` (accepted, relaying, parked, running)."""
    if ledger_status in ("completed", "failed"):
        return ledger_status  # type: ignore[return-value]
    return "queued"
