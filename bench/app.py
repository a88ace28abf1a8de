"""The Celery project the benchmark's worker runs (configured from the environment)."""

from __future__ import annotations

import os
import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import redis
from celery import Celery
from pydantic import BaseModel
from sqlalchemy import create_engine

from bench.floor import CLAIM, FINISH
from questpie_celery import JobContext, LedgerTask, Questpie, job
from questpie_celery.ledger import DispatchRow
from questpie_celery.ledger.claims import ClaimStatements
from questpie_celery.ledger.direct import DriverStatement
from questpie_celery.send.broker import MessageHeader

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


@celery_app.task(
    base=LedgerTask, name="bench.adopted", ledger={"idempotency_key": "{key}"}, shared=False
)
def adopted(n: int, key: str) -> None:
    """An existing Celery task adopted where it stands: its key is one of its arguments."""
    del n, key
    bump("bench:adopted")


@job(name="bench.exclusive", schema=Payload, options={"queue_policy": "exclusive"})
def exclusive(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx


@job(name="bench.secret", schema=Payload, options={"retry_limit": 0})
def secret(payload: Payload, ctx: JobContext) -> None:
    del payload, ctx
    bump("bench:secret")


_driver: list[Any] = []

#: In a worker started with BENCH_NOOP=floor, `bench.noop` is a plain Celery task that
#: makes the floor's two writes for the message's dispatch: questpie's messages as they
#: are (header, payload, time limits), run without the fence; with BENCH_NOOP=lean, the
#: same messages go through `LeanFence` (bench/worker.py).
NOOP_AS = os.environ.get("BENCH_NOOP", "")
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


if NOOP_AS == "floor":

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
    jobs=[exclusive, secret] if NOOP_AS else [noop, exclusive, secret],
    secret="bench-secret-" + "0" * 32,  # a benchmark's throwaway key
)


class LeanFence:
    """The least a fence does for one delivery, as a plain task (bench/fence_cpu.py): it
    reads questpie's header, claims with the ledger's own claim statement through the
    bare driver (the row read into a `DispatchRow`), validates the payload with the job's
    schema, runs the handler with its context, and records the outcome with the ledger's
    own statement (not waiting for the disk on a relaxed worker, as a relaxed ledger's
    do not). No lease, no waiting out an outage, no spans, no handling of anything going
    wrong: what the fence's code costs beyond that is in `fenced - lean fence`."""

    def __init__(self) -> None:
        url = os.environ["BENCH_LEDGER"].replace("postgresql+psycopg://", "postgresql://")
        options = "-c synchronous_commit=off" if RELAXED else ""
        driver = psycopg.connect(url, autocommit=True, options=options)
        self._bare = SimpleNamespace(connection=SimpleNamespace(dbapi_connection=driver, info={}))
        engine = create_engine(os.environ["BENCH_LEDGER"])  # its dialect, for compiling
        statements = ClaimStatements(engine.dialect.name, None)
        self._claim = DriverStatement(statements.claim, engine)
        self._finish = DriverStatement(statements.finish, engine)
        self._definition = noop

    def run(self, request: Any, payload: Any) -> None:
        header = MessageHeader.from_request(request)
        assert header is not None
        token = header.token or str(uuid.uuid4())
        claimed = self._claim.run(
            self._bare,  # type: ignore[arg-type]  # the driver's connection is all it reads
            {
                "dispatch_id": request.id,
                "job": self._definition.name,
                "previous": header.attempt - 1,
                "new_token": token,
                "lease": 60.0,
                "any_time": False,
            },
        )
        row = DispatchRow.from_mapping(claimed[0])
        model = self._definition.validate(payload)
        ctx = JobContext(
            dispatch_id=row.id,
            job_name=row.job_name,
            idempotency_key=row.idempotency_key,
            attempt=row.attempt,
            retry_limit=row.options.run.retry_limit,
            singleton_key=row.singleton_key,
        )
        self._definition.handler(model, ctx)
        params = {
            "dispatch_id": row.id,
            "token": token,
            "new_status": "completed",
            "error": None,
            "result": None,
        }
        assert self._finish.run(self._bare, params)  # type: ignore[arg-type]


_lean: list[LeanFence] = []


@celery_app.task(name="bench.lean_fence", bind=True)
def lean_fence(self: Any, payload: Any = None) -> None:
    """A questpie message of `bench.noop` through `LeanFence`."""
    through_lean(self.request, payload)


def through_lean(request: Any, payload: Any) -> None:
    if not _lean:
        _lean.append(LeanFence())
    _lean[0].run(request, payload)


if NOOP_AS == "lean":

    @celery_app.task(name="bench.noop", bind=True)
    def noop_lean(self: Any, payload: Any = None) -> None:
        """A questpie message of `bench.noop` through `LeanFence`."""
        through_lean(self.request, payload)
