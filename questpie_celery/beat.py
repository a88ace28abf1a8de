"""`LedgerScheduler`: Celery beat's scheduler, backed by the ledger.

`Questpie` makes it the app's `beat_scheduler`, so plain `celery -A proj beat` runs
both kinds of schedule:

- questpie schedules (`schedule()` and `options={"cron": ...}`), read from the ledger
  every pass, so a change made by any process is picked up within a second;
- the app's own `beat_schedule` entries, as Celery's scheduler runs them, except that
  each tick is claimed in the ledger first, so of several beats one sends it.

A tick must have the same name in every beat, whenever each beat gets to it:

- a crontab (or solar) tick is named by the minute it fell due, worked out from the
  entry's last run, so a beat that runs it late names it as the punctual one did;
- an interval entry runs at the multiples of its interval (since the Unix epoch, UTC),
  so all beats fall due together whenever each started, and a tick is named by its
  multiple. A 30-second entry runs at :00 and :30; an hourly one on the hour.

So any number of beats may run against one ledger, and that is the high-availability
setup: when one dies, the next tick still fires from another, on time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import schedule as interval_schedule
from celery.schedules import solar

from ._runtime.outages import Outage
from .app import Questpie, questpie_of
from .errors import ConfigurationError, LedgerUnavailableError, QuestpieError

log = logging.getLogger(__name__)

#: The longest beat sleeps between two looks at the ledger's schedules.
LOOK_EVERY_SECONDS = 1.0
#: How often a beat tries again to store the jobs' `options.cron` schedules, while the
#: ledger could not be reached when it started.
SYNC_RETRY_SECONDS = 30.0
#: Entry names longer than this are claimed under a digest (the column's width).
MAX_ENTRY_NAME = 200


class LedgerScheduler(Scheduler):  # type: ignore[misc]  # Celery ships no type hints
    """Celery beat's scheduler with questpie schedules and one send per tick."""

    def __init__(self, app: Celery, *args: Any, **kwargs: Any) -> None:
        questpie = questpie_of(app)
        if questpie is None:
            raise ConfigurationError(
                "questpie_celery.beat:LedgerScheduler needs a Questpie made for this Celery "
                "app in the module `celery -A` imports"
            )
        self._questpie: Questpie = questpie
        self._unreadable = Outage(
            "questpie schedules", trouble="cannot be read", recovered="can be read again"
        )
        self._synced = False
        self._failing = False
        self._last_sync_try = float("-inf")
        super().__init__(app, *args, **kwargs)
        # Celery's default loop sleeps up to 300 s; schedules changed elsewhere and ticks
        # of other beats' entries must be seen sooner.
        configured = float(vars(self).get("max_interval") or LOOK_EVERY_SECONDS)
        self.max_interval = min(configured, LOOK_EVERY_SECONDS)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        # Celery's heap asks each entry itself when it is due first: give interval entries
        # the last run their current multiple implies, so the first run is at the next.
        for entry in self.schedule.values():
            _align(entry)
            _report_unsendable(self.app, entry)
        self._sync_job_schedules()

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        new_entry: ScheduleEntry = super().reserve(entry)
        _align(new_entry)
        return new_entry

    def _sync_job_schedules(self) -> None:
        self._last_sync_try = time.monotonic()
        self._synced = self._questpie.sync_job_schedules()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay: float = super().tick(*args, **kwargs)
        if not self._synced and time.monotonic() - self._last_sync_try >= SYNC_RETRY_SECONDS:
            self._sync_job_schedules()
        try:
            until_next = self._questpie.schedules.fire_due()
        except LedgerUnavailableError as exc:
            # Told by the ledger's outage line: once, each minute while it lasts, and when
            # it is back (not once a second).
            self._questpie._ledger_outage.failed(exc)
            until_next = LOOK_EVERY_SECONDS
        except QuestpieError as exc:
            self._unreadable.failed(exc)  # a ledger not migrated, say: the same cadence
            until_next = LOOK_EVERY_SECONDS
        except Exception:
            # Whatever went wrong, beat must live on: its other entries depend on it. One
            # traceback, not one a second, until a pass succeeds again.
            if not self._failing:
                log.exception("questpie schedules failed unexpectedly; trying again each second")
            self._failing = True
            until_next = LOOK_EVERY_SECONDS
        else:
            self._failing = False
            self._questpie._ledger_outage.reached()
            self._unreadable.reached()
        self._questpie._ledger_idle()  # a tick is a unit of work (Django's CONN_MAX_AGE)
        return min(delay, until_next, LOOK_EVERY_SECONDS)

    def is_due(self, entry: ScheduleEntry) -> tuple[bool, float]:
        """Interval entries fall due at the multiples of their interval, in every beat."""
        seconds = _interval_seconds(entry)
        if seconds is None:
            due: tuple[bool, float] = super().is_due(entry)
            return due
        now = datetime.now(UTC).timestamp()
        last = entry.last_run_at.timestamp() if entry.last_run_at else now
        # A little past the multiple: Celery wakes 10 ms early, and a check that lands
        # just before the multiple must not come back at once, again and again.
        until_next = seconds - now % seconds + 0.02
        return math.floor(now / seconds) > math.floor(last / seconds), until_next

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send a due `beat_schedule` entry if this beat is the first to claim its tick."""
        tick = tick_name(entry, datetime.now(UTC))
        name = entry.name
        if len(name) > MAX_ENTRY_NAME:
            name = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
        try:
            claimed = self._questpie.schedules.claim_beat_tick(name, tick)
        except QuestpieError as exc:
            log.error(  # noqa: TRY400  (a known, translated error: no traceback needed)
                "beat entry %s skipped its %s tick: the ledger could not be reached to "
                "claim it (%s)",
                entry.name,
                tick,
                exc,
            )
            return
        if not claimed:
            log.debug("beat entry %s: another beat sent its %s tick", entry.name, tick)
            return
        super().apply_entry(entry, producer=producer)


def _report_unsendable(app: Celery, entry: ScheduleEntry) -> None:
    """Log, once as beat starts, an entry naming a job's task that every tick would send
    with no payload: its task takes one positional argument, the payload (`args=[{}]`)."""
    task = app.tasks.get(entry.task)
    mistake = getattr(task, "payload_mistake", None)
    if mistake is None:
        return
    why = mistake(entry.args, entry.kwargs)
    if why is not None:
        log.error("beat entry %r: %s; every tick of it would fail at the worker", entry.name, why)


def _interval_seconds(entry: ScheduleEntry) -> float | None:
    schedule = entry.schedule
    if type(schedule) is interval_schedule:
        seconds = float(schedule.run_every.total_seconds())
        return seconds if seconds > 0 else None
    return None


def _align(entry: ScheduleEntry) -> None:
    """Set an interval entry's last run to the start of its current multiple."""
    seconds = _interval_seconds(entry)
    if seconds is not None:
        now = datetime.now(UTC).timestamp()
        entry.last_run_at = datetime.fromtimestamp(math.floor(now / seconds) * seconds, UTC)


def tick_name(entry: ScheduleEntry, now: datetime) -> str:
    """What names one tick of an entry, the same in every beat: its interval's multiple,
    the day of a solar event, or the minute a crontab tick fell due in."""
    seconds = _interval_seconds(entry)
    if seconds is not None:
        return f"every {seconds:g}s #{math.floor(now.timestamp() / seconds)}"
    schedule = entry.schedule
    due = now
    if entry.last_run_at is not None and hasattr(schedule, "remaining_estimate"):
        try:
            # When it fell due, from its last run, not when this beat got to it; in UTC,
            # since adding to a local time near a daylight-saving change is wall-clock
            # arithmetic.
            started = schedule.maybe_make_aware(schedule.now()).astimezone(UTC)
            due = started + schedule.remaining_estimate(entry.last_run_at)
        except Exception:  # a schedule of the user's own: fall back to now
            log.debug("no due time for %s; naming its tick by now", entry.name, exc_info=True)
    if type(schedule) is solar:
        # One event a day: its moment moves by a fraction of a second with the last run.
        return f"{schedule.event} {due:%Y-%m-%d}"
    due = (due + timedelta(seconds=30)).replace(second=0, microsecond=0)
    return f"{due:%Y-%m-%dT%H:%M}Z"
