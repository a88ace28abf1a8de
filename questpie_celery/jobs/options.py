"""Dispatch options: their names, defaults, validation and merging.

Job options (declared once with `@job`) are merged under call-time options
(passed to `publish()`), then validated into an immutable `DispatchOptions`.
Validation happens before anything is written anywhere.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from ..errors import PublishOptionsError
from .cron import Cron
from .keywords import JOB_ONLY_OPTIONS, JobOptions
from .limits import Rate, concurrency
from .policies import QueuePolicy

DEFAULT_RETRY_LIMIT = 2
DEFAULT_RETRY_DELAY = 0.0
DEFAULT_EXPIRE_IN_SECONDS = 900
MAX_KEY_LENGTH = 512
MAX_RETRY_BACKOFF_SECONDS = 3600
#: The most retries a dispatch may have: the ledger counts attempts in a 32-bit integer
#: (an adopted task with `max_retries=None`, retried for as long as it asks).
MAX_RETRY_LIMIT = 2**31 - 2
#: The message header that is questpie's own (see `send/broker.py`); never a custom one.
QUESTPIE_HEADER = "questpie"
MAX_PRIORITY = 9
#: Upper bounds no worker could honour past (and datetime arithmetic overflows beyond).
MAX_START_AFTER_SECONDS = 10 * 365 * 86400
MAX_RETRY_DELAY_SECONDS = 365 * 86400
MAX_EXPIRE_IN_SECONDS = 7 * 86400
MAX_QUEUE_NAME_LENGTH = 255
#: A burst's longest start, when `debounce_max_seconds` is not given: this many quiet
#: periods after its first publish.
DEFAULT_DEBOUNCE_MAX_FACTOR = 10
#: The idempotency key of a schedule's fire names its source and tick after this prefix
#: (`schedules.fire_key`); the beat deletes the fires it made, by this prefix.
FIRE_KEY_PREFIX = "questpie-schedule:"
#: Key namespaces the package writes keys in itself, so a publish may not: a key there
#: would be taken for one of ours (a fire's row, deleted by the beat's pruning, after
#: which the key would lose its id and run again). Compared without regard to ASCII
#: case, as SQLite's LIKE, which that pruning uses, compares.
RESERVED_KEY_PREFIXES = (FIRE_KEY_PREFIX,)


JOB_OPTION_NAMES = frozenset(JobOptions.__optional_keys__)


@dataclass(frozen=True)
class RunOptions:
    """The options a worker needs to run one dispatch; they travel in the message headers."""

    retry_limit: int = DEFAULT_RETRY_LIMIT
    retry_delay: float = DEFAULT_RETRY_DELAY
    retry_backoff: bool = False
    expire_in_seconds: int = DEFAULT_EXPIRE_IN_SECONDS

    def delay_before_retry(self, retry_number: int) -> float:
        """Seconds to wait before retry `retry_number` (1 for the first retry)."""
        if not self.retry_backoff:
            return self.retry_delay
        base = max(self.retry_delay, 1.0)
        return float(min(base * 2 ** (retry_number - 1), MAX_RETRY_BACKOFF_SECONDS))

    def to_dict(self) -> dict[str, Any]:
        # Spelled out: dataclasses.asdict costs more than the rest of a message header.
        return {
            "retry_limit": self.retry_limit,
            "retry_delay": self.retry_delay,
            "retry_backoff": self.retry_backoff,
            "expire_in_seconds": self.expire_in_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RunOptions:
        """Rebuild from a ledger value; anything malformed falls back to defaults."""
        try:
            return cls.parse(data)
        except PublishOptionsError:
            return cls()

    @classmethod
    def parse(cls, data: object) -> RunOptions:
        """Rebuild from what `to_dict` wrote (a missing field is its default); raises
        `PublishOptionsError` naming a field of the wrong type or out of its bounds."""
        if not isinstance(data, Mapping):
            raise PublishOptionsError("run options must be a mapping")
        return cls(
            retry_limit=_int(data.get("retry_limit", DEFAULT_RETRY_LIMIT), "retry_limit", 0),
            retry_delay=_seconds(
                data.get("retry_delay", DEFAULT_RETRY_DELAY),
                "retry_delay",
                MAX_RETRY_DELAY_SECONDS,
            ),
            retry_backoff=_bool(data.get("retry_backoff", False), "retry_backoff"),
            expire_in_seconds=_int(
                data.get("expire_in_seconds", DEFAULT_EXPIRE_IN_SECONDS),
                "expire_in_seconds",
                1,
                MAX_EXPIRE_IN_SECONDS,
            ),
        )


@dataclass(frozen=True)
class StoredOptions:
    """What the ledger keeps of a dispatch's options, to send its message again.

    `carry` holds the Celery options of a delivery taken into the ledger at the
    worker (its custom headers and Canvas links), so a later send keeps them.
    This class is the only reader and writer of the ledger's `options` column.
    """

    run: RunOptions = field(default_factory=RunOptions)
    priority: int | None = None
    queue: str | None = None
    carry: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "run": self.run.to_dict(),
            "priority": self.priority,
            "queue": self.queue,
        }
        if self.carry:
            data["carry"] = dict(self.carry)
        return data

    @classmethod
    def from_json(cls, data: object) -> StoredOptions:
        if not isinstance(data, Mapping):
            return cls()
        priority = data.get("priority")
        queue = data.get("queue")
        carry = data.get("carry")
        return cls(
            run=RunOptions.from_dict(data.get("run")),
            priority=priority if isinstance(priority, int) and 0 <= priority <= 9 else None,
            queue=queue if isinstance(queue, str) and queue else None,
            carry=carry if isinstance(carry, Mapping) else {},
        )


@dataclass(frozen=True)
class DispatchOptions:
    """Every option of one dispatch, validated and merged."""

    run: RunOptions
    idempotency_key: str | None = None
    singleton_key: str | None = None
    group_key: str | None = None
    queue_policy: QueuePolicy | None = None
    secret_payload: bool = False
    priority: int | None = None
    start_after: datetime | None = None
    queue: str | None = None
    #: Debounced: the dispatch starts this long after the last publish of its burst...
    debounce_seconds: float | None = None
    #: ...and at most this long after the burst's first (set whenever debounced).
    debounce_max_seconds: float | None = None
    #: Throttled: at most one dispatch per job and key accepted per window this long.
    throttle_seconds: float | None = None
    #: Celery options kept with the dispatch for every send: its custom `headers` (the
    #: `headers` option) and, for an adopted task's call, its route.
    carry: Mapping[str, Any] = field(default_factory=dict)
    #: The id an unkeyed dispatch takes (an adopted task's call whose id Celery's Canvas
    #: froze); a keyed dispatch's id is always its key's.
    dispatch_id: str | None = None
    #: The chord or batch the dispatch is a member of (it always has a ledger row).
    canvas_id: str | None = None
    #: A chain's link, under the id Celery froze for it: it always has a ledger row, so
    #: a replayed link starts the next one once.
    chain_link: bool = False

    @property
    def flow_controlled(self) -> bool:
        """Debounced or throttled: published one by one, each with a ledger row."""
        return self.debounce_seconds is not None or self.throttle_seconds is not None

    @property
    def flow_key(self) -> str:
        """The burst or window a debounced or throttled dispatch belongs to: its
        singleton key, or "" for the job as a whole."""
        return self.singleton_key if self.singleton_key is not None else ""

    def stored(self) -> StoredOptions:
        return StoredOptions(
            run=self.run, priority=self.priority, queue=self.queue, carry=self.carry
        )


def validate_job_options(options: Mapping[str, Any] | None) -> JobOptions:
    """Validate a job's `options` mapping; unknown names are an error, not a no-op."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise PublishOptionsError("job options must be a mapping")
    unknown = sorted(set(options) - JOB_OPTION_NAMES)
    if unknown:
        raise PublishOptionsError(
            f"unknown job option(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(JOB_OPTION_NAMES))}"
        )
    now = datetime.now(UTC)
    validated = {name: value for name, value in options.items() if value is not None}
    for name, value in validated.items():
        if name == "cron":
            validated[name] = Cron.parse(value).expression
        elif name == "concurrency_limit":
            concurrency(value)
        elif name == "rate_limit":
            Rate.parse(value)
        else:
            _VALIDATORS[name](value, now)
    if validated.keys() & _FLOW_OPTIONS:
        # The combinations a publish refuses, told where the job is declared.
        _check_keys(_merge(cast(JobOptions, validated), {}, ()))
    return cast(JobOptions, validated)


