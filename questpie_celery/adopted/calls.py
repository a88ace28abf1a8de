"""One call of an adopted task, as the ledger keeps it: its arguments and Canvas links,
serialized by the app's own serializer, so that every send of the dispatch (the first,
the relay's, a retry's) carries the very bytes the application serialized.

The serialized call travels inside JSON as a `Call` (`jobs/serialized.py`). The worker
turns it back into positional and keyword arguments, refusing a content type the app
does not accept (`accept_content`), exactly as Celery refuses such a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kombu.exceptions import ContentDisallowed, DecodeError

from ..errors import PayloadValidationError, PublishOptionsError
from ..jobs.serialized import Serialized, deserialize, serialize

#: The Canvas options of a call (Celery's names in a task request), carried inside the
#: serialized call: they hold signatures, which only the app's serializer can encode.
CANVAS_OPTIONS = ("callbacks", "errbacks", "chain", "chord", "group", "group_index")
#: The names `apply_async` takes them by, where they differ from the request's.
_SENT_AS = {"link": "callbacks", "link_error": "errbacks", "group_id": "group"}


class Call(Serialized):
    """The payload of an adopted task's dispatch: one serialized call,
    `[args, kwargs, canvas]`."""


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
        return serialize([list(args), dict(kwargs), dict(canvas)], serializer, Call)
    except Exception as exc:  # kombu raises EncodeError, or what the serializer raised
        raise PublishOptionsError(
            f"the task's arguments could not be serialized with {serializer!r}: "
            f"{type(exc).__name__}"
        ) from None


def unpack(call: Call, accept: Sequence[str] | None) -> Arguments:
    """The arguments of `call`; `PayloadValidationError` (a failure for good: retrying
    cannot mend it) when its content type is not accepted or it does not decode."""
    try:
        decoded = deserialize(call, accept)
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
