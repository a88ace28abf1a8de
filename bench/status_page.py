"""How quickly the status page's data is read from a ledger of a million dispatches.

    .venv/bin/python bench/status_page.py            # starts its own PostgreSQL
    BENCH_ROWS=200000 .venv/bin/python bench/status_page.py

PostgreSQL runs with its default durability. The ledger is filled with BENCH_ROWS rows
by `bench/fixture.py` (one set-based INSERT): 12 jobs over 30 days, mostly completed,
with failed, waiting, running, parked and never-sent ones, as a ledger looks after weeks
of work with retention turned off. Each figure is the median of 7 reads (min-max), beside
its floor measured in the same run: a bare psycopg `count(*)` of the whole table, the
least any per-status count of it can cost.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from sqlalchemy import text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fixture import fill  # noqa: E402
from questpie_celery.ledger import open_ledger  # noqa: E402
from questpie_celery.ops.operations import Operator  # noqa: E402
from questpie_celery.web import render  # noqa: E402
from tests.support.services import PostgresServer  # noqa: E402

ROWS = int(os.environ.get("BENCH_ROWS", "1000000"))
READS = 7


def timed(read: Callable[[], object]) -> tuple[float, float, float]:
    times = []
    for _ in range(READS):
        started = time.perf_counter()
        read()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), min(times), max(times)


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    try:
        url = postgres.create_database("page")
        ledger = open_ledger(url)
        ledger.migration.migrate()
        started = time.perf_counter()
        fill(ledger.engine, ROWS)
        with ledger.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO questpie_relay_backlog (sampled_at, backlog) "
                    "SELECT now() - make_interval(secs => s * 30), s FROM generate_series(0, 119) s"
                )
            )
        print(f"filled {ROWS:,} rows in {time.perf_counter() - started:.0f}s")

        operator = Operator(ledger)
        bare = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        bare.autocommit = True

        def floor() -> None:
            bare.execute("SELECT count(*) FROM questpie_queue_dispatch").fetchone()

        figures = {
            "floor: bare count(*) of the table": floor,
            "counts per job and status": operator.counts,
            "stuck (4 reasons)": lambda: operator.stuck(limit=20),
            "failed, newest 20": lambda: operator.failed(limit=20),
            "parked per slot": operator.parked,
            "backlog, last hour": operator.backlog,
            "the whole page (reads + render)": lambda: render(
                operator.overview(), ledger="bench", refresh_seconds=10
            ),
        }
        print(f"{'figure':<36} {'median ms':>10} {'min-max':>16}")
        for name, read in figures.items():
            median, low, high = timed(read)
            print(f"{name:<36} {median:>10.1f} {low:>7.1f}-{high:<8.1f}")
        bare.close()
        ledger.close()
    finally:
        postgres.close()


if __name__ == "__main__":
    main()