_FLOW_OPTIONS = frozenset({"debounce_seconds", "debounce_max_seconds", "throttle_seconds"})


def resolve_options(
    job_options: JobOptions, call_options: Mapping[str, Any], *, ignore: tuple[str, ...] = ()
) -> DispatchOptions:
    """Merge call-time options (which win; `None` means "not given") over the job's,
    leaving out the job's options named in `ignore`."""
    merged = _merge(job_options, call_options, ignore)
    _check_keys(merged)
    return merged


def resolve_many_options(
    job_options: JobOptions,
    call_options: Mapping[str, Any],
    idempotency_keys: Sequence[str | None] | None,
    singleton_keys: Sequence[str | None] | None,
    count: int,
    group_keys: Sequence[str | None] | None = None,
) -> list[DispatchOptions]:
    """The options of each item of a bulk publish: the shared options merged once, then
    each item's keys, validated exactly as `resolve_options` validates one call's. An
    error names the item's index (never the key: a key may be sensitive)."""
    keys = _per_item(idempotency_keys, "idempotency_keys", count)
    singles = _per_item(singleton_keys, "singleton_keys", count)
    groups = _per_item(group_keys, "group_keys", count)
    shared = _merge(job_options, call_options, ())
    resolved: list[DispatchOptions] = []
    for index, (key, single, group) in enumerate(zip(keys, singles, groups, strict=True)):
        try:
            item = shared
            if key is not None or single is not None or group is not None:
                item = replace(
                    shared,
                    idempotency_key=None if key is None else _idempotency_key(key),
                    singleton_key=(
                        shared.singleton_key if single is None else _key(single, "singleton_key")
                    ),
                    group_key=shared.group_key if group is None else _key(group, "group_key"),
                )
            _check_keys(item)
        except PublishOptionsError as exc:
            raise PublishOptionsError(f"item {index}: {exc}") from None
        resolved.append(item)
    return resolved


