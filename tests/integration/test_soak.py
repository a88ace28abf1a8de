"""The soak: ten thousand keyed dispatches through two prefork workers while their pool
children and main processes are SIGKILLed, PostgreSQL and the broker are restarted, and
messages are delivered again byte for byte. Then every dispatch completed, none twice
but in the one documented window, and nothing is left waiting or running.

On Redis, and on RabbitMQ as Celery advises running it (quorum queues, publisher
confirms), where a RabbitMQ restart stands in for Redis's.

The stack redelivers after 10 s (`redeliver_after`, and Redis's `visibility_timeout`),
not the default hour: a worker's main process SIGKILLed with messages its children had
acknowledged but not yet claimed, a child killed between the two, and Redis restarted
(it keeps no data here) all leave `queued` rows whose message is gone, and the relay
sends those again once `redeliver_after` has passed. The lease is 10 s, so a run cut
off mid-handler is retried soon too. The figures are printed at the end (`-s`).

A completed run counts twice only in the window the documentation names: the worker
died after its handler returned and before the completion was recorded, so the lease
lapsed and the dispatch ran again. The handler records its end as its last act; a
second end is accepted only where the process that recorded the first was SIGKILLed by
this test after that end, before it started anything else and before the dispatch
started again, and where Celery logged the dispatch as succeeded no more often than it
ended (see `judge`). Anything else is a double. The stack keeps no results, so
completions ride in the next claim of their process (`worker/carried.py`): the soak runs
with that on.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
from kombu import Connection, Exchange, Queue
from sqlalchemy import func, select
from sqlalchemy.engine import Connection as SqlConnection
from sqlalchemy.exc import OperationalError

from questpie_celery import QuestpieError
from questpie_celery.ledger import dispatch_table
from tests.support import jobapp
from tests.support.background import Background
from tests.support.services import (
    PostgresServer,
    RabbitServer,
    RedisServer,
    Worker,
    child_pids,
)
from tests.support.stack import Stack, build_stack, tag
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.soak, pytest.mark.worker]

#: How many keyed dispatches each soak publishes (QP_SOAK_DISPATCHES overrides, e.g.
#: for a quick look while changing the harness).
DISPATCHES = int(os.environ.get("QP_SOAK_DISPATCHES", "10000"))
#: Dispatches per publish_many call.
BATCH = 50
#: Every this many batches goes to the tap queue, whose messages reach the workers only
#: as two or three byte-identical copies.
TAP_EVERY = 5
#: Every this many batches is published with a priority (which quorum queues ignore).
PRIORITY_EVERY = 4
#: Every this many batches, an earlier batch is published again under the same keys.
REPEAT_EVERY = 7
#: The most dispatches published and not yet completed before the stream waits: a backlog
#: that outgrew `redeliver_after` would be sent again, and again, while it waits in the
#: queue, each copy adding to the backlog. The stream stretches instead, on a slow machine.
MAX_BACKLOG = 200
#: How long the backlog may stand still before the soak fails (every path that recovers a
#: dispatch here takes seconds: a lease, `redeliver_after`, a restart).
STALL_SECONDS = 120.0
#: Attempts a dispatch may need: a run cut off by a kill is a failed attempt.
RETRY_LIMIT = 5
#: How long PostgreSQL and Redis stay down at each restart.
OUTAGE_SECONDS = 2.0
SEED = 20_251_201


@dataclass(frozen=True)
class Plan:
    """What one soak does to its stack, and how fast it publishes."""

    broker: str
    seconds: float  # the publishing stream's length, for 10,000 dispatches
    child_kills: int
    main_kills: int
    pg_restarts: int
    broker_restarts: int

    def events(self) -> list[tuple[float, str]]:
        """(fraction of the stream published, what happens then), in order."""
        events = [((i + 1) / (self.child_kills + 1), "child") for i in range(self.child_kills)]
        events += [((i + 1) / (self.main_kills + 1) - 0.04, "main") for i in range(self.main_kills)]
        events += [((i + 1) / (self.pg_restarts + 1) + 0.03, "pg") for i in range(self.pg_restarts)]
        events += [
            ((i + 1) / (self.broker_restarts + 1) + 0.07, "broker")
            for i in range(self.broker_restarts)
        ]
        return sorted(events)


@dataclass
class Figures:
    dispatches: int = 0
    child_kills: int = 0
    main_kills: int = 0
    pg_restarts: int = 0
    broker_restarts: int = 0
    replayed_copies: int = 0  # byte-identical copies beyond the first
    republished: int = 0  # keys published again
    worker_exits: int = 0  # workers that ended on their own and were started again
    refused_publishes: int = 0
    lost: int = 0
    doubles_in_window: int = 0
    doubles: int = 0
    cut_off_runs: int = 0  # starts without an end
    # Dispatches the relay sent again, unclaimed, past redeliver_after: those a pool child
    # had taken (its message acknowledged) when it was killed, alone or with its main
    # process, before it claimed them; those waiting in the broker when it restarted (Redis
    # lost them; RabbitMQ kept them, but its restart outlasted redeliver_after); and the
    # others (waiting in the queue longer than redeliver_after, after an outage).
    stranded_by_child_kills: int = 0
    stranded_by_main_kills: int = 0
    in_broker_at_restart: int = 0
    resent_other: int = 0
    relay_pending: int = 0  # dispatches the relay sent because their publish's send failed
    retried: int = 0  # completed on a later attempt: a claim whose lease lapsed
    skipped: int = 0  # deliveries the fence turned away
    seconds: float = 0.0

    def line(self) -> str:
        return " ".join(f"{name}={value}" for name, value in vars(self).items())


# --- the broker, directly ---------------------------------------------------------------


def _queue(name: str, quorum: bool) -> Queue:
    # How Celery declares a queue it creates on first use (with its queue type).
    arguments = {"x-queue-type": "quorum"} if quorum else None
    return Queue(name, Exchange(name), routing_key=name, queue_arguments=arguments)


@dataclass
class Replayer(Background):
    """Takes each message published to the tap queue and hands two or three
    byte-identical copies of it to the workers' queue: a broker delivering one message
    several times. Reconnects across broker restarts; a message is acknowledged only
    once its copies are out."""

    stack: Stack
    tap: str
    quorum: bool
    figures: Figures
    copies: random.Random = field(default_factory=lambda: random.Random(SEED))
    errors: Counter[str] = field(default_factory=Counter)

    def _run(self) -> None:
        # The app's own: on Redis its priority steps name the queues a priority goes to.
        options = dict(self.stack.celery_app.conf.broker_transport_options or {})
        while not self._stop.is_set():
            try:
                with Connection(
                    self.stack.env["QP_TEST_BROKER"], transport_options=options
                ) as conn:
                    self._pump(conn)
            except Exception as exc:  # a broker restart: connect again
                self.errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1
                self._stop.wait(0.5)

    def _pump(self, conn: Connection) -> None:
        tap = conn.SimpleQueue(_queue(self.tap, self.quorum))
        target = _queue(self.stack.queue_name, self.quorum)
        producer = conn.Producer()
        try:
            while not self._stop.is_set():
                try:
                    message = tap.get(block=True, timeout=0.5)
                except tap.Empty:
                    continue
                copies = self.copies.choice((2, 3))
                properties = {
                    k: v
                    for k, v in message.properties.items()
                    if k in ("correlation_id", "reply_to", "priority")
                }
                for _ in range(copies):
                    producer.publish(
                        message.body,
                        exchange=target.exchange,
                        routing_key=target.routing_key,
                        declare=[target],
                        headers=dict(message.headers),
                        content_type=message.content_type,
                        content_encoding=message.content_encoding,
                        **properties,
                    )
                message.ack()
                self.figures.replayed_copies += copies - 1
        finally:
            tap.close()


# --- publishing ---------------------------------------------------------------------------


@dataclass
class Stream:
    """Publishes the soak's keyed dispatches in batches, evenly over `seconds` at most and
    never more than `MAX_BACKLOG` ahead of the workers, from a thread; a batch that the
    ledger refuses is published again (same keys) until it is accepted, as a caller
    would. Every id a publish returned is kept."""

    stack: Stack
    tag: str
    total: int
    seconds: float
    tap: str
    figures: Figures
    completed: Callable[[], int | None]
    ids: list[str] = field(default_factory=list)
    mismatches: list[tuple[str, str | None, str]] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    unexpected: list[BaseException] = field(default_factory=list)
    failure: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Stream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    @property
    def published(self) -> int:
        return len(self.ids)

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the publishing stream did not finish"
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _publish(self, batch: int) -> list[str | None]:
        first = batch * BATCH
        keys = [f"{self.tag}:{n}" for n in range(first, min(first + BATCH, self.total))]
        while True:
            try:
                return self.stack.questpie.queue.record.publish_many(
                    [{"tag": self.tag}] * len(keys),
                    idempotency_keys=keys,
                    retry_limit=RETRY_LIMIT,
                    queue=self.tap if batch % TAP_EVERY == 0 else None,
                    priority=7 if batch % PRIORITY_EVERY == 1 else None,
                )
            except QuestpieError as exc:  # the ledger is down: publish the batch again
                self.errors[type(exc).__name__] += 1
                self.figures.refused_publishes += 1
            except Exception as exc:
                self.unexpected.append(exc)
            if self._stop.wait(0.2):
                raise SystemExit

    def _wait_for_the_workers(self) -> None:
        """While the backlog is over `MAX_BACKLOG`; unreadable (the ledger is down), it
        publishes anyway, and meets the outage. A backlog that does not move for
        `STALL_SECONDS` is a failure of its own, said as such."""
        last, since = None, time.monotonic()
        while (done := self.completed()) is not None and self.published - done > MAX_BACKLOG:
            if done != last:
                last, since = done, time.monotonic()
            assert time.monotonic() - since < STALL_SECONDS, (
                f"no dispatch completed for {STALL_SECONDS}s, {self.published - done} waiting"
            )
            if self._stop.wait(0.2):
                raise SystemExit

    def _run(self) -> None:
        batches = -(-self.total // BATCH)
        started = time.monotonic()
        try:
            for batch in range(batches):
                lag = started + batch * self.seconds / batches - time.monotonic()
                if lag > 0 and self._stop.wait(lag):
                    return
                self._wait_for_the_workers()
                found = self._publish(batch)
                assert all(found), "a keyed standard publish returned no id"
                self.ids.extend(i for i in found if i is not None)
                if batch % REPEAT_EVERY == REPEAT_EVERY - 1:
                    # A caller publishing an earlier batch again: the same ids, nothing more.
                    earlier = batch - 3
                    again = self._publish(earlier)
                    self.figures.republished += len(again)
                    expected = self.ids[earlier * BATCH : earlier * BATCH + len(again)]
                    self.mismatches += [
                        (f"{self.tag}:{earlier * BATCH + n}", got, want)
                        for n, (got, want) in enumerate(zip(again, expected, strict=True))
                        if got != want
                    ]
        except SystemExit:
            return
        except BaseException as exc:
            self.failure = exc


# --- the disruptions --------------------------------------------------------------------


def _group_of(pid: int) -> int | None:
    """The process group of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[2])


