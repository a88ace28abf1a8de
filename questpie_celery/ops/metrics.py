"""The ledger's figures for Prometheus, served by `questpie-celery web` at `/metrics`.

Read once per scrape through the operator (the reads behind the status page), and turned
into gauges by a collector: dispatch counts are gauges, not counters, because retention
deletes rows and a count goes down. The names and labels are listed in
docs/operations.md. Nothing here names a dispatch, a key or a payload: the labels are job
names, statuses and stuck reasons only.

It needs the `web` extra (prometheus_client).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import get_args

from prometheus_client.core import GaugeMetricFamily, Metric

from ..errors import LedgerSchemaError
from ..ledger import Status
from ..ledger.schema import WAITING
from ..ledger.views import STUCK_COUNT_CAP, STUCK_REASONS
from .operations import JobCount, Operator, StuckCount

STATUSES: tuple[str, ...] = get_args(Status)


@dataclass(frozen=True)
class Figures:
    """One scrape's reading of the ledger."""

    counts: list[JobCount]
    stuck: list[StuckCount]
    #: The relay's newest backlog sample (sampled_at, due) of the last hour; None when
    #: no relay sampled in that hour, or the ledger's schema predates the samples.
    backlog: tuple[datetime, int] | None


def read_figures(operator: Operator) -> Figures:
    try:
        samples = operator.backlog()
    except LedgerSchemaError:  # a ledger of schema version 2: the rest still reads
        samples = []
    return Figures(
        counts=operator.counts(),
        stuck=operator.stuck_counts(),
        backlog=samples[-1] if samples else None,
    )


class LedgerCollector:
    """A prometheus_client collector of the figures `read` returns (None: the ledger
    could not be read, and only `questpie_ledger_up 0` is served)."""

    def __init__(self, read: Callable[[], Figures | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        figures = self._read()
        yield GaugeMetricFamily(
            "questpie_ledger_up",
            "1 when this scrape read the ledger, 0 when it was unreachable or did not answer "
            "in time (then no other questpie_ figure is served).",
            value=0 if figures is None else 1,
        )
        if figures is None:
            return
        yield from _dispatch_figures(figures)
        if figures.backlog is not None:
            sampled_at, due = figures.backlog
            yield GaugeMetricFamily(
                "questpie_relay_backlog",
                "Dispatches due for the relay to send, as a running relay last sampled it "
                "(about twice a minute).",
                value=due,
            )
            yield GaugeMetricFamily(
                "questpie_relay_backlog_sampled_timestamp_seconds",
                "When the newest backlog sample was taken (Unix time, the database's clock); "
                "absent when no relay sampled in the last hour.",
                value=sampled_at.timestamp(),
            )


def _dispatch_figures(figures: Figures) -> Iterator[Metric]:
    # Every job the ledger holds gets every status and every reason, zeros included, so a
    # series does not vanish when its count drops to zero (alerts and rates need it there).
    jobs = sorted({c.job_name for c in figures.counts} | {s.job_name for s in figures.stuck})
    count = {(c.job_name, c.status): c for c in figures.counts}

    dispatches = GaugeMetricFamily(
        "questpie_dispatches",
        "Ledgered dispatches the ledger holds, per job and status.",
        labels=["job", "status"],
    )
    waiting = GaugeMetricFamily(
        "questpie_dispatches_waiting",
        "Dispatches waiting to run (pending, queued or parked), per job.",
        labels=["job"],
    )
    oldest = GaugeMetricFamily(
        "questpie_oldest_waiting_seconds",
        "How long the longest-waiting dispatch of the job has been due to run (0 when none "
        "that is due waits; a far-off start counts from its start).",
        labels=["job"],
    )
    parked = GaugeMetricFamily(
        "questpie_parked_runs",
        "Runs parked until their queue-policy slot frees, per job.",
        labels=["job"],
    )
    parked_age = GaugeMetricFamily(
        "questpie_parked_oldest_age_seconds",
        "Age of the job's oldest parked run, since it was published (0 when none is parked).",
        labels=["job"],
    )
    for job in jobs:
        for status in STATUSES:
            found = count.get((job, status))
            dispatches.add_metric([job, status], found.count if found else 0)
        of_job = [c for c in figures.counts if c.job_name == job]
        waits = [c for c in of_job if c.status in WAITING]
        waiting.add_metric([job], sum(c.count for c in waits))
        due_since = [c.oldest_due_seconds for c in waits if c.oldest_due_seconds is not None]
        oldest.add_metric([job], max(due_since, default=0.0))
        held = count.get((job, "parked"))
        parked.add_metric([job], held.count if held else 0)
        parked_age.add_metric([job], held.oldest_age_seconds if held else 0.0)

    stuck = GaugeMetricFamily(
        "questpie_dispatches_stuck",
        "Dispatches that should have moved on and did not, per job and reason (as "
        f"`questpie-celery dispatches stuck` lists them); each reason counts up to "
        f"{STUCK_COUNT_CAP}.",
        labels=["job", "reason"],
    )
    stuck_count = {(s.job_name, s.reason): s.count for s in figures.stuck}
    for job in jobs:
        for reason in STUCK_REASONS:
            stuck.add_metric([job, reason], stuck_count.get((job, reason), 0))
    yield from (dispatches, waiting, oldest, stuck, parked, parked_age)
