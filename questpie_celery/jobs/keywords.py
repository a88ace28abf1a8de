"""The option vocabulary, declared once: what a job declares (`JobOptions`) and what a
publishing call takes (`PublishOptions`, `ManyOptions`), each built from the same
`SharedOptions`. Type checkers check each keyword against these (`Unpack[...]`); at run
time `options.py` validates each name with its one validator, and an unknown keyword is
a `TypeError` that names the option meant (Celery's names among them).

`None` for any option means "not given": a call's `None` leaves the job's value, and a
job's `None` leaves the default."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from datetime import datetime
from typing import Any, TypedDict

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


class SharedOptions(TypedDict, total=False):
    """The options a job declares as defaults and every publish may override."""

    queue_policy: QueuePolicy | QueuePolicyName | None
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


class JobOptions(SharedOptions, total=False):
    """Options a job declares once (`@job(options=...)`); every publish inherits them."""

    singleton_key: str | None
    cron: str | None  # a fixed schedule (read in UTC) that fires the job with the payload {}
    concurrency_limit: int | None  # at most this many runs active at once, per group
    rate_limit: str | None  # "N/s", "N/m" or "N/h": at most N runs started per window, per group


#: Job options that describe the job, not each dispatch: never merged into a publish's.
JOB_ONLY_OPTIONS = frozenset({"cron", "concurrency_limit", "rate_limit"})


class ManyOptions(SharedOptions, total=False):
    """The options every publishing call takes (`publish_many` applies each to every
    item)."""

    secret_payload: bool | None
    #: Custom message headers (JSON values), on every send of the dispatch and its retries.
    headers: Mapping[str, Any] | None


class DispatchKeys(TypedDict, total=False):
    """The keys of one dispatch; `publish_many` takes a list of each instead."""

    idempotency_key: str | None
    singleton_key: str | None
    group_key: str | None


class PublishOptions(DispatchKeys, ManyOptions, total=False):
    """The options of one dispatch (`publish`, `apublish`): its keys and the shared ones."""


#: The ledger options an adopted Celery task declares (`ledger={...}` on a `LedgerTask`):
#: a job's, its keys (templates over its arguments) and `secret_payload`.
ADOPTED_TASK_OPTIONS = frozenset(
    {
        "idempotency_key",
        "singleton_key",
        "group_key",
        "secret_payload",
        "queue_policy",
        "concurrency_limit",
        "rate_limit",
        "debounce_seconds",
        "debounce_max_seconds",
        "throttle_seconds",
        "expire_in_seconds",
    }
)
#: The ledger options an adopted task's `apply_async` (or a signature's options) takes
#: beside Celery's own; Celery's `countdown`, `eta`, `priority`, `queue` and `headers`
#: keep their names and meaning.
ADOPTED_CALL_OPTIONS = (
    "idempotency_key",
    "singleton_key",
    "group_key",
    "secret_payload",
    "queue_policy",
    "debounce_seconds",
    "debounce_max_seconds",
    "throttle_seconds",
)

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
