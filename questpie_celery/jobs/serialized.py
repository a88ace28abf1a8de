"""A value serialized by a serializer Celery knows (kombu's registry: json, pickle, yaml,
msgpack, or one the application registered), carried inside JSON.

The ledger stores JSON, so the serializer's output travels in a small JSON object: its
content type and encoding, and its body (base64 for a binary serializer such as
pickle). Reading it back refuses a content type the reader does not accept, exactly as
Celery's worker refuses such a message. An adopted task's call (`adopted/calls.py`) and
a run's result (`canvas/results.py`) are kept this way.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any, TypeVar

from kombu.serialization import dumps, loads, prepare_accept_content
from pydantic import BaseModel, ConfigDict


class Serialized(BaseModel):
    """One serialized value."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    content_type: str
    content_encoding: str
    body: str
    #: The body is base64 of the serializer's bytes (a binary serializer).
    base64: bool = False

    @property
    def size(self) -> int:
        """About how many bytes the serializer made (the body as stored)."""
        return len(self.body)


S = TypeVar("S", bound=Serialized)


def serialize(value: Any, serializer: str, model: type[S]) -> S:
    """`value` serialized with `serializer`; raises what kombu or the serializer raises."""
    content_type, encoding, data = dumps(value, serializer)  # type: ignore[no-untyped-call]
    if isinstance(data, bytes) and encoding == "binary":
        body, encoded = base64.b64encode(data).decode("ascii"), True
    else:
        body = data.decode(encoding) if isinstance(data, bytes) else data
        encoded = False
    return model(content_type=content_type, content_encoding=encoding, body=body, base64=encoded)


def deserialize(value: Serialized, accept: Iterable[str] | None) -> Any:
    """The value back; kombu's `ContentDisallowed` unless `accept` (serializer names or
    content types, as Celery's `accept_content`) allows its content type (None: any),
    `DecodeError` (or the serializer's own) when it does not decode."""
    data: bytes | str = base64.b64decode(value.body) if value.base64 else value.body
    # Names ("pickle") to content types, as Celery's worker reads `accept_content`.
    allowed = None if accept is None else prepare_accept_content(set(accept))  # type: ignore[no-untyped-call]
    return loads(  # type: ignore[no-untyped-call]
        data, value.content_type, value.content_encoding, accept=allowed
    )
