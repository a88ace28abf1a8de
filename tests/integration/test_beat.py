"""Two real `celery beat` processes, a real worker, PostgreSQL and Redis, over two minute
boundaries: each tick of a questpie schedule and of a plain `beat_schedule` crontab
entry runs once, a change made from another process is picked up before the next tick,
and the beat that fired is killed with SIGKILL between the ticks while the next tick
still fires, once, from the other."""

from __future__ import annotations

import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab
from pydantic import BaseModel
from sqlalchemy import create_engine, text

from questpie_celery import JobContext, Questpie
from questpie_celery.beat import LedgerScheduler
from questpie_celery.jobs.definition import JobDefinition
from questpie_celery.ledger import open_ledger
from tests.support.faultproxy import FaultProxy
from tests.support.services import Beat, PostgresServer, RedisServer, Worker
from tests.support.waiting import wait_until

PROJECT = """
import os
from celery import Celery
from celery.schedules import crontab
from pydantic import BaseModel
from sqlalchemy import create_engine, text
from questpie_celery import JobContext, Questpie, job

app = Celery("beatproj", broker=os.environ["BP_BROKER"])
app.conf.task_default_queue = os.environ["BP_QUEUE"]
app.conf.beat_schedule = {
    "plain-every-minute": {"task": "beatproj.plain", "schedule": crontab()},
    "plain-every-20s": {"task": "beatproj.interval", "schedule": 20.0},
}
_engines = {}


def record(name, note, dispatch_id):
    engine = _engines.setdefault(os.getpid(), create_engine(os.environ["BP_LEDGER"]))
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO beat_runs (name, note, dispatch_id) VALUES (:n, :note, :d)"),
            {"n": name, "note": note, "d": dispatch_id},
        )


@app.task(name="beatproj.plain")
def plain():
    record("plain", None, plain.request.id)


@app.task(name="beatproj.interval")
def interval():
    record("interval", None, interval.request.id)


class Report(BaseModel):
    note: str


@job(name="beatproj.report", schema=Report)
def report(payload: Report, ctx: JobContext) -> None:
    record("report", payload.note, ctx.dispatch_id)


questpie = Questpie(app, ledger_url=os.environ["BP_LEDGER"], jobs=[report])
"""


class Report(BaseModel):
    note: str


def seconds_until(moment: datetime) -> float:
    """How long from now until `moment` (a tick's deadline), for `wait_until`."""
    return max((moment - datetime.now(UTC)).total_seconds(), 0.0)


