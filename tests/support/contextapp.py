"""A Celery project whose `Questpie` builds each run's application services.

Its factory opens a database connection of its own for every run, and writes what
happens to it in the `context_events` table: `open` when it is built, `use` when the
handler uses it, `close` when it is closed (with how the handler ended), each with the
services' id and the process id, so a test sees what a real worker built and closed.

Configured from jobapp's environment (QP_TEST_BROKER, QP_TEST_LEDGER, QP_TEST_QUEUE,
QP_TEST_RUNS); run a worker of it with `Worker(env, app="tests.support.contextapp:celery_app")`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from celery import Celery
from pydantic import BaseModel
from sqlalchemy import Column, Connection, Integer, MetaData, String, Table, insert

from questpie_celery import JobContext, Questpie, job
from tests.support import jobapp

events_metadata = MetaData()
events_table = Table(
    "context_events",
    events_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("services_id", String(32), nullable=False),
    Column("event", String(8), nullable=False),  # open, use, close
    Column("dispatch_id", String(64), nullable=True),  # known to `use` only
    Column("tag", String(200), nullable=True),
    Column("attempt", Integer, nullable=True),
    Column("outcome", String(64), nullable=True),  # close: the handler's error class, if any
    Column("pid", Integer, nullable=False),
)


@dataclass
class Services:
    """One run's services: an id and a database connection opened for the run."""

    services_id: str
    db: Connection

    def note(self, event: str, **values: object) -> None:
        self.db.execute(
            insert(events_table).values(
                services_id=self.services_id, event=event, pid=os.getpid(), **values
            )
        )
        self.db.commit()


@contextmanager
def services() -> Iterator[Services]:
    with jobapp.runs_engine().connect() as db:
        made = Services(uuid.uuid4().hex, db)
        made.note("open")
        try:
            yield made
        except BaseException as exc:
            made.note("close", outcome=type(exc).__name__)
            raise
        made.note("close")


class Step(BaseModel):
    tag: str
    fail_times: int = 0
    gate: str | None = None


@job(name="context.step", schema=Step, options={"retry_limit": 2})
def step(payload: Step, ctx: JobContext[Services]) -> str:
    ctx.app.note("use", dispatch_id=ctx.dispatch_id, tag=payload.tag, attempt=ctx.attempt)
    jobapp.wait_at(payload.gate)
    if ctx.attempt <= payload.fail_times:
        raise RuntimeError("planned failure")
    return ctx.app.services_id


def build(*, broker: str, ledger: str, queue: str) -> tuple[Celery, Questpie]:
    app = jobapp.make_celery(broker, queue=queue)
    return app, Questpie(app, ledger_url=ledger, jobs=[step], context=services)


celery_app, questpie = build(
    broker=os.environ.get("QP_TEST_BROKER", "memory://"),
    ledger=os.environ.get("QP_TEST_LEDGER", "sqlite://"),
    queue=os.environ.get("QP_TEST_QUEUE", "celery"),
)
