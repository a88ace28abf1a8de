"""Retention: what the ledger keeps of a dispatch once it has ended.

An ended dispatch (completed or failed) is never sent again, so after the retention
period (`Questpie(retention=...)`, 7 days by default; None keeps everything):

- an unkeyed one is deleted: nothing can ask for its id again. Not before
  `redeliver_after` has passed since it ended (never less than the broker's visibility
  timeout), though, whatever the period: a plain Celery call of a policy job is taken
  into the ledger under its message's id, and a copy of that message the broker hands
  out again (Redis past its visibility timeout, RabbitMQ requeueing an unacknowledged
  one) is refused only while the row is there to say it ran;
- a keyed one keeps its id, job, key, status and times, so a publish of the same key
  still gets the same id back and runs nothing, and loses its payload and its options
  (the row is `pruned`); a pruned failed dispatch cannot be requeued.

A row that has not ended is never touched, whatever its age. Schedule fires (keyed
`questpie-schedule:...`) are left to the beat, which deletes them after its own
`fire_retention`: one owner per row, so the two periods never contend.

Every running relay does this now and then (`every` seconds), in batches of `batch`
rows per statement for at most `budget` seconds, pausing between batches as long as the
last one took, so writers waiting for the database (SQLite has one writer) get their
turn. `questpie-celery prune` does it on demand, until nothing is left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import LedgerSchemaError, QuestpieError
from ..jobs.options import FIRE_KEY_PREFIX
from ..ledger import Ledger
from ..send.outbox import DEFAULT_REDELIVER_AFTER_SECONDS

log = logging.getLogger(__name__)

DEFAULT_RETENTION_SECONDS = 7 * 86400.0
#: How often a relay applies retention, and for how long at most each time.
RETENTION_EVERY_SECONDS = 60.0
RETENTION_BUDGET_SECONDS = 0.5
#: Rows per statement: each statement locks only its own rows, for tens of milliseconds.
RETENTION_BATCH = 1000
#: A rate permit unused this long (twice the longest window, an hour) holds nothing.
SPENT_PERMIT_SECONDS = 7200.0
#: A throttle window open again this long takes a publish as no window would: deleted.
SPENT_WINDOW_SECONDS = 3600.0
#: How often a relay tries again on a ledger whose schema is older than retention needs.
RETENTION_RETRY_SECONDS = 300.0


@dataclass(frozen=True)
class Pruned:
    """What one retention run removed."""

    deleted: int  # ended unkeyed dispatches, deleted
    pruned: int  # ended keyed dispatches, their payload and options dropped
    done: bool  # nothing more was due (False: the time budget ended the run first)


class Retention:
    def __init__(
        self,
        ledger: Ledger,
        period: float | None,
        *,
        redeliver_after: Callable[[], float] = lambda: DEFAULT_REDELIVER_AFTER_SECONDS,
    ) -> None:
        self._ledger_retention = ledger.retention
        self._limits = ledger.limits  # spent rate permits
        self._throttle = ledger.throttle  # long-open throttle windows
        self._canvases = ledger.canvases  # chords and batches long ended
        self.period = period
        #: How long after its end a message of an unkeyed dispatch may still come again.
        self._redeliver_after = redeliver_after
        self._next_run = 0.0  # monotonic; 0: at the relay's first pass
        self._warned = False

    def prune(
        self,
        older_than: float,
        *,
        budget: float | None = None,
        batch: int = RETENTION_BATCH,
    ) -> Pruned:
        """Delete or prune what ended over `older_than` seconds ago, batch after batch,
        until none is left or `budget` seconds have passed. An unkeyed dispatch is
        deleted only once `redeliver_after` has passed as well."""
        started = time.monotonic()
        since = {False: max(older_than, self._redeliver_after()), True: older_than}
        deleted = pruned = 0
        left = {False: True, True: True}  # keyed -> a batch may remain
        while any(left.values()):
            for keyed in (False, True):
                if not left[keyed]:
                    continue
                began = time.monotonic()
                count = self._ledger_retention.prune_ended(
                    keyed=keyed,
                    older_than=since[keyed],
                    limit=batch,
                    spare_key_prefix=FIRE_KEY_PREFIX,
                )
                took = time.monotonic() - began
                if keyed:
                    pruned += count
                else:
                    deleted += count
                left[keyed] = count >= batch
                if budget is not None and time.monotonic() - started + took >= budget:
                    return Pruned(deleted, pruned, done=not any(left.values()))
                if any(left.values()):
                    time.sleep(took)  # leave the database to others as long again
        self._prune_canvases(older_than, batch)
        return Pruned(deleted, pruned, done=True)

    def _prune_canvases(self, older_than: float, batch: int) -> None:
        try:
            self._canvases.prune_ended(older_than=older_than, limit=batch)
        except QuestpieError as exc:  # a schema before version 9 included
            log.debug("chords and batches not pruned (%s); trying again later", exc)

    def _prune_permits(self) -> None:
        try:
            self._limits.prune_permits(older_than=SPENT_PERMIT_SECONDS, limit=RETENTION_BATCH)
        except QuestpieError as exc:  # a schema before version 6 included
            log.debug("rate permits not pruned (%s); trying again later", exc)
        try:
            self._throttle.prune_windows(older_than=SPENT_WINDOW_SECONDS)
        except QuestpieError as exc:  # a schema before version 7 included
            log.debug("throttle windows not pruned (%s); trying again later", exc)

    def now_and_then(self) -> None:
        """The relay's retention step: at most every `RETENTION_EVERY_SECONDS`, within
        `RETENTION_BUDGET_SECONDS`. Never raises: a failure waits for the next time.

        Rate permits unused for longer than any window, and throttle windows open again
        for an hour, are deleted too, whatever the period (they are no history: a
        group's next start, a key's next publish, makes them again)."""
        if time.monotonic() < self._next_run:
            return
        self._next_run = time.monotonic() + RETENTION_EVERY_SECONDS
        self._prune_permits()
        if self.period is None:
            return
        try:
            result = self.prune(self.period, budget=RETENTION_BUDGET_SECONDS)
        except LedgerSchemaError as exc:
            self._next_run = time.monotonic() + RETENTION_RETRY_SECONDS
            if not self._warned:
                self._warned = True
                log.warning("ended dispatches are kept until the ledger is migrated: %s", exc)
            return
        except QuestpieError as exc:
            log.info("retention could not run (%s); trying again later", exc)
            return
        if result.deleted or result.pruned:
            log.info(
                "retention: deleted %d ended unkeyed dispatch(es), pruned %d keyed one(s) "
                "that ended over %.0f s ago%s",
                result.deleted,
                result.pruned,
                self.period,
                "" if result.done else "; more next time",
            )
        if not result.done:
            # A backlog (retention just turned on, say): come back sooner than usual, but
            # still leave the relay most of its time.
            self._next_run = time.monotonic() + RETENTION_EVERY_SECONDS / 6
