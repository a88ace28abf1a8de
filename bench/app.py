"""The Celery project the benchmark's worker runs (configured from the environment)."""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, Questpie, job

celery_app = Celery("bench", broker=os.environ.get("BENCH_BROKER", "memory://"))
celery_app.conf.update(
    worker_prefetch_multiplier=4, task_ignore_result=True, worker_hijack_root_logger=False
)
_counters: dict[int, redis.Redis] = {}


def bump(name: str) -> None:
    """Count a finished run in Redis (both raw and ledgered tasks pay this)."""
    pid = os.getpid()
    if pid not in _counters:
        _counters[pid] = redis.Redis.from_url(os.environ["BENCH_BROKER"])
    _counters[pid].incr(name)


class Payload(BaseModel):
    n: int


@celery_app.task(name="bench.raw")
def raw(payload: dict[str, Any]) -> None:
    del payload
    bump("bench:raw")


@job(name="bench.noop", schema=Payload, options={"retry_limit": 0})
def noop(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx
    bump("bench:noop")


@job(name="bench.exclusive", schema=Payload, options={"queue_policy": "exclusive"})
def exclusive(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx


@job(name="bench.secret", schema=Payload, options={"retry_limit": 0})
def secret(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx
    bump("bench:secret")


questpie = Questpie(
    celery_app,
    ledger_url=os.environ.get("BENCH_LEDGER", "sqlite://"),
    jobs=[noop, exclusive, secret],
    secret="bench-secret-" + "0" * 32,  # a benchmark's throwaway key
)
