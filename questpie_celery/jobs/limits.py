"""Flow-control limits of a job: how many of its runs may be active at once
(`concurrency_limit`) and how many may start in a window (`rate_limit`), counted per
`group_key` when a dispatch has one, else for the job as a whole.

Both are enforced by the ledger for every worker on it, not by one worker's memory, so
they differ from Celery's own `rate_limit` (per worker process, per task type).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import PublishOptionsError

#: Upper bounds that keep the ledger's seat tables small: a limit above these is no limit.
MAX_CONCURRENCY_LIMIT = 10_000
MAX_RATE_COUNT = 10_000

_RATE = re.compile(r"([0-9]+)/([smh])")
_WINDOWS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Rate:
    """At most `count` runs started in any window of `per_seconds`."""

    count: int
    per_seconds: float

    @classmethod
    def parse(cls, value: object) -> Rate:
        """`"10/s"`, `"100/m"` or `"1000/h"`; anything else is a `PublishOptionsError`."""
        match = _RATE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise PublishOptionsError(
                'rate_limit must be a string "N/s", "N/m" or "N/h" with N an integer >= 1'
            )
        count = int(match.group(1))
        if not 1 <= count <= MAX_RATE_COUNT:
            raise PublishOptionsError(f"rate_limit's N must be from 1 to {MAX_RATE_COUNT}")
        return cls(count, _WINDOWS[match.group(2)])


def concurrency(value: object) -> int:
    """A validated `concurrency_limit`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PublishOptionsError(f"concurrency_limit must be an int, got {type(value).__name__}")
    if not 1 <= value <= MAX_CONCURRENCY_LIMIT:
        raise PublishOptionsError(f"concurrency_limit must be from 1 to {MAX_CONCURRENCY_LIMIT}")
    return value


@dataclass(frozen=True)
class Limits:
    """A job's limits, from its options; both None for a job without any."""

    concurrency: int | None = None
    rate: Rate | None = None

    @classmethod
    def of(cls, options: dict[str, Any] | Any) -> Limits:
        """The limits a job's (validated) options declare."""
        limit = options.get("concurrency_limit")
        rate = options.get("rate_limit")
        return cls(
            concurrency=None if limit is None else concurrency(limit),
            rate=None if rate is None else Rate.parse(rate),
        )

    @property
    def active(self) -> bool:
        """Every dispatch of the job needs a ledger row: its runs are counted there."""
        return self.concurrency is not None or self.rate is not None


NO_LIMITS = Limits()


def group_of(group_key: str | None) -> str:
    """The group a run counts against: its `group_key`, or "" for the job as a whole."""
    return group_key or ""
