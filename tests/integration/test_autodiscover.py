"""A project whose `@job`s live in several modules that `app.autodiscover_tasks()` finds:
registered without being listed, in the worker and in a publisher alike."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.support.services import ROOT, PostgresServer, RedisServer, Worker
from tests.support.waiting import wait_until

CELERY_MODULE = """
import os
from celery import Celery
from questpie_celery import Questpie

app = Celery("proj", broker=os.environ["PROJ_BROKER"])
questpie = Questpie(app, ledger_url=os.environ["PROJ_LEDGER"])  # no jobs listed
app.autodiscover_tasks(["proj.billing", "proj.mail"])
"""

BILLING = """
from pydantic import BaseModel
from questpie_celery import JobContext, job

class Charge(BaseModel):
    order_id: str

@job(name="billing.charge", schema=Charge)
def charge(payload: Charge, ctx: JobContext) -> None:
    del payload, ctx
"""

MAIL = """
from pydantic import BaseModel
from questpie_celery import JobContext, job

class Welcome(BaseModel):
    user_id: str

@job(name="mail.welcome", schema=Welcome, options={"queue_policy": "exclusive"})
def welcome(payload: Welcome, ctx: JobContext) -> None:
    del payload, ctx
"""

# The publisher imports only the Celery module, never the job modules.
PUBLISH = """
from proj.celery import questpie
print(questpie.queue.billing_charge.publish({"order_id": "o1"}, idempotency_key="o1"))
print(questpie.queue["mail.welcome"].publish({"user_id": "u1"}, idempotency_key="u1"))
"""


def test_autodiscovered_jobs_are_registered_without_listing(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    package = tmp_path / "proj"
    for folder, source in ((package, ""), (package / "billing", ""), (package / "mail", "")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text(source)
    (package / "celery.py").write_text(textwrap.dedent(CELERY_MODULE))
    (package / "billing" / "tasks.py").write_text(textwrap.dedent(BILLING))
    (package / "mail" / "tasks.py").write_text(textwrap.dedent(MAIL))
    settings = {
        "PROJ_BROKER": redis_server.url(redis_server.new_db()),
        "PROJ_LEDGER": postgres.create_database(),
    }
    pythonpath = f"{tmp_path}{os.pathsep}{ROOT}"
    env = {**os.environ, **settings, "PYTHONPATH": pythonpath}
    cli = str(Path(sys.executable).parent / "questpie-celery")
    migrated = subprocess.run(
        [cli, "migrate", "-A", "proj.celery:questpie"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stderr
    worker = Worker(settings, app="proj.celery:app", cwd=tmp_path, pythonpath=pythonpath).start()
    try:
        # The worker lists both jobs among its tasks.
        assert "billing.charge" in worker.log() and "mail.welcome" in worker.log()
        published = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(PUBLISH)],
            cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert published.returncode == 0, published.stderr
        ids = published.stdout.split()
        assert len(ids) == 2
        engine = create_engine(settings["PROJ_LEDGER"])
        states: dict[str, str | None] = {}

        def completed() -> bool:
            with engine.connect() as conn:
                states.update(
                    (
                        i,
                        conn.execute(
                            text("SELECT status FROM questpie_queue_dispatch WHERE id = :id"),
                            {"id": i},
                        ).scalar(),
                    )
                    for i in ids
                )
            return set(states.values()) == {"completed"}

        try:
            wait_until(
                completed,
                f"both dispatches {ids} to complete",
                60,
                0.1,
                explain=lambda: f"they are {states}\n{worker.log()}",
            )
        finally:
            engine.dispose()
    finally:
        worker.stop()
