"""A run's return value in the ledger: serialized as the run's job says (JSON for a
job, an adopted task's own serializer, pickle included; `jobs/serialized.py`), kept
whole or not at all, and read back only in a content type the reader accepts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic_core import to_jsonable_python

from ..errors import ResultNotStorableError
from ..jobs.serialized import Serialized, deserialize, serialize

#: The largest serialized return value the ledger keeps (1 MiB): a chord's body is given
#: every member's, so a bound on each keeps the body's call bounded too.
MAX_RESULT_BYTES = 1 << 20


def encode(value: Any, serializer: str) -> dict[str, Any] | None:
    """`value` as the `result` column keeps it; None for None (nothing to keep). Raises
    `ResultNotStorableError` when the serializer refuses it or it is too large."""
    if value is None:
        return None
    try:
        if serializer == "json":
            # A job's handler may return a model, a dataclass, a set: JSON as pydantic
            # writes them, rather than refused.
            value = to_jsonable_python(value)
        stored = serialize(value, serializer, Serialized)
    except Exception as exc:  # kombu's EncodeError, or what the serializer raised
        raise ResultNotStorableError(
            f"the return value cannot be serialized with {serializer!r}: {type(exc).__name__}"
        ) from None
    if stored.size > MAX_RESULT_BYTES:
        raise ResultNotStorableError(
            f"the return value is {stored.size} bytes serialized; the ledger keeps at most "
            f"{MAX_RESULT_BYTES} (store it elsewhere and return a reference to it)"
        )
    return stored.model_dump()


def decode(stored: dict[str, Any] | None, accept: Iterable[str] | None) -> Any:
    """A kept value back; kombu's `ContentDisallowed` unless `accept` allows its type."""
    if stored is None:
        return None
    return deserialize(Serialized.model_validate(stored), accept)


def decode_json(stored: dict[str, Any] | None) -> Any:
    """A kept value for a reader with no app to say what it accepts: JSON only, None
    for anything else (a pickled value is never unpickled without the app's consent)."""
    if stored is None or stored.get("content_type") != "application/json":
        return None
    return decode(stored, ("json",))
