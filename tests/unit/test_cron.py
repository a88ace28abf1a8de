"""Cron semantics against known calendars, with the clock passed in: POSIX's OR of the two
day fields, names, steps, lists, 7 for Sunday, zones, and both daylight-saving changes."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from questpie_celery import PublishOptionsError
from questpie_celery.jobs.cron import Cron


def ticks(expression: str, start: datetime, count: int, tz: str = "UTC") -> list[str]:
    cron = Cron.parse(expression, tz)
    zone = ZoneInfo(tz)
    found, at = [], start
    for _ in range(count):
        at = cron.next_after(at)
        assert at.tzinfo is UTC
        found.append(at.astimezone(zone).strftime("%Y-%m-%d %a %H:%M %z"))
    return found


def test_day_of_month_or_day_of_week_when_both_are_restricted() -> None:
    # November 2026: Fridays are the 6th, 13th (also a 13th), 20th, 27th.
    assert ticks("0 0 13 * FRI", datetime(2026, 11, 1, tzinfo=UTC), 5) == [
        "2026-11-06 Fri 00:00 +0000",
        "2026-11-13 Fri 00:00 +0000",
        "2026-11-20 Fri 00:00 +0000",
        "2026-11-27 Fri 00:00 +0000",
        "2026-12-04 Fri 00:00 +0000",
    ]
    # Only one day field restricted: it alone decides.
    assert ticks("0 0 13 * *", datetime(2026, 11, 1, tzinfo=UTC), 2) == [
        "2026-11-13 Fri 00:00 +0000",
        "2026-12-13 Sun 00:00 +0000",
    ]


def test_seven_and_zero_are_both_sunday_and_names_work() -> None:
    start = datetime(2026, 11, 30, tzinfo=UTC)  # a Monday
    assert ticks("30 8 * * 7", start, 1) == ticks("30 8 * * 0", start, 1)
    assert ticks("30 8 * * 7", start, 1) == ["2026-12-06 Sun 08:30 +0000"]
    assert ticks("0 9 1 jan-mar MON-FRI", start, 2) == [
        "2027-01-01 Fri 09:00 +0000",
        "2027-01-04 Mon 09:00 +0000",
    ]


def test_steps_ranges_and_lists() -> None:
    start = datetime(2026, 11, 30, 10, 7, tzinfo=UTC)
    assert ticks("*/20 10-11 * * *", start, 4) == [
        "2026-11-30 Mon 10:20 +0000",
        "2026-11-30 Mon 10:40 +0000",
        "2026-11-30 Mon 11:00 +0000",
        "2026-11-30 Mon 11:20 +0000",
    ]
    assert ticks("5,50 */12 * * *", start, 3) == [
        "2026-11-30 Mon 12:05 +0000",
        "2026-11-30 Mon 12:50 +0000",
        "2026-12-01 Tue 00:05 +0000",
    ]


def test_the_next_tick_is_strictly_after_the_instant() -> None:
    at = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)
    assert Cron.parse("0 6 * * *").next_after(at) == datetime(2026, 12, 1, 6, 0, tzinfo=UTC)


def test_a_zone_moves_the_tick() -> None:
    assert ticks("0 6 * * *", datetime(2026, 11, 30, tzinfo=UTC), 1, "Europe/Prague") == [
        "2026-11-30 Mon 06:00 +0100"
    ]
    assert Cron.parse("0 6 * * *", "Europe/Prague").next_after(
        datetime(2026, 11, 30, tzinfo=UTC)
    ) == datetime(2026, 11, 30, 5, 0, tzinfo=UTC)


def test_spring_forward_gap_fires_at_the_next_valid_instant() -> None:
    # 2026-03-29 in Prague: 02:00 jumps to 03:00, so 02:30 does not exist that day.
    assert ticks("30 2 * * *", datetime(2026, 3, 28, 3, 0, tzinfo=UTC), 3, "Europe/Prague") == [
        "2026-03-29 Sun 03:00 +0200",
        "2026-03-30 Mon 02:30 +0200",
        "2026-03-31 Tue 02:30 +0200",
    ]
    # New York, 2026-03-08: hourly ticks skip the missing hour, none is lost or doubled.
    assert ticks("0 * * * *", datetime(2026, 3, 8, 5, 30, tzinfo=UTC), 3, "America/New_York") == [
        "2026-03-08 Sun 01:00 -0500",
        "2026-03-08 Sun 03:00 -0400",
        "2026-03-08 Sun 04:00 -0400",
    ]


def test_fall_back_overlap_fires_once() -> None:
    # 2026-10-25 in Prague: 03:00 goes back to 02:00, so 02:00-02:59 happens twice.
    assert ticks("30 2 * * *", datetime(2026, 10, 24, 12, 0, tzinfo=UTC), 2, "Europe/Prague") == [
        "2026-10-25 Sun 02:30 +0200",
        "2026-10-26 Mon 02:30 +0100",
    ]
    # Every 20 minutes through the repeated hour in New York (2026-11-01): each wall-clock
    # tick once, the first time it happens.
    assert ticks(
        "*/20 1 * * *", datetime(2026, 11, 1, 4, 0, tzinfo=UTC), 4, "America/New_York"
    ) == [
        "2026-11-01 Sun 01:00 -0400",
        "2026-11-01 Sun 01:20 -0400",
        "2026-11-01 Sun 01:40 -0400",
        "2026-11-02 Mon 01:00 -0500",
    ]
    # Asked from inside the second occurrence: the tick already fired in the first one.
    inside = datetime(2026, 11, 1, 6, 10, tzinfo=UTC)  # 01:10 -0500, the repeat
    assert ticks("*/20 1 * * *", inside, 1, "America/New_York") == ["2026-11-02 Mon 01:00 -0500"]


@pytest.mark.parametrize(
    ("tz", "expression", "inside"),
    [
        # Prague, 2026-10-25: 02:00-02:59 happens twice; 01:00:30Z is 02:00:30 the second time.
        ("Europe/Prague", "30 2 * * *", datetime(2026, 10, 25, 1, 0, 30, tzinfo=UTC)),
        ("Europe/Prague", "30 2 * * *", datetime(2026, 10, 25, 1, 10, tzinfo=UTC)),
        # New York, 2026-11-01: 06:10Z is 01:10 the second time.
        ("America/New_York", "30 1 * * *", datetime(2026, 11, 1, 6, 10, tzinfo=UTC)),
        ("America/New_York", "*/20 * * * *", datetime(2026, 11, 1, 6, 10, tzinfo=UTC)),
    ],
)
def test_asked_from_inside_an_overlap_the_next_tick_is_never_in_the_past(
    tz: str, expression: str, inside: datetime
) -> None:
    cron = Cron.parse(expression, tz)
    # Asked in UTC or in the zone itself (where one wall-clock time may be two instants).
    assert cron.next_after(inside.astimezone(ZoneInfo(tz))) == cron.next_after(inside)
    at = inside
    for _ in range(5):
        following = cron.next_after(at)
        assert following > at
        at = following


@pytest.mark.parametrize(
    "expression",
    ["", "* * * *", "* * * * * *", "61 * * * *", "0 0 L * *", "0 0 * * 5#2", "@daily",
     "0 0 ? * *", "0 0 15W * *", "0 25 * * *", "0 0 * 13 *", "0 0 * * 8", "a b c d e"],
)  # fmt: skip
def test_anything_but_standard_five_field_cron_is_refused(expression: str) -> None:
    with pytest.raises(PublishOptionsError) as raised:
        Cron.parse(expression)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("tz", ["Mars/Olympus", "", "UTC\x00", "../../etc/passwd", 5])
def test_a_zone_must_be_an_iana_name(tz: object) -> None:
    with pytest.raises(PublishOptionsError, match="tz"):
        Cron.parse("0 6 * * *", tz)