def _per_item(values: object, name: str, count: int) -> list[Any]:
    if values is None:
        return [None] * count
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise PublishOptionsError(f"{name} must be a list with one entry (or None) per payload")
    if len(values) != count:
        raise PublishOptionsError(f"{name} has {len(values)} entries for {count} payloads")
    return list(values)


def _merge(
    job_options: JobOptions, call_options: Mapping[str, Any], ignore: tuple[str, ...]
) -> DispatchOptions:
    given = {k: v for k, v in call_options.items() if v is not None}
    # A job's cron is its schedule, and its limits are its own: not options of a dispatch.
    inherited = {
        k: v for k, v in job_options.items() if k not in JOB_ONLY_OPTIONS and k not in ignore
    }
    merged: dict[str, Any] = {**inherited, **given}
    now = datetime.now(UTC)
    values = {name: _VALIDATORS[name](value, now) for name, value in merged.items()}
    run = RunOptions(
        retry_limit=values.get("retry_limit", DEFAULT_RETRY_LIMIT),
        retry_delay=values.get("retry_delay", DEFAULT_RETRY_DELAY),
        retry_backoff=values.get("retry_backoff", False),
        expire_in_seconds=values.get("expire_in_seconds", DEFAULT_EXPIRE_IN_SECONDS),
    )
    return DispatchOptions(
        run=run,
        idempotency_key=values.get("idempotency_key"),
        singleton_key=values.get("singleton_key"),
        group_key=values.get("group_key"),
        queue_policy=values.get("queue_policy"),
        secret_payload=values.get("secret_payload", False),
        priority=values.get("priority"),
        start_after=values.get("start_after"),
        queue=values.get("queue"),
        debounce_seconds=values.get("debounce_seconds"),
        debounce_max_seconds=_debounce_max(values),
        throttle_seconds=values.get("throttle_seconds"),
        carry={"headers": values["headers"]} if values.get("headers") else {},
    )


