"""bench/app.py's Celery project and a procrastinate app, for bench/pg_peer.py (needs the
`bench` extra).

The procrastinate app is on the ledger's PostgreSQL, through procrastinate's psycopg 3
connector, with a no-op task that counts its run in Redis as bench/app.py's tasks do. The
task is a plain function, as a Celery project's code is: procrastinate's worker runs it in
a thread (asgiref's `sync_to_async`), beside its asyncio loop. Each side also has a
sentinel task, counted apart, that the guarantee check sends after the calls it checks.
"""

from __future__ import annotations

import os

import procrastinate

from bench.app import bump, celery_app, questpie, raw

__all__ = ["app", "celery_app", "noop", "questpie", "raw", "sentinel"]

SENTINEL = "bench:pg_sentinel"

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(
        conninfo=os.environ.get("BENCH_LEDGER", "").replace(
            "postgresql+psycopg://", "postgresql://"
        )
    )
)


@app.task(name="bench.procrastinate_noop")
def noop(n: int) -> None:
    del n
    bump("bench:procrastinate")


@app.task(name="bench.procrastinate_sentinel")
def sentinel() -> None:
    bump(SENTINEL)


@celery_app.task(name="bench.pg_sentinel")  # type: ignore[untyped-decorator]
def celery_sentinel() -> None:
    bump(SENTINEL)