@dataclass
class Chaos:
    """Carries out a plan's events as the stream reaches them, from a thread, and
    restarts any worker that ended on its own meanwhile (as a process supervisor
    would). Every process it SIGKILLs is noted with the moment it was killed."""

    plan: Plan
    stream: Stream
    workers: list[Worker]
    postgres: PostgresServer
    restart_broker: Callable[[], None]
    queued_now: Callable[[], set[str]]
    figures: Figures
    #: The dispatches that were `queued` (their message in the broker) when it restarted.
    in_broker_at_restart: set[str] = field(default_factory=set)
    kills: dict[int, list[datetime]] = field(default_factory=lambda: defaultdict(list))
    #: The pids killed alone ("child") and with their main process ("main").
    killed: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    failure: BaseException | None = None
    _random: random.Random = field(default_factory=lambda: random.Random(SEED))
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Chaos:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the disruptions did not finish"
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)

    def supervise(self) -> None:
        for worker in self.workers:
            if not worker.alive():
                self.figures.worker_exits += 1
                worker.start()

    def _run(self) -> None:
        try:
            mains = 0
            for fraction, event in self.plan.events():
                while self.stream.published < fraction * self.stream.total:
                    if self.stream.done() or self._stop.wait(0.1):
                        return  # the stream failed, or the test is over
                    self.supervise()
                self.supervise()
                if event == "child":
                    self._kill_a_child()
                elif event == "main":
                    self._kill_main(self.workers[mains % len(self.workers)])
                    mains += 1
                elif event == "pg":
                    self.postgres.stop()
                    time.sleep(OUTAGE_SECONDS)  # the outage itself: the scenario, not a wait
                    self.postgres.start()
                    self.figures.pg_restarts += 1
                else:
                    self.in_broker_at_restart |= self.queued_now()
                    self.restart_broker()
                    self.figures.broker_restarts += 1
        except BaseException as exc:
            self.failure = exc

    def _kill_a_child(self) -> None:
        def killed_one() -> bool:
            alive = [w for w in self.workers if w.alive()]
            candidates = [c for w in alive for c in child_pids(w.proc.pid)]  # type: ignore[union-attr]
            if candidates:
                pid = self._random.choice(candidates)
                self._note_kill(pid, "child")
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    return False  # it was on its way out: pick another
                self.figures.child_kills += 1
                return True
            self.supervise()
            return False

        wait_until(killed_one, "a pool child to kill", 60, 0.1)

    def _kill_main(self, worker: Worker) -> None:
        """SIGKILL a worker's whole process group, as `Worker.kill()` does; stopped first
        (SIGSTOP), so the processes noted are exactly the ones that die."""
        assert worker.proc is not None
        group = worker.proc.pid
        os.killpg(group, signal.SIGSTOP)
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != group and _group_of(int(entry)) == group:
                self._note_kill(int(entry), "main")
        worker.kill()
        self.figures.main_kills += 1
        worker.start()

    def _note_kill(self, pid: int, kind: str) -> None:
        self.kills[pid].append(datetime.now(UTC))
        self.killed[kind].add(pid)