def _debounce_max(values: Mapping[str, Any]) -> float | None:
    debounce: float | None = values.get("debounce_seconds")
    most: float | None = values.get("debounce_max_seconds")
    if debounce is None:
        if most is not None:
            raise PublishOptionsError("debounce_max_seconds needs debounce_seconds")
        return None
    if most is None:
        return min(debounce * DEFAULT_DEBOUNCE_MAX_FACTOR, float(MAX_START_AFTER_SECONDS))
    if most < debounce:
        raise PublishOptionsError("debounce_max_seconds must be at least debounce_seconds")
    return most


def _check_keys(options: DispatchOptions) -> None:
    """The rules that tie the keys to each other and to a secret payload."""
    if options.debounce_seconds is not None:
        if options.secret_payload:
            raise PublishOptionsError(
                "debounce_seconds and secret_payload cannot both be set (a burst's later "
                "publishes replace its payload, which a sealed one cannot take)"
            )
        # Every publish of a burst answers the burst's id: a key's id is another identity.
        if options.idempotency_key is not None:
            raise PublishOptionsError(
                "debounce_seconds and idempotency_key cannot both be set (a burst has one "
                "id whatever the key; debounce per key with singleton_key)"
            )
        if options.start_after is not None:
            raise PublishOptionsError(
                "debounce_seconds and start_after cannot both be set (a debounced "
                "dispatch starts debounce_seconds after the burst's last publish)"
            )
        if options.throttle_seconds is not None:
            raise PublishOptionsError("debounce_seconds and throttle_seconds cannot both be set")
    if options.idempotency_key is not None and options.singleton_key is not None:
        raise PublishOptionsError("idempotency_key and singleton_key cannot both be set")
    if options.secret_payload and options.idempotency_key is None:
        raise PublishOptionsError("secret_payload needs an idempotency_key")


# --- single-value validators -------------------------------------------------------------
# Each takes the raw value (and "now", for relative times) and returns the normalised value
# or raises PublishOptionsError naming the option. Values are never echoed back: a key may
# be sensitive.


