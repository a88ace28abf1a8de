"""What the fast lane shares: a Questpie on a SQLite ledger file and Celery's in-memory
broker, its writes counted from outside. (Waiting, and acting at a line, are both
lanes': tests/support/waiting.py, tests/support/tracing.py.)"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from celery import Celery
from sqlalchemy import func, select, text

from questpie_celery import Questpie
from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import Ledger, NewDispatch, dispatch_table, open_ledger
from tests.support import jobapp


def sqlite_url(folder: Path) -> str:
    return f"sqlite:///{folder / 'ledger.sqlite3'}"


def row_count(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(dispatch_table)).scalar_one())


def sqlite_now(ledger: Ledger) -> datetime:
    """The SQLite database's clock, at the millisecond precision the ledger stores."""
    with ledger.engine.connect() as conn:
        raw = conn.execute(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")).scalar_one()
    return datetime.fromisoformat(raw).replace(tzinfo=UTC)


def new_dispatch(job_name: str = "record", **fields: object) -> NewDispatch:
    values: dict[str, object] = {
        "id": random_dispatch_id(),
        "job_name": job_name,
        "payload": {"tag": "x"},
        "options": StoredOptions(),
    }
    values.update(fields)
    return NewDispatch(**values)  # type: ignore[arg-type]


@dataclass
class IdleApp:
    """A Questpie whose messages go to an in-memory queue no worker reads, with its
    ledger inspected through a `Ledger` of our own on the same SQLite file."""

    celery_app: Celery
    questpie: Questpie
    ledger: Ledger
    queue: str

    @classmethod
    def build(cls, folder: Path) -> IdleApp:
        url = sqlite_url(folder)
        queue = f"idle-{uuid.uuid4().hex[:10]}"
        app, questpie = jobapp.build(broker="memory://", ledger=url, queue=queue)
        questpie.migrate()
        return cls(app, questpie, open_ledger(url), queue)

    def messages(self) -> int:
        with self.celery_app.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(self.queue).message_count)

    def written(self) -> tuple[int, int]:
        """(ledger rows, broker messages) so far, once the sends handed over are made."""
        assert self.questpie.flush(timeout=10)
        return row_count(self.ledger), self.messages()

    def close(self) -> None:
        self.questpie.close()
        self.ledger.close()
