"""One call of an adopted task, as the ledger keeps it: its arguments and Canvas links,
serialized by the app's own serializer, so that every send of the dispatch (the first,
the relay's, a retry's) carries the very bytes the application serialized.

The ledger stores JSON, so the serialized call travels inside a small JSON object, a
`Call`: the serializer's content type and encoding, and its body (base64 for a binary
serializer such as pickle). The worker turns it back into positional and keyword
arguments with `kombu.serialization.loads`, refusing a content type the app does not
accept (`accept_content`), exactly as Celery refuses such a message.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import dumps, loads, prepare_accept_content
from pydantic import BaseModel, ConfigDict

from ..errors import PayloadValidationError, PublishOptionsError

#: The Canvas options of a call (Celery's names in a task request), carried inside the
#: serialized call: they hold signatures, which only the app's serializer can encode.
CANVAS_OPTIONS = ("callbacks", "errbacks", "chain", "chord", "group", "group_index")
#: The names `apply_async` takes them by, where they differ from the request's.
_SENT_AS = {"link": "callbacks", "link_error": "errbacks", "group_id": "group"}


class Call(BaseModel):
    """The payload of an adopted task's dispatch: one serialized call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    content_type: str
    content_encoding: str
    body: str
    #: The body is base64 of the serializer's bytes (a binary serializer).
    base64: bool = False


@dataclass(frozen=True)
class Arguments:
    """A call turned back into what the task's `run` takes, and its Canvas options."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    canvas: dict[str, Any]


def canvas_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The Canvas options among `apply_async`'s, by the request's names (`link` is
    `callbacks`); a single link becomes a list, as Celery makes it."""
    found: dict[str, Any] = {}
    for name, value in options.items():
        named = _SENT_AS.get(name, name)
        if named not in CANVAS_OPTIONS or value is None:
            continue
        single = named in ("callbacks", "errbacks") and not isinstance(value, list | tuple)
        found[named] = [value] if single else list(value) if isinstance(value, tuple) else value
    return found


def pack(
    args: Sequence[Any], kwargs: Mapping[str, Any], canvas: Mapping[str, Any], serializer: str
) -> Call:
    """Serialize one call with `serializer` (a name kombu knows: the app's, or one the
    application registered); a value it cannot encode is a `PublishOptionsError`
    before anything is written."""
    try:
        content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
            [list(args), dict(kwargs), dict(canvas)], serializer
        )
    except Exception as exc:  # kombu raises EncodeError, or what the serializer raised
        raise PublishOptionsError(
            f"the task's arguments could not be serialized with {serializer!r}: "
            f"{type(exc).__name__}"
        ) from None
    if isinstance(data, bytes) and encoding == "binary":
        body, encoded = base64.b64encode(data).decode("ascii"), True
    else:
        body = data.decode(encoding) if isinstance(data, bytes) else data
        encoded = False
    return Call(content_type=content_type, content_encoding=encoding, body=body, base64=encoded)


def unpack(call: Call, accept: Sequence[str] | None) -> Arguments:
    """The arguments of `call`; `PayloadValidationError` (a failure for good: retrying
    cannot mend it) when its content type is not accepted or it does not decode."""
    data: bytes | str = base64.b64decode(call.body) if call.base64 else call.body
    # Names ("pickle") to content types, as Celery's worker reads `accept_content`.
    allowed = None if accept is None else prepare_accept_content(accept)  # type: ignore[no-untyped-call]
    try:
        decoded = loads(  # type: ignore[no-untyped-call]
            data, call.content_type, call.content_encoding, accept=allowed
        )
    except ContentDisallowed:
        raise PayloadValidationError(
            f"the call is serialized as {call.content_type}, which accept_content refuses"
        ) from None
    except (DecodeError, ValueError, TypeError):
        raise PayloadValidationError("the call's body does not decode") from None
    if not (isinstance(decoded, list | tuple) and len(decoded) == 3):
        raise PayloadValidationError("the call's body is not [args, kwargs, canvas]")
    args, kwargs, canvas = decoded
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        raise PayloadValidationError("the call's body is not [args, kwargs, canvas]")
    return Arguments(tuple(args), dict(kwargs), dict(canvas) if isinstance(canvas, Mapping) else {})
