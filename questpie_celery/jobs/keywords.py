"""A publishing call's keywords: declared once, for type checkers to check each keyword
against (`Unpack[PublishOptions]`) and for the client to refuse an unknown one with a
`TypeError` that names the option meant (Celery's names among them)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import datetime
from typing import TypedDict

from .policies import QueuePolicy, QueuePolicyName

#: What Celery users reach for, and the option that does it here.
_CELERY_NAMES = {
    "countdown": "start_after",
    "eta": "start_after",
    "retries": "retry_limit",
    "max_retries": "retry_limit",
    "default_retry_delay": "retry_delay",
    "retry_delay_seconds": "retry_delay",
    "autoretry_for": "retry_limit",
    "retry_backoff_max": "retry_backoff",
    "expires": "expire_in_seconds",
    "time_limit": "expire_in_seconds",
    "soft_time_limit": "expire_in_seconds",
    "routing_key": "queue",
    "exchange": "queue",
    "task_id": "idempotency_key",
}


class ManyOptions(TypedDict, total=False):
    """The options every publishing call takes (`publish_many` applies each to every
    item), declared once: type checkers check each keyword against these, and an unknown
    one is a `TypeError` at run time too."""

    queue_policy: QueuePolicy | QueuePolicyName | None
    secret_payload: bool
    priority: int | None
    start_after: float | str | datetime | None
    retry_limit: int | None
    retry_delay: float | None
    retry_backoff: bool | None
    expire_in_seconds: int | None
    queue: str | None
    debounce_seconds: float | None
    debounce_max_seconds: float | None
    throttle_seconds: float | None


class DispatchKeys(TypedDict, total=False):
    """The keys of one dispatch; `publish_many` takes a list of each instead."""

    idempotency_key: str | None
    singleton_key: str | None
    group_key: str | None


class PublishOptions(DispatchKeys, ManyOptions, total=False):
    """The options of one dispatch (`publish`, `apublish`): its keys and the shared ones."""


#: Every keyword of `publish()`, for the message that names the one meant.
PUBLISH_OPTION_NAMES = (*PublishOptions.__annotations__, "session", "connection")


def unknown_option_message(call: str, unknown: Mapping[str, object]) -> str:
    """`publish() got an unexpected keyword argument 'countdown'; use start_after ...`."""
    name = sorted(unknown)[0]
    meant = _CELERY_NAMES.get(name) or next(
        iter(difflib.get_close_matches(name, PUBLISH_OPTION_NAMES, n=1)), None
    )
    hint = f"; did you mean {meant!r}?" if meant else ""
    return (
        f"{call}() got an unexpected keyword argument {name!r}{hint} "
        f"(options: {', '.join(PUBLISH_OPTION_NAMES)})"
    )
