"""The project's Celery app, as it was, and the one line that gives it the ledger."""

import os
from pathlib import Path

from celery import Celery
from celery.schedules import crontab

from questpie_celery import Questpie

app = Celery(
    "proj",
    broker=os.environ.get("BROKER_URL", "redis://localhost:6379/0"),
    backend=os.environ.get("RESULT_BACKEND", "redis://localhost:6379/1"),
    include=["proj.tasks"],
)
app.conf.update(
    # The project passes dataclasses to its tasks: pickle carries them, JSON would not.
    task_serializer="pickle",
    result_serializer="pickle",
    accept_content=["pickle", "json"],
    result_accept_content=["pickle", "json"],
)
app.conf.beat_schedule = {
    "rebuild-search-index": {
        "task": "proj.tasks.rebuild_index",
        "schedule": crontab(minute="*/15"),
        "args": ("search",),
    },
}

# New: the ledger, in the project's database (a SQLite file beside the code when
# LEDGER_URL is unset), and the secret that seals the secret tasks' arguments.
LEDGER_FILE = Path(__file__).resolve().parent.parent / "ledger.sqlite3"
questpie = Questpie(
    app,
    ledger_url=os.environ.get("LEDGER_URL", f"sqlite:///{LEDGER_FILE}"),
    secret=os.environ.get("QUESTPIE_SECRET"),
)
