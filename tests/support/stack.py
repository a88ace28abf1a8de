"""A stack: one configuration of the real parts, isolated from every other stack.

Each stack has its own ledger database (a PostgreSQL database of its own, or a
SQLite file), its own Redis database or RabbitMQ queue, a `celery worker`
process, and in this process a Celery app and `Questpie` built the same way.
Its relay therefore never sends another stack's rows.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import Engine, create_engine, func, select

from questpie_celery import Questpie
from questpie_celery.ledger import DispatchRow, Ledger, dispatch_table, open_ledger
from tests.support import jobapp
from tests.support.services import Worker
from tests.support.waiting import wait_until


def tag() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@dataclass
class Gate:
    """A file a gated handler waits for; `open()` lets it go on."""

    path: Path

    def open(self) -> None:
        self.path.touch()

    def __str__(self) -> str:
        return str(self.path)


@dataclass
class Stack:
    env: dict[str, str]
    celery_app: Celery
    questpie: Questpie
    ledger: Ledger  # this process's own view of the ledger, for inspection
    runs_engine: Engine
    worker: Worker
    folder: Path
    broker: str  # "redis", "rabbitmq" or "filesystem"
    extra_workers: list[Worker] = field(default_factory=list)

    @property
    def queue_name(self) -> str:
        return self.env["QP_TEST_QUEUE"]

    def gate(self) -> Gate:
        return Gate(self.folder / f"gate-{uuid.uuid4().hex[:10]}")

    def runs(self, tag: str, phase: str = "start") -> list[dict[str, Any]]:
        with self.runs_engine.connect() as conn:
            rows = conn.execute(
                select(jobapp.runs_table)
                .where(jobapp.runs_table.c.tag == tag, jobapp.runs_table.c.phase == phase)
                .order_by(jobapp.runs_table.c.id)
            ).mappings()
            return [dict(r) for r in rows]

    def wait_runs(self, tag: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until at least `count` runs of `tag` started; return them all."""
        return self._wait_recorded(tag, "start", count, timeout)

    def wait_ends(self, tag: str, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Wait until at least `count` runs of `tag` finished (recorded their end)."""
        return self._wait_recorded(tag, "end", count, timeout)

    def _wait_recorded(
        self, tag: str, phase: str, count: int, timeout: float
    ) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []

        def enough() -> list[dict[str, Any]] | None:
            found[:] = self.runs(tag, phase)
            return list(found) if len(found) >= count else None

        return wait_until(
            enough,
            f"{count} runs of {tag} to record their {phase}",
            timeout,
            interval=0.05,
            explain=lambda: f"{len(found)} did\n{self._last_lines()}",
        )

    def wait_log(self, dispatch_id: str, text: str, timeout: float = 20.0) -> None:
        """Wait until a worker of this stack logged `text` on a line naming the dispatch."""
        wait_until(
            lambda: any(text in line for line in self._lines_about(dispatch_id)),
            f"a worker to log {text!r} for {dispatch_id}",
            timeout,
            interval=0.05,
            explain=lambda: self._last_lines(dispatch_id),
        )

    def wait_taken(self) -> None:
        """Wait until the worker has taken every message sent to this stack's queue so far.

        A control dispatch is published now and waited for: the queue is first in,
        first out and its one consumer logs each message's receipt ("Task ...[id]
        received") as it takes it, so a message sent before the control one is in the log
        before the control one runs. A test asserting that something was never sent, or
        sent once, checks the log after this; with extra workers the order would not hold.
        The filesystem broker reads its files in the order of their names, which start
        with the millisecond of the send and go on at random: the control is sent in a
        later millisecond than anything before it."""
        assert not self.extra_workers, "wait_taken needs the stack's one worker alone"
        time.sleep(0.002)  # an ordering, not a wait: see above
        name = f"control-{tag()}"  # keyed: a ledgered dispatch, with a state to wait for
        control = self.questpie.queue.record.publish({"tag": name}, idempotency_key=name)
        assert control is not None
        self.wait_status(control, "completed")

    def wait_settled(self, *dispatch_ids: str, timeout: float = 30.0) -> None:
        """Wait until nothing sent so far can still run these dispatches: the worker took
        every message sent to the queue (`wait_taken`), and ended every delivery of each
        that it took (for each "received" line, Celery logged the delivery's end: it
        succeeded, raised, was ignored or retried). A test asserting that a dispatch ran
        once and no more checks after this, as long as no later send can come (the
        dispatch ended, or its next send is far off)."""
        self.wait_taken()

        def ended(dispatch_id: str) -> bool:
            return sum(w.unfinished(dispatch_id) for w in [self.worker, *self.extra_workers]) <= 0

        for dispatch_id in dispatch_ids:
            wait_until(
                partial(ended, dispatch_id),
                f"every delivery of {dispatch_id} the worker took to end",
                timeout,
                0.05,
                explain=partial(self._last_lines, dispatch_id),
            )

    def row(self, dispatch_id: str) -> DispatchRow:
        found = self.ledger.get(dispatch_id)
        assert found is not None, f"dispatch {dispatch_id} has no ledger row"
        return found

    def wait_status(self, dispatch_id: str, status: str, timeout: float = 30.0) -> DispatchRow:
        """Wait for a state that lasts: a terminal one, or one a gate holds."""

        last: list[DispatchRow | None] = [None]

        def reached() -> DispatchRow | None:
            last[0] = row = self.ledger.get(dispatch_id)
            return row if row is not None and row.status == status else None

        def explain() -> str:
            return f"it is {last[0] and last[0].status}\n{self._last_lines(dispatch_id)}"

        return wait_until(
            reached, f"dispatch {dispatch_id} to be {status}", timeout, 0.05, explain=explain
        )

    def _lines_about(self, dispatch_id: str) -> list[str]:
        return [
            line for w in [self.worker, *self.extra_workers] for line in w.log_about(dispatch_id)
        ]

    def _last_lines(self, dispatch_id: str | None = None) -> str:
        """What the workers said of a dispatch, and the worker's last lines: when a wait
        fails in CI, that is all there is."""
        said = ["workers logged of it:", *self._lines_about(dispatch_id)] if dispatch_id else []
        last = self.worker.log().splitlines()[-30:]
        return "\n".join([*said, "the worker's last lines:", *last])

    def dispatch_count(self) -> int:
        with self.ledger.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(dispatch_table)).scalar_one())

    def start_worker(self, **overrides: Any) -> Worker:
        """Another worker on this stack (stopped with it)."""
        env = {**self.env, **overrides.pop("env", {})}
        worker = Worker(env, **overrides).start()
        self.extra_workers.append(worker)
        return worker

    def close(self) -> None:
        for worker in [self.worker, *self.extra_workers]:
            worker.stop()
        self.questpie.close()
        self.ledger.close()
        self.runs_engine.dispose()


def build_stack(
    env: dict[str, str],
    folder: Path,
    broker: str,
    *,
    start_worker: bool = True,
    migrate: bool = True,
    **worker: Any,
) -> Stack:
    """Build this process's side of a stack from `env`, migrate (unless told not to), and
    start a worker."""
    env = {"QP_TEST_QUEUE": f"q-{uuid.uuid4().hex[:8]}", **env}
    celery_app, questpie = jobapp.build(
        broker=env["QP_TEST_BROKER"],
        ledger=env["QP_TEST_LEDGER"],
        backend=env.get("QP_TEST_BACKEND"),
        fs_dir=env.get("QP_TEST_FS_DIR"),
        secret=env.get("QP_TEST_SECRET"),
        previous_secrets=tuple(filter(None, env.get("QP_TEST_PREVIOUS", "").split(","))),
        lease_seconds=float(env.get("QP_TEST_LEASE", "60")),
        relay_interval=float(env.get("QP_TEST_RELAY", "2")),
        queue=env["QP_TEST_QUEUE"],
        extended=bool(env.get("QP_TEST_EXTENDED")),
        redeliver_after=float(env.get("QP_TEST_REDELIVER", "3600")),
        priority_queue=env.get("QP_TEST_PRIORITY_QUEUE") or None,
        durability=env.get("QP_TEST_DURABILITY", "durable"),
        fire_retention=float(env["QP_TEST_FIRE_RETENTION"])
        if env.get("QP_TEST_FIRE_RETENTION")
        else None,
        retention=float(env["QP_TEST_RETENTION"]) if env.get("QP_TEST_RETENTION") else None,
        visibility_timeout=float(env["QP_TEST_VISIBILITY"])
        if env.get("QP_TEST_VISIBILITY")
        else None,
        pooled=bool(env.get("QP_TEST_POOLED")),
        queue_type=env.get("QP_TEST_QUEUE_TYPE", "classic"),
        confirm_publish=bool(env.get("QP_TEST_CONFIRM")),
        serializer=env.get("QP_TEST_SERIALIZER", "json"),
    )
    if migrate:
        questpie.migrate()
    runs_engine = create_engine(env.get("QP_TEST_RUNS") or env["QP_TEST_LEDGER"])
    jobapp.runs_metadata.create_all(runs_engine)
    process = Worker(env, **worker)
    if start_worker:
        process.start()
    return Stack(
        env=env,
        celery_app=celery_app,
        questpie=questpie,
        ledger=open_ledger(env["QP_TEST_LEDGER"], pooled=bool(env.get("QP_TEST_POOLED"))),
        runs_engine=runs_engine,
        worker=process,
        folder=folder,
        broker=broker,
    )