# --- what the ledger and the handler recorded -------------------------------------------


T = TypeVar("T")


def read(stack: Stack, query: Callable[[SqlConnection], T]) -> T:
    """The test's own look at the ledger, on a connection a restart may have dropped:
    tried again on a fresh one until the server answers."""
    failed: list[OperationalError] = []

    def answered() -> tuple[T] | None:
        try:
            with stack.ledger.engine.connect() as conn:
                return (query(conn),)
        except OperationalError as exc:
            failed[:] = [exc]
            return None

    (found,) = wait_until(
        answered, "the ledger to answer", 60, 0.2, explain=lambda: f"it said: {failed[-1]}"
    )
    return found


def statuses(stack: Stack) -> Counter[str]:
    def query(conn: SqlConnection) -> Counter[str]:
        found = conn.execute(
            select(dispatch_table.c.status, func.count()).group_by(dispatch_table.c.status)
        )
        return Counter({status: int(count) for status, count in found})

    return read(stack, query)


def ids_in(stack: Stack, status: str) -> set[str]:
    def query(conn: SqlConnection) -> set[str]:
        return set(
            conn.execute(
                select(dispatch_table.c.id).where(dispatch_table.c.status == status)
            ).scalars()
        )

    return read(stack, query)


def completed_ids(stack: Stack) -> set[str]:
    return ids_in(stack, "completed")


