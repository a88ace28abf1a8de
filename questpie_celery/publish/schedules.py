"""Schedules in the ledger: `schedule()`, `unschedule()`, a job's `options={"cron": ...}`,
and firing the ticks that have come.

A fire is an ordinary keyed dispatch. Its idempotency key names the schedule's source
and the tick (`questpie-schedule:call:2026-11-30T06:00:00Z`), so however many beats fire
the same tick, the ledger's insert-or-nothing accepts one dispatch. The beat that fired
a tick moves the schedule on to its next tick with an update conditional on the tick it
read, so the schedule advances once too. A beat that dies between the two leaves the
tick for the next beat, which finds the dispatch already made under the same key.

A schedule that missed several ticks (every beat was down) fires once, for the first
missed tick, and moves on to the next tick after now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from ..errors import (
    LedgerUnavailableError,
    PayloadValidationError,
    PublishOptionsError,
    QuestpieError,
)
from ..jobs.cron import Cron
from ..jobs.definition import JobDefinition
from ..jobs.options import FIRE_KEY_PREFIX, DispatchOptions, resolve_options
from ..ledger import Ledger, ScheduleRow, Status
from .publisher import Publisher

log = logging.getLogger(__name__)

#: Ended fire dispatches are deleted this long after they ended (a past tick never fires
#: again, so nothing can ask for its key any more).
DEFAULT_FIRE_RETENTION_SECONDS = 7 * 86400.0
#: The most ticks one beat fires in one pass; the rest come in the next pass at once.
FIRES_PER_PASS = 500
#: How often a beat deletes spent fire rows, in batches, for at most a second each time.
PRUNE_EVERY_SECONDS = 60.0
PRUNE_BATCH = 1000
PRUNE_BUDGET_SECONDS = 1.0

#: How long a beat leaves alone a schedule that failed to fire with an unexpected error.
RETRY_FAILED_ROW_SECONDS = 300.0

#: Options a schedule cannot take: a fire's key, start and secrecy are its own.
REFUSED_OPTIONS = ("idempotency_key", "start_after", "secret_payload")


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as `questpie-celery schedules` and the status page show it."""

    job_name: str
    source: str  # "call" (schedule()) or "option" (the job's options.cron)
    cron: str
    tz: str
    next_fire_at: datetime
    last_fire_at: datetime | None
    last_dispatch_id: str | None
    last_status: Status | None  # of the dispatch the last fire made (None: none, or pruned)


def schedule_infos(ledger: Ledger) -> list[ScheduleInfo]:
    """Every schedule of the ledger, by job."""
    return [
        ScheduleInfo(
            job_name=row.job_name,
            source=row.source,
            cron=row.cron,
            tz=row.tz,
            next_fire_at=row.next_fire_at,
            last_fire_at=row.last_fire_at,
            last_dispatch_id=row.last_dispatch_id,
            last_status=status,
        )
        for row, status in ledger.schedules.listed()
    ]


def fire_key(row: ScheduleRow) -> str:
    return f"{FIRE_KEY_PREFIX}{row.source}:{row.next_fire_at:%Y-%m-%dT%H:%M:%SZ}"


