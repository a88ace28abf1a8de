"""What a beat loop costs with 10,000 schedules in the ledger, and how soon a tick fires.

    .venv/bin/python bench/beat.py              # starts its own PostgreSQL and Redis
    BENCH_SCHEDULES=50000 .venv/bin/python bench/beat.py

PostgreSQL runs with its default durability. The ledger holds BENCH_SCHEDULES schedules
of daily crons spread over the day (`m h * * *`), as a project with one report per
customer would. Figures, each beside its floor measured in the same run:

- one idle loop of `LedgerScheduler.tick()` (nothing due): the process time it takes
  (CPU of the beat process) and its wall time, against a bare psycopg round trip of
  the same "what is due" query;
- a burst of BENCH_BURST schedules due at the same tick: how long after the tick each
  fire's dispatch row exists and its message is sent, against raw `apply_async` of
  the same number of messages.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from questpie_celery import JobContext, Questpie  # noqa: E402
from questpie_celery.beat import LedgerScheduler  # noqa: E402
from questpie_celery.jobs.definition import JobDefinition  # noqa: E402
from tests.support.services import PostgresServer, RedisServer  # noqa: E402

SCHEDULES = int(os.environ.get("BENCH_SCHEDULES", "10000"))
BURST = int(os.environ.get("BENCH_BURST", "100"))
LOOPS = 50


class Report(BaseModel):
    customer: int = 0


def nothing(payload: Report, ctx: JobContext) -> None:
    return None


FILL = """
INSERT INTO questpie_schedule
  (job_name, source, cron, tz, payload, singleton_key, options, next_fire_at, updated_at)
SELECT 'report-' || i, 'call', (i % 60) || ' ' || (i % 24) || ' * * *', 'UTC',
  json_build_object('customer', i), NULL, '{}'::json,
  date_trunc('day', now()) + interval '1 day' + make_interval(hours => i % 24, mins => i % 60),
  now()
FROM generate_series(1, :n) AS i
"""


def main() -> None:
    postgres = PostgresServer(durable=True).start()
    redis_server = RedisServer().start()
    try:
        url = postgres.create_database("beat")
        app = Celery("bench", broker=redis_server.url(1))
        app.conf.task_default_queue = "bench-beat"
        jobs = [
            JobDefinition(name=f"report-{i}", schema=Report, handler=nothing)
            for i in range(1, SCHEDULES + 1)
        ]
        questpie = Questpie(app, ledger_url=url, jobs=jobs)
        questpie.migrate()
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(FILL), {"n": SCHEDULES})
            conn.execute(text("ANALYZE questpie_schedule"))
        scheduler = LedgerScheduler(app, lazy=True)
        scheduler.setup_schedule()

        bare = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))
        bare.autocommit = True
        floor_walls = []
        for _ in range(LOOPS):
            started = time.perf_counter()
            bare.execute(
                "SELECT *, now() FROM questpie_schedule WHERE next_fire_at <= now() "
                "ORDER BY next_fire_at LIMIT 500"
            ).fetchall()
            bare.execute("SELECT min(next_fire_at) FROM questpie_schedule").fetchone()
            floor_walls.append((time.perf_counter() - started) * 1000)

        walls, cpus = [], []
        for _ in range(LOOPS):
            wall, cpu = time.perf_counter(), time.process_time()
            scheduler.tick()
            cpus.append((time.process_time() - cpu) * 1000)
            walls.append((time.perf_counter() - wall) * 1000)

        # A burst: BURST schedules whose tick is two seconds from now, on the ledger's clock.
        with engine.begin() as conn:
            tick = conn.execute(
                text("SELECT date_trunc('second', now()) + interval '2 s'")
            ).scalar_one()
            conn.execute(
                text(
                    "UPDATE questpie_schedule SET next_fire_at = :tick "
                    "WHERE job_name IN (SELECT job_name FROM questpie_schedule ORDER BY job_name "
                    "LIMIT :n)"
                ),
                {"tick": tick, "n": BURST},
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            delay = scheduler.tick()
            with engine.connect() as conn:
                fired = conn.execute(
                    text("SELECT count(*) FROM questpie_queue_dispatch")
                ).scalar_one()
            if fired >= BURST:
                break
            time.sleep(min(delay, 0.05))
        with engine.connect() as conn:
            created = [
                row[0]
                for row in conn.execute(
                    text("SELECT created_at FROM questpie_queue_dispatch ORDER BY created_at")
                )
            ]
        latencies = [(at - tick).total_seconds() * 1000 for at in created]

        @app.task(name="raw")
        def raw() -> None:
            return None

        started = time.perf_counter()
        for _ in range(BURST):
            raw.apply_async()
        raw_burst = (time.perf_counter() - started) * 1000

        print(f"{SCHEDULES:,} schedules in the ledger; PostgreSQL with default durability")
        print(f"{'figure':<52} {'median':>9} {'max':>9}")
        print(
            f"{'floor: bare psycopg due query + min (wall ms)':<52} "
            f"{statistics.median(floor_walls):>9.2f} {max(floor_walls):>9.2f}"
        )
        print(
            f"{'idle beat loop, wall ms':<52} {statistics.median(walls):>9.2f} {max(walls):>9.2f}"
        )
        print(
            f"{'idle beat loop, process (CPU) ms':<52} "
            f"{statistics.median(cpus):>9.2f} {max(cpus):>9.2f}"
        )
        print(
            f"{f'burst of {BURST}: tick to dispatch row, ms':<52} "
            f"{statistics.median(latencies):>9.1f} {max(latencies):>9.1f}"
        )
        print(f"{f'floor: {BURST} raw apply_async, ms in all':<52} {raw_burst:>9.1f}")
        print(f"fires made: {len(created)} of {BURST}, at {datetime.now(UTC):%H:%M:%S}")
        bare.close()
        engine.dispose()
        questpie.close()
    finally:
        redis_server.close()
        postgres.close()


if __name__ == "__main__":
    main()