def completed_count(stack: Stack) -> int | None:
    """How many dispatches completed; None while the ledger does not answer."""
    try:
        with stack.ledger.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(dispatch_table)
                    .where(dispatch_table.c.status == "completed")
                ).scalar_one()
            )
    except OperationalError:
        return None


@dataclass
class Timeline(Background):
    """The ledger's counts every few seconds, printed at the end: how the stream went."""

    JOIN_SECONDS: ClassVar[float] = 30

    stack: Stack
    stream: Stream
    samples: list[str] = field(default_factory=list)

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(10):
            try:
                with self.stack.ledger.engine.connect() as conn:
                    found = dict(
                        conn.execute(
                            select(dispatch_table.c.status, func.count()).group_by(
                                dispatch_table.c.status
                            )
                        ).all()
                    )
            except OperationalError:
                found = {"ledger": "down"}
            self.samples.append(
                f"{time.monotonic() - started:5.0f}s published={self.stream.published} "
                + " ".join(f"{k}={v}" for k, v in sorted(found.items()))
            )


def runs_of(stack: Stack, t: str) -> dict[str, list[dict[str, Any]]]:
    """Each dispatch's recorded starts and ends, in order."""
    runs = jobapp.runs_table.c
    by_dispatch: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with stack.runs_engine.connect() as conn:
        found = conn.execute(
            select(runs.dispatch_id, runs.attempt, runs.phase, runs.pid, runs.ran_at)
            .where(runs.tag == t)
            .order_by(runs.id)
        ).mappings()
        for row in found:
            by_dispatch[row["dispatch_id"]].append(dict(row))
    return by_dispatch


