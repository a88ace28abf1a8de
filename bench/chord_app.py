"""The Celery project `bench/chord.py`'s worker runs (configured from the environment).

A Redis broker (`BENCH_BROKER`), a Redis result backend (`BENCH_BACKEND`), a PostgreSQL
ledger (`BENCH_LEDGER`), Celery's result settings left at their defaults (results
stored), and two chords' worth of tasks:

- `chord.raw_member` and `chord.raw_body`: plain Celery tasks, for `celery.chord` (its
  counting in the Redis result backend);
- `chord.member` and `chord.body`: the same tasks with `base=LedgerTask`, for
  `questpie_celery.chord`.

The members do nothing; each body writes `time.time()` when it starts under
`bench:chord:body:<run>` in the broker's Redis, before it does anything else.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from questpie_celery import LedgerTask, Questpie

BROKER = os.environ.get("BENCH_BROKER", "memory://")
celery_app = Celery("bench_chord", broker=BROKER, backend=os.environ.get("BENCH_BACKEND"))
celery_app.conf.update(worker_prefetch_multiplier=4, worker_hijack_root_logger=False)
_marks: dict[int, redis.Redis] = {}


def body_started(run: str) -> None:
    """Write when a chord's body started (both bodies pay this, first thing)."""
    started = time.time()
    pid = os.getpid()
    if pid not in _marks:
        _marks[pid] = redis.Redis.from_url(BROKER)
    _marks[pid].set(f"bench:chord:body:{run}", repr(started))


@celery_app.task(name="chord.raw_member")
def raw_member(n: int) -> None:
    del n


@celery_app.task(name="chord.raw_body")
def raw_body(results: list[Any], run: str) -> None:
    body_started(run)
    del results


@celery_app.task(base=LedgerTask, name="chord.member", shared=False)
def member(n: int) -> None:
    del n


@celery_app.task(base=LedgerTask, name="chord.body", shared=False)
def body(results: list[Any], run: str) -> None:
    body_started(run)
    del results


questpie = Questpie(celery_app, ledger_url=os.environ.get("BENCH_LEDGER", "sqlite://"))