class Schedules:
    """The schedules of one ledger, and firing them."""

    def __init__(
        self,
        ledger: Ledger,
        publisher: Publisher,
        definition_of: Callable[[str], JobDefinition[Any] | None],
        retention: float = DEFAULT_FIRE_RETENTION_SECONDS,
    ) -> None:
        self._ledger = ledger  # its clock
        self._ledger_schedules = ledger.schedules
        self._ledger_retention = ledger.retention  # spent fires and beat ticks pruned
        self._publisher = publisher
        self._definition_of = definition_of
        self.retention = retention
        #: (job, source) this beat cannot fire, until when (monotonic): for ever for a job
        #: not registered here (another beat may know it), a while for a row that failed.
        self._skipped: dict[tuple[str, str], float] = {}
        self._last_prune = float("-inf")

    # --- changing schedules ----------------------------------------------------------------

    def schedule(
        self,
        definition: JobDefinition[Any],
        payload: Any,
        cron: object,
        tz: object,
        options: Mapping[str, Any],
    ) -> None:
        """Validate everything, then store the job's schedule (replacing the one before)."""
        refused = [
            name
            for name in REFUSED_OPTIONS
            if options.get(name) is not None and options.get(name) is not False
        ]
        if refused:
            raise PublishOptionsError(
                f"schedule() does not take {refused[0]}: each fire is its own dispatch, keyed "
                "by its tick, starting at its tick, with a plain payload"
            )
        if definition.has_secret_fields:
            raise PublishOptionsError(
                f"job {definition.name!r} has secret fields, and a schedule's payload is "
                "stored in the ledger as it is: publish with secret_payload instead"
            )
        parsed = Cron.parse(cron, tz)
        body = definition.to_json(payload)
        # A fire starts at its tick: a job's start_after does not delay it.
        resolved = resolve_options(definition.options, options, ignore=("start_after",))
        self._put(definition.name, "call", parsed, body, resolved)

    def unschedule(self, job_name: str) -> None:
        """Remove every schedule of the job (an options.cron one comes back when a worker
        or beat next starts with the job registered)."""
        self._ledger_schedules.delete(job_name)

    def sync_job_options(self, definitions: Mapping[str, JobDefinition[Any]]) -> None:
        """Make the ledger hold each job's `options.cron` schedule, as declared now: add
        the new ones, change the changed ones, remove those whose option was removed.
        Workers and beats call this as they start."""
        stored = {
            row.job_name: row
            for row, _ in self._ledger_schedules.listed()
            if row.source == "option"
        }
        for name, definition in definitions.items():
            expression = definition.options.get("cron")
            if expression is None:
                if name in stored:
                    self._ledger_schedules.delete(name, "option")
                continue
            cron = Cron.parse(expression)
            body = definition.to_json({})
            options = resolve_options(definition.options, {}, ignore=("start_after",))
            existing = stored.get(name)
            if existing is not None and _same(existing, cron, body, options):
                continue  # leave its next tick alone: rewriting it could skip one
            self._put(name, "option", cron, body, options)

    def _put(
        self,
        job_name: str,
        source: Literal["call", "option"],
        cron: Cron,
        body: dict[str, Any],
        options: DispatchOptions,
    ) -> None:
        self._ledger_schedules.put(
            ScheduleRow(
                job_name=job_name,
                source=source,
                cron=cron.expression,
                tz=cron.tz,
                payload=body,
                singleton_key=options.singleton_key,
                group_key=options.group_key,
                options=options.stored(),
                next_fire_at=cron.next_after(self._ledger.now()),
            )
        )

    # --- reading ---------------------------------------------------------------------------

    def list(self) -> list[ScheduleInfo]:
        return schedule_infos(self._ledger)

    # --- firing ----------------------------------------------------------------------------

    def claim_beat_tick(self, entry: str, tick: str) -> bool:
        """Claim one tick of a `beat_schedule` entry; True for exactly one beat."""
        return self._ledger_schedules.claim_beat_tick(entry, tick)

    def fire_due(self) -> float:
        """Fire every tick that has come; return seconds until the next one is due
        (infinity when no schedule exists that this beat can fire)."""
        now, due = self._ledger_schedules.due(FIRES_PER_PASS, self._skipping())
        for row in due:
            assert now is not None
            try:
                self._fire(row, now)
            except LedgerUnavailableError:
                raise  # the ledger went away mid-pass: the caller tells of the outage
            except QuestpieError as exc:
                # The ledger or the broker is down: every beat tries again next pass, and
                # the tick's key keeps it to one dispatch when it succeeds.
                log.warning("schedule of job %s could not fire yet (%s)", row.job_name, exc)
                return 1.0
            except Exception:
                # One bad row (a zone this host's tzdata lacks, say) must not stop the
                # others, nor kill beat: leave it to a beat that can fire it.
                log.exception(
                    "schedule of job %s (from %s) failed to fire in this beat; it is tried "
                    "again in %.0f s, and every other schedule goes on",
                    row.job_name,
                    row.source,
                    RETRY_FAILED_ROW_SECONDS,
                )
                self._skipped[(row.job_name, row.source)] = (
                    time.monotonic() + RETRY_FAILED_ROW_SECONDS
                )
        if len(due) == FIRES_PER_PASS:
            return 0.0
        self._prune_now_and_then()
        upcoming = self._ledger_schedules.next_due(self._skipping())
        if upcoming is None:
            return float("inf")
        return max((upcoming - (now or self._ledger.now())).total_seconds(), 0.0)

    def _fire(self, row: ScheduleRow, now: datetime) -> None:
        definition = self._definition_of(row.job_name)
        if definition is None:
            # Another beat may know the job: leave its ticks to it, and stop looking at
            # them here (a job deleted from the code would otherwise be looked at always).
            for source in ("call", "option"):
                self._skipped[(row.job_name, source)] = float("inf")
            log.warning(
                "job %s has a schedule but is not registered in this beat, so another beat "
                "must fire it; if the job is gone, remove the schedule with "
                "`questpie-celery unschedule %s`",
                row.job_name,
                row.job_name,
            )
            return
        # Work out the next tick before firing this one: a row this host cannot read
        # (an unknown zone) is then refused before it dispatches anything.
        cron = Cron(row.cron, row.tz)
        next_fire_at = cron.next_after(max(now, row.next_fire_at))
        options = DispatchOptions(
            run=row.options.run,
            idempotency_key=fire_key(row),
            singleton_key=row.singleton_key,
            group_key=row.group_key,
            priority=row.options.priority,
            queue=row.options.queue,
        )
        try:
            dispatch_id = self._publisher.publish(definition, row.payload, options)
        except PayloadValidationError as exc:
            # The job's schema changed under a stored payload: skip the tick, loudly.
            log.warning("schedule of job %s skipped its tick: %s", row.job_name, exc)
            dispatch_id = None
        # Missed ticks (every beat was down) fire once: the next tick is after now.
        if self._ledger_schedules.advance(row, next_fire_at, dispatch_id):
            log.info(
                "schedule of job %s fired its %s tick: dispatch %s",
                row.job_name,
                row.next_fire_at.isoformat(),
                dispatch_id or "(suppressed by its queue policy)",
                extra={"job_name": row.job_name, "dispatch_id": dispatch_id},
            )

    def _skipping(self) -> tuple[tuple[str, str], ...]:
        """The (job, source) pairs to leave out of this pass; expired ones are tried again."""
        now = time.monotonic()
        for pair in [pair for pair, until in self._skipped.items() if until <= now]:
            del self._skipped[pair]
        return tuple(sorted(self._skipped))

    def _prune_now_and_then(self) -> None:
        started = time.monotonic()
        if started - self._last_prune < PRUNE_EVERY_SECONDS:
            return
        self._last_prune = started
        pruned = 0
        try:
            # Batch after batch while they come back full, within a time budget: enough to
            # keep up with many frequent schedules without stalling the beat.
            while time.monotonic() - started < PRUNE_BUDGET_SECONDS:
                batch = self._ledger_retention.prune_schedule_history(
                    key_prefix=FIRE_KEY_PREFIX, older_than=self.retention, limit=PRUNE_BATCH
                )
                pruned += batch
                if batch < PRUNE_BATCH:
                    break
        except QuestpieError as exc:
            log.warning("could not prune ended schedule fires (%s); trying again later", exc)
        if pruned:
            log.info("pruned %d ended schedule fire(s) older than %.0f s", pruned, self.retention)


def _same(row: ScheduleRow, cron: Cron, body: dict[str, Any], options: DispatchOptions) -> bool:
    return (
        row.cron == cron.expression
        and row.tz == cron.tz
        and row.payload == body
        and row.singleton_key == options.singleton_key
        and row.group_key == options.group_key
        and row.options == options.stored()
    )