@pytest.mark.timeout(420)
def test_two_beats_fire_each_tick_once_pick_up_changes_and_survive_a_kill(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    ledger = postgres.create_database("beat")
    env = {
        "BP_LEDGER": ledger,
        "BP_BROKER": redis_server.url(redis_server.new_db()),
        "BP_QUEUE": f"beat-{tmp_path.name}",
    }
    (tmp_path / "beatproj.py").write_text(textwrap.dedent(PROJECT))
    engine = create_engine(ledger)
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE beat_runs (name text, note text, dispatch_id text, "
                "ran_at timestamptz DEFAULT now())"
            )
        )
    # Another process's view: the test changes the schedule as an admin script would.
    admin = Questpie(
        Celery("admin", broker=env["BP_BROKER"]),
        ledger_url=ledger,
        jobs=[JobDefinition(name="beatproj.report", schema=Report, handler=_unused)],
    )
    admin.migrate()
    where = {"cwd": tmp_path, "pythonpath": str(tmp_path)}
    worker = Worker(env, app="beatproj:app", **where).start()
    beats = [Beat(env, app="beatproj:app", **where).start() for _ in range(2)]

    def runs() -> list[tuple[str, str | None, datetime]]:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT name, note, date_trunc('minute', ran_at) FROM beat_runs ORDER BY ran_at"
                )
            )
            return [(name, note, minute) for name, note, minute in found]

    def interval_slots() -> list[int]:
        with engine.connect() as conn:
            found = conn.execute(
                text(
                    "SELECT floor(extract(epoch FROM ran_at) / 20)::bigint FROM beat_runs "
                    "WHERE name = 'interval' ORDER BY ran_at"
                )
            )
            return [int(slot) for (slot,) in found]

    try:
        report = admin.queue["beatproj.report"]
        report.schedule({"note": "v1"}, "* * * * *")
        first = admin.schedules.list()[0].next_fire_at
        second = first + timedelta(minutes=1)

        wait_until(
            lambda: ("report", "v1", first) in runs(),
            "first report",
            seconds_until(first + timedelta(seconds=30)),
            0.2,
        )
        wait_until(
            lambda: ("plain", None, first) in runs(),
            "first plain run",
            seconds_until(first + timedelta(seconds=30)),
            0.2,
        )
        fired = [b for b in beats if "beatproj.report fired its" in b.log()]
        assert len(fired) == 1, [b.log() for b in beats]
        fired[0].kill()  # between the ticks, the beat that fired the first one
        survivor = next(b for b in beats if b is not fired[0])
        report.schedule({"note": "v2"}, "* * * * *")  # changed by another process

        wait_until(
            lambda: ("report", "v2", second) in runs(),
            "second report",
            seconds_until(second + timedelta(seconds=30)),
            0.2,
        )
        wait_until(
            lambda: ("plain", None, second) in runs(),
            "second plain run",
            seconds_until(second + timedelta(seconds=30)),
            0.2,
        )
        # A second beat would have doubled a tick as it came, before both of its runs
        # were seen. A control report published now is taken after every message sent
        # before it (one worker, a first-in first-out queue); once it completed and the
        # worker ended every delivery it took, whatever was doubled has run.
        control = report.publish(
            {"note": "control"}, idempotency_key="control", queue=env["BP_QUEUE"]
        )  # keyed: a ledgered dispatch, with a state to wait for
        assert control is not None
        wait_until(
            lambda: (status := admin.queue.get_status(control)) and status.status == "completed",
            "the control report to complete",
            60,
            0.2,
            explain=worker.log,
        )
        wait_until(
            lambda: worker.unfinished() == 0,
            "the worker to end every delivery it took",
            30,
            0.2,
            explain=worker.log,
        )
        settled = runs()
        reports = [
            (note, minute)
            for name, note, minute in settled
            if name == "report" and note != "control"
        ]
        assert reports == [("v1", first), ("v2", second)]
        plain_minutes = [minute for name, _, minute in settled if name == "plain"]
        assert plain_minutes.count(first) == 1 and plain_minutes.count(second) == 1
        assert len(plain_minutes) == len(set(plain_minutes))  # never two in one minute
        assert "beatproj.report fired its" in survivor.log()
        # The 20 s entry: never twice in one slot, and none missed between the two ticks
        # but, at most, the one whose beat was killed between its claim and its send.
        slots = interval_slots()
        assert len(slots) == len(set(slots)), slots
        span = range(int(first.timestamp()) // 20, int(second.timestamp()) // 20)
        assert len([s for s in span if s in slots]) >= len(span) - 1, (slots, list(span))
        for beat in beats:
            assert "Traceback" not in beat.log(), beat.log()
    finally:
        for beat in beats:
            beat.stop()
        worker.stop()
        admin.close()
        engine.dispose()


def _unused(payload: Report, ctx: JobContext) -> None:
    raise AssertionError("the test process never runs the job")


def test_a_claim_whose_reply_is_lost_is_read_back(postgres: PostgresServer) -> None:
    """A beat's tick claim commits, its reply is lost, the connection drops: the retried
    insert conflicts, and the beat reads back whether the claim was its own."""
    proxy = FaultProxy(postgres.port)
    direct = postgres.create_database("claim")
    other = open_ledger(direct)
    other.migration.migrate()
    through = open_ledger(proxy.url(direct, postgres.port))
    try:
        proxy.arm(b"INSERT INTO questpie_beat_tick")
        assert through.schedules.claim_beat_tick("entry", "t1") is True  # its own: it sends
        assert proxy.fired.is_set()
        assert other.schedules.claim_beat_tick("entry", "t1") is False
        assert other.schedules.claim_beat_tick("entry", "t2") is True
        assert through.schedules.claim_beat_tick("entry", "t2") is False  # another's: it does not
    finally:
        through.close()
        other.close()
        proxy.close()


def test_a_long_entry_name_is_claimed_on_postgresql(postgres: PostgresServer) -> None:
    ledger = postgres.create_database("names")
    app = Celery("names", broker="memory://")
    app.conf.task_default_queue = "names-idle"
    questpie = Questpie(app, ledger_url=ledger)
    questpie.migrate()
    try:
        entry = ScheduleEntry(
            name="reports." + "x" * 300, task="beatproj.plain", schedule=crontab(), app=app
        )
        for beat in (LedgerScheduler(app, lazy=True), LedgerScheduler(app, lazy=True)):
            beat.apply_entry(entry, producer=None)
        with app.connection_for_write() as conn:
            assert conn.default_channel.queue_declare("names-idle").message_count == 1
    finally:
        questpie.close()


QUIET_PROJECT = """
import os
from celery import Celery
from pydantic import BaseModel
from questpie_celery import JobContext, Questpie, job

app = Celery("quietbeat", broker=os.environ["BP_BROKER"])
app.conf.task_default_queue = os.environ["BP_QUEUE"]


class Report(BaseModel):
    note: str = ""


@job(name="quietbeat.report", schema=Report, options={"cron": "0 3 * * *"})
def report(payload: Report, ctx: JobContext) -> None:
    pass


questpie = Questpie(app, ledger_url=os.environ["BP_LEDGER"], jobs=[report])
"""


def test_a_beat_tells_of_a_ledger_outage_once_and_of_its_end_once(
    postgres: PostgresServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Beat reads the ledger's schedules every second. While the ledger cannot be reached
    it says so once, with the cause, and once when it is back; before, it warned
    `questpie schedules could not be read` on every one of those seconds."""
    proxy = FaultProxy(postgres.port)
    direct = postgres.create_database("quietbeat")
    migrated = open_ledger(direct)
    migrated.migration.migrate()
    env = {
        "BP_LEDGER": proxy.url(direct, postgres.port),
        "BP_BROKER": redis_server.url(redis_server.new_db()),
        "BP_QUEUE": f"quietbeat-{tmp_path.name}",
    }
    (tmp_path / "quietbeat.py").write_text(textwrap.dedent(QUIET_PROJECT))
    beat = Beat(env, app="quietbeat:app", cwd=tmp_path, pythonpath=str(tmp_path)).start()
    down = "the dispatch ledger cannot be reached ("
    back = "the dispatch ledger can be reached again, after"
    until = datetime.now(UTC) + timedelta(seconds=60)
    try:
        wait_until(migrated.schedules.listed, "the job's schedule stored", seconds_until(until))
        before = len(beat.log())
        proxy.cut()
        try:
            wait_until(lambda: down in beat.log()[before:], "the outage told", seconds_until(until))
            tries = proxy.refused
            wait_until(lambda: proxy.refused >= tries + 8, "eight more looks", seconds_until(until))
        finally:
            proxy.heal()
        wait_until(lambda: back in beat.log()[before:], "the ledger back", seconds_until(until))
        log = beat.log()[before:]
        assert log.count(down) == 1 and log.count(back) == 1, log
        assert "could not be read" not in log and "Traceback" not in log, log
        assert "OperationalError" in log.split(down)[1].splitlines()[0], log  # the cause
    finally:
        beat.stop()
        proxy.close()
        migrated.close()