@dataclass
class Verdict:
    lost: set[str]
    doubles_in_window: dict[str, int]
    doubles: dict[str, list[dict[str, Any]]]
    cut_off: int


def judge(
    ids: set[str],
    runs: dict[str, list[dict[str, Any]]],
    kills: dict[int, list[datetime]],
    succeeded: Counter[str],
) -> Verdict:
    """Lost: published but never ended. A double: an end followed by another end of the
    same dispatch, unless the earlier one ended in the documented window: the worker
    died after the handler returned and before the completion was recorded, so the lease
    lapsed and the relay retried it. That is so when

    - the process that recorded the earlier end was SIGKILLed by the test after that end,
      before it started anything else (a process starts a run only once every earlier
      completion of its own is recorded: its claim carried it, or the fence waited for
      it, so a start after the end means the end was recorded) and before the dispatch
      started again.

    Celery may have reported both runs succeeded: the stack keeps no results, so a
    completion is held for the next claim (`worker/carried.py`) and the fence returns
    before it is recorded. A second run after a recorded completion cannot happen: its
    claim needs the lapse of the first's lease, which a recorded completion ended.
    `succeeded` (from the workers' logs) is still counted: more reports of success than
    ends is a double.
    """
    lost = {i for i in ids if not any(r["phase"] == "end" for r in runs.get(i, []))}
    activity: dict[int, list[datetime]] = defaultdict(list)
    for rows in runs.values():
        for r in rows:
            activity[r["pid"]].append(r["ran_at"])
    in_window: dict[str, int] = {}
    doubles: dict[str, list[dict[str, Any]]] = {}
    cut_off = 0

    def killed_in_window(end: dict[str, Any], again: datetime) -> bool:
        for killed in kills.get(end["pid"], []):
            busy = [t for t in activity[end["pid"]] if end["ran_at"] < t < killed]
            if end["ran_at"] < killed < again and not busy:
                return True
        return False

    for dispatch_id, rows in runs.items():
        ends = [r for r in rows if r["phase"] == "end"]
        starts = [r for r in rows if r["phase"] == "start"]
        cut_off += len(starts) - len(ends)
        attempts = Counter(r["attempt"] for r in ends)
        if any(n > 1 for n in attempts.values()):
            doubles[dispatch_id] = rows  # two ends under one claim
            continue
        explained = 0
        for end in ends[:-1]:
            again = min(
                (r["ran_at"] for r in starts if r["attempt"] > end["attempt"]), default=None
            )
            if again is not None and killed_in_window(end, again):
                explained += 1
            else:
                doubles[dispatch_id] = rows
                break
        else:
            if succeeded[dispatch_id] > len(ends):
                doubles[dispatch_id] = rows  # reported succeeded more often than it ended
            elif explained:
                in_window[dispatch_id] = explained
    return Verdict(lost, in_window, doubles, cut_off)


SUCCEEDED = re.compile(r"Task record\[(\S+)\] succeeded in ")


def succeeded_counts(workers: list[Worker]) -> Counter[str]:
    """How many times Celery reported each dispatch's run succeeded, in the workers' logs."""
    return Counter(i for worker in workers for i in SUCCEEDED.findall(worker.log()))


