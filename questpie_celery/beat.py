"""`LedgerScheduler`: Celery beat's scheduler, backed by the ledger.

`Questpie` makes it the app's `beat_scheduler`, so plain `celery -A proj beat` runs
both kinds of schedule:

- questpie schedules (`schedule()` and `options={"cron": ...}`), read from the ledger
  every pass, so a change made by any process is picked up within a second;
- the app's own `beat_schedule` entries, as Celery's scheduler runs them, except that
  each tick is claimed in the ledger first, so of several beats one sends it. A
  crontab (or solar) tick is named by its minute, an interval tick by its slot (the
  time divided by the interval).

So any number of beats may run against one ledger, and that is the high-availability
setup: when one dies, the next tick still fires from another, on time. Entries are not
persisted in a local file: a beat that starts fresh waits one interval before an
interval entry's first run, as Celery's scheduler does for a new entry.
"""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from typing import Any

from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import schedule as interval_schedule

from .app import Questpie, questpie_of
from .errors import ConfigurationError, QuestpieError

log = logging.getLogger(__name__)

#: The longest beat sleeps between two looks at the ledger's schedules.
LOOK_EVERY_SECONDS = 1.0


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
        super().__init__(app, *args, **kwargs)
        # Celery's default loop sleeps up to 300 s; schedules changed elsewhere and ticks
        # of other beats' entries must be seen sooner.
        configured = float(vars(self).get("max_interval") or LOOK_EVERY_SECONDS)
        self.max_interval = min(configured, LOOK_EVERY_SECONDS)

    def setup_schedule(self) -> None:
        super().setup_schedule()
        self._questpie.sync_job_schedules()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        delay: float = super().tick(*args, **kwargs)
        try:
            until_next = self._questpie.schedules.fire_due()
        except QuestpieError as exc:
            log.warning("questpie schedules could not be read (%s); trying again", exc)
            until_next = LOOK_EVERY_SECONDS
        return min(delay, until_next, LOOK_EVERY_SECONDS)

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send a due `beat_schedule` entry if this beat is the first to claim its tick."""
        tick = tick_name(entry, datetime.now(UTC))
        try:
            claimed = self._questpie.schedules.claim_beat_tick(entry.name, tick)
        except QuestpieError as exc:
            log.warning("beat entry %s skipped its %s tick: %s", entry.name, tick, exc)
            return
        if not claimed:
            log.debug("beat entry %s: another beat sent its %s tick", entry.name, tick)
            return
        super().apply_entry(entry, producer=producer)


def tick_name(entry: ScheduleEntry, now: datetime) -> str:
    """What names one tick of an entry, the same in every beat: its interval slot, or
    the minute it fell due in."""
    schedule = entry.schedule
    if type(schedule) is interval_schedule:
        seconds = schedule.run_every.total_seconds()
        if seconds > 0:
            return f"every {seconds:g}s #{math.floor(now.timestamp() / seconds)}"
    return f"{now:%Y-%m-%dT%H:%M}Z"
