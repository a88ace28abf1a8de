"""The Celery project the benchmark's worker runs (configured from the environment)."""

from __future__ import annotations

import os
from typing import Any

import psycopg
import redis
from celery import Celery
from pydantic import BaseModel

from bench.floor import CLAIM, FINISH
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


_driver: list[Any] = []

#: In a worker started with BENCH_FENCELESS=1, `bench.noop` is a plain Celery task that
#: makes the floor's two writes for the message's dispatch: questpie's messages as they
#: are (header, payload, time limits), run without the fence (bench/worker.py).
FENCELESS = os.environ.get("BENCH_FENCELESS") == "1"
RELAXED = os.environ.get("BENCH_DURABILITY") == "relaxed"


def two_writes(dispatch_id: str) -> None:
    """The two durable writes a fenced run makes (its claim and its outcome), through the
    bare driver: the floor of a fenced run. On a relaxed worker, not waiting for the
    disk, as a relaxed ledger's are."""
    if not _driver:
        url = os.environ["BENCH_LEDGER"].replace("postgresql+psycopg://", "postgresql://")
        options = "-c synchronous_commit=off" if RELAXED else ""
        _driver.append(psycopg.connect(url, autocommit=True, options=options))
    conn = _driver[0]
    conn.execute(CLAIM, (dispatch_id,))
    conn.execute(FINISH, (dispatch_id,))


@celery_app.task(name="bench.raw_two_writes")
def raw_two_writes(dispatch_id: str) -> None:
    """A raw task that makes the floor's two writes."""
    two_writes(dispatch_id)
    bump("bench:raw_two_writes")


if FENCELESS:

    @celery_app.task(name="bench.noop", bind=True)
    def noop_fenceless(self: Any, payload: Any = None) -> None:
        """A questpie message of `bench.noop`, run as a plain task making the floor's
        two writes for its dispatch."""
        del payload
        two_writes(self.request.id)
        bump("bench:noop")


questpie = Questpie(
    celery_app,
    ledger_url=os.environ.get("BENCH_LEDGER", "sqlite://"),
    durability="relaxed" if RELAXED else "durable",
    jobs=[exclusive, secret] if FENCELESS else [noop, exclusive, secret],
    secret="bench-secret-" + "0" * 32,  # a benchmark's throwaway key
)