RELAY_SEND = re.compile(r"relay sends dispatch (\S+) of job record \((\w+), send \d+\)")


def relay_sends(workers: list[Worker]) -> dict[str, set[str]]:
    """The dispatches each worker's relay sent, by the status they were sent from."""
    found: dict[str, set[str]] = defaultdict(set)
    for worker in workers:
        for dispatch_id, status in RELAY_SEND.findall(worker.log()):
            found[status].add(dispatch_id)
    return found


def held(folder: Path, pids: set[int]) -> set[str]:
    """The delivery each of these processes started last (see QP_TEST_DELIVERIES)."""
    found = set()
    for pid in pids:
        path = folder / str(pid)
        if path.exists() and (lines := path.read_text().split()):
            found.add(lines[-1])
    return found


def retried(stack: Stack) -> int:
    def query(conn: SqlConnection) -> int:
        return int(
            conn.execute(
                select(func.count()).select_from(dispatch_table).where(dispatch_table.c.attempt > 1)
            ).scalar_one()
        )

    return read(stack, query)


def skipped_deliveries(workers: list[Worker]) -> int:
    return sum(w.log().count("skipped (") for w in workers)


# --- the soak itself ----------------------------------------------------------------------


def soak(
    plan: Plan,
    stack: Stack,
    postgres: PostgresServer,
    restart_broker: Callable[[], None],
) -> Figures:
    figures = Figures()
    t = tag()
    quorum = stack.env.get("QP_TEST_QUEUE_TYPE") == "quorum"
    workers = [stack.worker, stack.start_worker()]
    tap = f"tap-{stack.queue_name}"
    started = time.monotonic()
    stream = Stream(
        stack,
        t,
        DISPATCHES,
        plan.seconds * DISPATCHES / 10_000,
        tap,
        figures,
        lambda: completed_count(stack),
    )
    timeline = Timeline(stack, stream).start()
    replayer = Replayer(stack, tap, quorum, figures).start()
    chaos = Chaos(
        plan, stream, workers, postgres, restart_broker, lambda: ids_in(stack, "queued"), figures
    )
    stream.start()
    chaos.start()
    try:
        stream.join(600)
        chaos.join(120)
        ids = set(stream.ids)
        assert len(ids) == len(stream.ids) == DISPATCHES, "publish returned duplicate ids"
        assert not stream.unexpected, stream.unexpected
        assert not stream.mismatches, (
            f"a key published again got another id: {stream.mismatches[:5]}"
        )

        done: set[str] = set()

        def all_completed() -> bool:
            done.clear()
            done.update(completed_ids(stack))
            if ids <= done:
                return True
            chaos.supervise()
            return False

        def not_completed() -> str:
            waiting = Counter(
                row.status for i in ids - done if (row := stack.ledger.get(i)) is not None
            )
            return (
                f"{len(ids - done)} dispatches not completed ({dict(waiting)}), e.g. "
                f"{[stack.ledger.get(i) for i in sorted(ids - done)[:3]]}; replayer "
                f"errors {dict(replayer.errors)}, publish errors {dict(stream.errors)}"
            )

        wait_until(all_completed, "every dispatch to complete", 240, 0.5, explain=not_completed)
        figures.seconds = round(time.monotonic() - started, 1)
    finally:
        stream.stop()
        chaos.stop()
        replayer.stop()
        timeline.stop()
        print("\n" + "\n".join(timeline.samples))
    # A graceful stop lets any run still going finish (and record its end) first.
    for worker in workers:
        worker.stop()

    verdict = judge(ids, runs_of(stack, t), chaos.kills, succeeded_counts(workers))
    sends = relay_sends(workers)
    figures.dispatches = len(ids)
    figures.lost = len(verdict.lost)
    figures.doubles_in_window = sum(verdict.doubles_in_window.values())
    figures.doubles = len(verdict.doubles)
    figures.cut_off_runs = verdict.cut_off
    resent = sends["queued"] & ids
    deliveries = Path(stack.env["QP_TEST_DELIVERIES"])
    by_child = resent & held(deliveries, chaos.killed["child"])
    by_main = resent & held(deliveries, chaos.killed["main"]) - by_child
    in_broker = resent & chaos.in_broker_at_restart - by_child - by_main
    figures.stranded_by_child_kills = len(by_child)
    figures.stranded_by_main_kills = len(by_main)
    figures.in_broker_at_restart = len(in_broker)
    figures.resent_other = len(resent - by_child - by_main - in_broker)
    figures.relay_pending = len(sends["pending"] & ids)
    figures.retried = retried(stack)
    figures.skipped = skipped_deliveries(workers)
    print(f"\nsoak on {plan.broker}: {figures.line()}")
    print(f"  publish errors {dict(stream.errors)}, replayer errors {dict(replayer.errors)}")

    assert statuses(stack) == Counter({"completed": DISPATCHES}), statuses(stack)
    assert not verdict.lost, f"published, never ran to its end: {sorted(verdict.lost)[:10]}"
    assert not verdict.doubles, f"completed twice: {list(verdict.doubles.items())[:3]}"
    assert figures.child_kills == plan.child_kills
    assert figures.main_kills == plan.main_kills
    assert figures.pg_restarts == plan.pg_restarts
    assert figures.broker_restarts == plan.broker_restarts
    assert figures.replayed_copies > 0 and figures.republished > 0
    assert figures.skipped > 0, "no duplicate delivery reached the fence"
    return figures


