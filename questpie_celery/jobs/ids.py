"""Dispatch ids: derived from (job name, idempotency key), or random; and which ids
the ledger can store at all.

The derivation is part of the public contract so that every
process, in any language, computes the same id for the same key.
"""

from __future__ import annotations

import hashlib
import uuid

_NAMESPACE = b"questpie-queue-dispatch-v1"


def derive_dispatch_id(job_name: str, idempotency_key: str) -> str:
    """Return the stable dispatch id of `idempotency_key` under `job_name`."""
    digest = bytearray(
        hashlib.sha256(
            _NAMESPACE + b"\0" + job_name.encode() + b"\0" + idempotency_key.encode()
        ).digest()[:16]
    )
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    # A UUID's text, as str(uuid.UUID(bytes=...)) writes it, without making one (every
    # keyed publish derives its id).
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def random_dispatch_id() -> str:
    """Return a fresh random (UUID4) dispatch id."""
    return str(uuid.uuid4())


#: The longest dispatch id the ledger stores, in bytes of UTF-8. A plain Celery call may
#: carry any task id; PostgreSQL's B-tree indexes refuse an entry over about 2.7 kB, and
#: the id is in two of them (the primary key, and the operator's views by creation time).
MAX_DISPATCH_ID_BYTES = 1024


def unstorable_id(dispatch_id: object) -> str | None:
    """Why the ledger cannot store `dispatch_id` as a dispatch id; None when it can.

    The same rule on every dialect, so a task id that runs on SQLite runs on PostgreSQL.
    """
    if not isinstance(dispatch_id, str) or not dispatch_id:
        return "it is not a non-empty string"
    if "\0" in dispatch_id:
        return "it contains a NUL character, which PostgreSQL text cannot hold"
    try:
        size = len(dispatch_id.encode())
    except UnicodeEncodeError:
        return "it is not valid Unicode (it holds a lone surrogate)"
    if size > MAX_DISPATCH_ID_BYTES:
        return f"it is {size} bytes long; the ledger stores ids of up to {MAX_DISPATCH_ID_BYTES}"
    return None


def shown_id(task_id: object) -> str:
    """A task id as a log line shows it: quoted, and cut short when long."""
    text = task_id if isinstance(task_id, str) else str(task_id)
    return repr(text) if len(text) <= 80 else f"{text[:80]!r}... ({len(text)} characters)"
