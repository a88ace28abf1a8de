"""How quickly the read-only Django admin renders its pages, at 10,000 and 1,000,000 rows.

    .venv/bin/python bench/django_admin.py            # starts its own PostgreSQL
    BENCH_SIZES=10000,200000 .venv/bin/python bench/django_admin.py

Needs Django (`pip install 'django>=5.2,<6'`). PostgreSQL runs with its default
durability; each ledger is filled by `bench/fixture.py` (one set-based INSERT, then
VACUUM ANALYZE). Each page is fetched through Django's test client as a logged-in
superuser (session, middleware, template rendering included), the median of 7 fetches
(min-max) after one warm-up. Beside them, what a stock admin would run on every list
page: `COUNT(*)` of the table and `SELECT DISTINCT job_name` for a job filter.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from django.db import connection, connections  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from bench.fixture import fill  # noqa: E402
from questpie_celery.ledger import open_ledger  # noqa: E402
from tests.support import django_site  # noqa: E402
from tests.support.services import PostgresServer  # noqa: E402

SIZES = [int(n) for n in os.environ.get("BENCH_SIZES", "10000,1000000").split(",")]
READS = 7
#: The fixture's row 1233: keyed, job-9.
SOME_ID = str(uuid.UUID(hashlib.md5(b"qp1233").hexdigest()))


Figure = tuple[float, float, float, float | None]


def timed(read: Callable[[], float | None]) -> Figure:
    """(median, min, max, median of the SQL's share) in milliseconds."""
    read()
    times, sql_times = [], []
    for _ in range(READS):
        started = time.perf_counter()
        sql_ms = read()
        times.append((time.perf_counter() - started) * 1000)
        if sql_ms is not None:
            sql_times.append(sql_ms)
    sql_median = statistics.median(sql_times) if sql_times else None
    return statistics.median(times), min(times), max(times), sql_median


def measure(postgres: PostgresServer, rows: int) -> dict[str, Figure]:
    url = postgres.create_database("admin_bench")
    ledger = open_ledger(url)
    ledger.migration.migrate()
    started = time.perf_counter()
    fill(ledger.engine, rows)
    print(f"filled {rows:,} rows in {time.perf_counter() - started:.0f}s")
    django_site.use_database(url)
    client = Client()
    client.force_login(django_site.superuser())
    base = django_site.admin_url("dispatch")

    def page(path: str, **params: str) -> Callable[[], float | None]:
        def get() -> float:
            with CaptureQueriesContext(connection) as captured:
                response = client.get(path, params)
            assert response.status_code == 200, (path, params, response.status_code)
            return sum(float(q["time"]) for q in captured.captured_queries) * 1000

        return get

    def sql(statement: str) -> Callable[[], float | None]:
        def run() -> None:
            with connection.cursor() as cursor:
                cursor.execute(statement)
                cursor.fetchall()

        return run

    figures = {
        "list, newest first": page(base),
        "list, page 2": page(base, p="2"),
        "list, page 100 (the deepest)": page(base, p="100"),
        "list, status=completed": page(base, status="completed"),
        "list, status=failed": page(base, status="failed"),
        "list, status=retry": page(base, status="retry"),
        "list, job=job-3": page(base, job="job-3"),
        "list, job=job-3 status=failed": page(base, job="job-3", status="failed"),
        "list, search an id": page(base, q=SOME_ID),
        "list, search a key": page(base, q="order-1233"),  # ids derived per job
        "a dispatch's page": page(f"{base}{SOME_ID}/change/"),
        "schedules": page(base.replace("/dispatch/", "/schedule/")),
        "stock admin: COUNT(*)": sql("SELECT count(*) FROM questpie_queue_dispatch"),
        "stock admin: DISTINCT job_name": sql(
            "SELECT DISTINCT job_name FROM questpie_queue_dispatch ORDER BY job_name"
        ),
    }
    results = {name: timed(read) for name, read in figures.items()}
    connections.close_all()
    ledger.close()
    return results


def main() -> None:
    django_site.configure()
    postgres = PostgresServer(durable=True).start()
    try:
        results = {rows: measure(postgres, rows) for rows in SIZES}
    finally:
        postgres.close()
    small, big = SIZES[0], SIZES[-1]
    print(
        f"\n{'page':<30} {f'{small:,} rows':>12} {f'{big:,} rows':>22} {'ratio':>6}"
        f" {'SQL of it':>10}"
    )
    print(f"{'':<30} {'median ms':>12} {'median (min-max) ms':>22} {'':>6} {'ms':>10}")
    for name in results[small]:
        s, (b, low, high, sql_ms) = results[small][name][0], results[big][name]
        share = f"{sql_ms:.1f}" if sql_ms is not None else "-"
        print(f"{name:<30} {s:>12.1f} {b:>8.1f} ({low:.1f}-{high:.1f}) {b / s:>5.1f}x {share:>10}")


if __name__ == "__main__":
    main()
