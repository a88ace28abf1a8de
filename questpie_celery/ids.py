"""Dispatch ids: derived from (job name, idempotency key), or random.

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
    return str(uuid.UUID(bytes=bytes(digest)))


def random_dispatch_id() -> str:
    """Return a fresh random (UUID4) dispatch id."""
    return str(uuid.uuid4())