def soak_env(folder: Path) -> dict[str, str]:
    deliveries = folder / "deliveries"
    deliveries.mkdir()
    return {**SOAK_ENV, "QP_TEST_DELIVERIES": str(deliveries)}


SOAK_ENV = {
    "QP_TEST_LEASE": "10",
    "QP_TEST_RELAY": "0.5",
    "QP_TEST_REDELIVER": "10",
}


@pytest.fixture
def ledger_server() -> Iterator[PostgresServer]:
    """The ledger's own PostgreSQL: the soak restarts it."""
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.mark.timeout(900)
def test_soak_on_redis(
    ledger_server: PostgresServer, postgres: PostgresServer, tmp_path: Path
) -> None:
    redis = RedisServer().start()
    env = {
        **soak_env(tmp_path),
        "QP_TEST_LEDGER": ledger_server.create_database("soak"),
        # The handler records its runs where no restart reaches.
        "QP_TEST_RUNS": postgres.create_database("soakruns"),
        "QP_TEST_BROKER": redis.url(1),
        "QP_TEST_VISIBILITY": "10",
    }

    def restart_redis() -> None:
        redis.stop()
        time.sleep(OUTAGE_SECONDS)  # the outage itself
        redis.start()

    stack = build_stack(env, tmp_path, "redis")
    try:
        plan = Plan("redis", seconds=100, child_kills=30, main_kills=3, pg_restarts=2,
                    broker_restarts=2)  # fmt: skip
        soak(plan, stack, ledger_server, restart_redis)
    finally:
        stack.close()
        redis.close()


@pytest.mark.timeout(900)
def test_soak_on_rabbitmq_quorum_queues_with_confirms(
    ledger_server: PostgresServer, postgres: PostgresServer, tmp_path: Path
) -> None:
    rabbit = RabbitServer().start()
    env = {
        **soak_env(tmp_path),
        "QP_TEST_LEDGER": ledger_server.create_database("soak"),
        "QP_TEST_RUNS": postgres.create_database("soakruns"),
        "QP_TEST_BROKER": rabbit.url(),
        "QP_TEST_QUEUE_TYPE": "quorum",
        "QP_TEST_CONFIRM": "1",
    }

    def restart_rabbit() -> None:
        rabbit.stop()
        rabbit.start()

    stack = build_stack(env, tmp_path, "rabbitmq")
    try:
        plan = Plan("rabbitmq", seconds=100, child_kills=30, main_kills=3, pg_restarts=2,
                    broker_restarts=1)  # fmt: skip
        soak(plan, stack, ledger_server, restart_rabbit)
        worker_log = stack.worker.log()
        # Celery saw the quorum queue and left global QoS off, as it must for one.
        assert "Global QoS is disabled" in worker_log
    finally:
        stack.close()
        rabbit.close()