def _bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise PublishOptionsError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _int(value: object, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PublishOptionsError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise PublishOptionsError(f"{name} must be >= {minimum}{upper}")
    return value


def _seconds(value: object, name: str, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PublishOptionsError(f"{name} must be a number of seconds")
    # A comparison, not math.isfinite: NaN fails it too, and an int too big for a float
    # cannot overflow it.
    if not 0 <= value <= maximum:
        raise PublishOptionsError(f"{name} must be a number of seconds from 0 to {maximum:g}")
    return float(value)


def _positive_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PublishOptionsError(f"{name} must be a number of seconds")
    if not 0 < value <= MAX_START_AFTER_SECONDS:  # NaN too (see `_seconds`)
        raise PublishOptionsError(
            f"{name} must be a number of seconds above 0, at most {MAX_START_AFTER_SECONDS}"
        )
    return float(value)


def _key(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise PublishOptionsError(f"{name} must be a str, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise PublishOptionsError(f"{name} must be 1 to {MAX_KEY_LENGTH} characters long")
    if "\0" in value:
        raise PublishOptionsError(f"{name} must not contain NUL")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise PublishOptionsError(f"{name} must be valid Unicode (no lone surrogates)") from None
    return value


def _idempotency_key(value: object) -> str:
    key = _key(value, "idempotency_key")
    for prefix in RESERVED_KEY_PREFIXES:
        if key[: len(prefix)].translate(_ASCII_LOWER) == prefix:
            raise PublishOptionsError(
                f"idempotency_key must not start with {prefix!r}: questpie writes its own "
                "keys there"
            )
    return key


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def _start_after(value: object, now: datetime) -> datetime:
    if isinstance(value, bool):
        raise PublishOptionsError("start_after must be seconds, an ISO-8601 string or a datetime")
    if isinstance(value, int | float):
        if not 0 <= value <= MAX_START_AFTER_SECONDS:  # NaN too (see `_seconds`)
            raise PublishOptionsError(
                f"start_after in seconds must be a number from 0 to {MAX_START_AFTER_SECONDS}"
            )
        return now + timedelta(seconds=value)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise PublishOptionsError(
                "start_after must be an ISO-8601 date-time with a UTC offset"
            ) from None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise PublishOptionsError("start_after must carry a timezone (naive datetime given)")
        try:
            when = value.astimezone(UTC)
        except OverflowError:
            when = None
        if when is None or when > now + timedelta(seconds=MAX_START_AFTER_SECONDS):
            raise PublishOptionsError(
                f"start_after must be at most {MAX_START_AFTER_SECONDS} seconds from now"
            )
        return when
    raise PublishOptionsError("start_after must be seconds, an ISO-8601 string or a datetime")


def _policy(value: object) -> QueuePolicy:
    policy = QueuePolicy.parse(value)
    if policy is None:
        raise PublishOptionsError(f"queue_policy must be one of {', '.join(QueuePolicy)}")
    return policy


def _queue(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_QUEUE_NAME_LENGTH:
        raise PublishOptionsError(f"queue must be a str of 1 to {MAX_QUEUE_NAME_LENGTH} characters")
    if not value.isprintable():
        raise PublishOptionsError("queue must not contain control characters")
    return value


def _headers(value: object) -> dict[str, Any]:
    """Custom headers: a mapping of str names to JSON values (the ledger keeps them for
    every send), none of them questpie's own."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise PublishOptionsError("headers must be a mapping of str names to values")
    if QUESTPIE_HEADER in value:
        raise PublishOptionsError(f"headers must not set {QUESTPIE_HEADER!r}: it is questpie's")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise PublishOptionsError(
            "headers must hold JSON values (str, numbers, lists, ...)"
        ) from None
    return dict(value)


_VALIDATORS: dict[str, Any] = {
    "idempotency_key": lambda v, _now: _idempotency_key(v),
    "singleton_key": lambda v, _now: _key(v, "singleton_key"),
    "group_key": lambda v, _now: _key(v, "group_key"),
    "queue_policy": lambda v, _now: _policy(v),
    "secret_payload": lambda v, _now: _bool(v, "secret_payload"),
    "priority": lambda v, _now: _int(v, "priority", 0, MAX_PRIORITY),
    "start_after": _start_after,
    "retry_limit": lambda v, _now: _int(v, "retry_limit", 0),
    "retry_delay": lambda v, _now: _seconds(v, "retry_delay", MAX_RETRY_DELAY_SECONDS),
    "retry_backoff": lambda v, _now: _bool(v, "retry_backoff"),
    "expire_in_seconds": lambda v, _now: _int(v, "expire_in_seconds", 1, MAX_EXPIRE_IN_SECONDS),
    "queue": lambda v, _now: _queue(v),
    "debounce_seconds": lambda v, _now: _positive_seconds(v, "debounce_seconds"),
    "debounce_max_seconds": lambda v, _now: _positive_seconds(v, "debounce_max_seconds"),
    "throttle_seconds": lambda v, _now: _positive_seconds(v, "throttle_seconds"),
    "headers": lambda v, _now: _headers(v),
}
