"""Cron expressions: the standard five fields, POSIX semantics, evaluated in a time zone.

The calendar arithmetic is cronsim's, a small maintained library written for a cron
monitoring service (healthchecks.io), which follows cronie, the cron most Linux systems
run. From that library we take:

- when day-of-month and day-of-week are both restricted, a day matching either one
  fires (`0 0 13 * 5` is every 13th and every Friday);
- names (`JAN`, `MON`), ranges, steps, lists, and `7` for Sunday;
- in a daylight-saving gap, a tick whose wall-clock time does not exist fires at the
  first instant after the gap.

What this module adds:

- a tick whose wall-clock time happens twice in a fall-back overlap fires once, at
  its first occurrence;
- only the five POSIX fields are accepted. cronsim's extensions (`L`, `W`, `#`, `?`, a
  sixth field for seconds, `@daily`) are refused, so an expression means the same in
  every cron a person already knows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ..errors import PublishOptionsError

_VALUE = r"(?:\d{1,2}|[A-Za-z]{3})"
_ITEM = rf"(?:\*|{_VALUE}(?:-{_VALUE})?)(?:/\d{{1,2}})?"
_FIELD = re.compile(rf"{_ITEM}(?:,{_ITEM})*")
MAX_CRON_LENGTH = 200


@dataclass(frozen=True)
class Cron:
    """A validated cron expression and the zone it is read in."""

    expression: str
    tz: str

    @classmethod
    def parse(cls, expression: object, tz: object = None) -> Cron:
        """Validate; raises `PublishOptionsError` saying what is wrong."""
        zone_name = "UTC" if tz is None else tz
        if not isinstance(zone_name, str) or not zone_name or "\x00" in zone_name:
            raise PublishOptionsError("tz must be an IANA time zone name such as 'Europe/Prague'")
        try:
            ZoneInfo(zone_name)
        except (ZoneInfoNotFoundError, ValueError):
            raise PublishOptionsError(
                f"tz {zone_name[:64]!r} is not an IANA time zone name (such as 'Europe/Prague')"
            ) from None
        if not isinstance(expression, str):
            raise PublishOptionsError(f"cron must be a str, got {type(expression).__name__}")
        fields = expression.split()
        if len(expression) > MAX_CRON_LENGTH or len(fields) != 5:
            raise PublishOptionsError(
                "cron must have five fields: minute hour day-of-month month day-of-week "
                "(for example '0 6 * * *')"
            )
        for name, field in zip(
            ("minute", "hour", "day-of-month", "month", "day-of-week"), fields, strict=True
        ):
            if not _FIELD.fullmatch(field):
                raise PublishOptionsError(f"cron {name} field {field!r} is not standard cron")
        normalised = " ".join(fields)
        try:
            CronSim(normalised, datetime.now(UTC))
        except CronSimError as exc:
            raise PublishOptionsError(f"cron {normalised!r} is invalid: {exc}") from None
        return cls(normalised, zone_name)

    def next_after(self, instant: datetime) -> datetime:
        """The first tick strictly after `instant` (an aware datetime), in UTC."""
        return next(self._ticks(instant))

    def _ticks(self, instant: datetime) -> Iterator[datetime]:
        zone = ZoneInfo(self.tz)
        # Compared in UTC: two datetimes in one zone compare by wall clock, blind to fold.
        after = instant.astimezone(UTC)
        local = after.astimezone(zone)
        for tick in CronSim(self.expression, local):
            # The second occurrence of a wall-clock time repeated by a fall-back overlap
            # is the same tick again: skip it.
            if tick.fold == 1 and tick.replace(fold=0).utcoffset() != tick.utcoffset():
                continue
            # Asked from inside an overlap, cronsim may answer with the first occurrence
            # of a wall-clock time that is already past: never go back in time.
            if tick.astimezone(UTC) <= after:
                continue
            yield tick.astimezone(UTC)
