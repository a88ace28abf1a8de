"""schedule(), unschedule(), options.cron and firing ticks, on a SQLite ledger and an
in-memory broker nobody reads: what is stored, what is refused before anything is
written, and one dispatch per tick however many beats fire it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab
from celery.schedules import schedule as every
from click.testing import CliRunner
from pydantic import BaseModel, SecretStr
from sqlalchemy import insert, select, update

from questpie_celery import (
    JobContext,
    JobDefinitionError,
    PayloadValidationError,
    PublishOptionsError,
    Questpie,
)
from questpie_celery.beat import LedgerScheduler, tick_name
from questpie_celery.cli.commands import main
from questpie_celery.jobs.definition import JobDefinition
from questpie_celery.jobs.options import FIRE_KEY_PREFIX, StoredOptions
from questpie_celery.ledger import ScheduleRow, dispatch_table, open_ledger
from questpie_celery.ledger.schema import schedule_table
from questpie_celery.send.broker import LEDGER_SCHEDULER
from tests.support import jobapp
from tests.support.waiting import wait_until
from tests.unit.helpers import IdleApp, row_count, sqlite_url


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[IdleApp]:
    made = IdleApp.build(tmp_path)
    yield made
    made.close()


def stored(idle: IdleApp) -> list[ScheduleRow]:
    return [row for row, _ in idle.ledger.schedules.listed()]


def make_due(idle: IdleApp, job_name: str, at: datetime) -> None:
    with idle.ledger.engine.begin() as conn:
        conn.execute(
            update(schedule_table)
            .where(schedule_table.c.job_name == job_name)
            .values(next_fire_at=at)
        )


class Nightly(BaseModel):
    kind: str = "nightly"


class NeedsUser(BaseModel):
    user_id: str


def nothing(payload: BaseModel, ctx: JobContext) -> None:
    return None


def cron_job(cron: str | None, name: str = "cron.job") -> JobDefinition[Nightly]:
    # Made directly, not with @job: nothing here should join other tests' apps.
    return JobDefinition(
        name=name, schema=Nightly, handler=nothing, options={"cron": cron} if cron else {}
    )


def test_schedule_stores_one_schedule_per_job_and_a_second_call_replaces_it(
    idle: IdleApp,
) -> None:
    record = idle.questpie.queue.record
    called = datetime.now(UTC)
    assert record.schedule({"tag": "a"}, "0 6 * * *", tz="Europe/Prague", priority=3) is None
    (first,) = stored(idle)
    assert (first.cron, first.tz, first.payload["tag"]) == ("0 6 * * *", "Europe/Prague", "a")
    assert first.options.priority == 3
    local = first.next_fire_at.astimezone(ZoneInfo("Europe/Prague"))
    assert (local.hour, local.minute) == (6, 0) and first.next_fire_at > called

    record.schedule({"tag": "b"}, "*/5 * * * *", singleton_key="k", retry_limit=0)
    (second,) = stored(idle)
    assert (second.cron, second.tz, second.payload["tag"]) == ("*/5 * * * *", "UTC", "b")
    assert (second.singleton_key, second.options.priority) == ("k", None)
    assert second.options.run.retry_limit == 0
    assert [s.job_name for s in idle.questpie.schedules.list()] == ["record"]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"idempotency_key": "k"}, PublishOptionsError),
        ({"start_after": 30}, PublishOptionsError),
        ({"secret_payload": True}, PublishOptionsError),
        ({"priority": 10}, PublishOptionsError),
        ({"tz": "Mars/Base"}, PublishOptionsError),
        ({"queue": "a\x00b"}, PublishOptionsError),
    ],
)
def test_refused_options_are_value_errors_and_write_nothing(
    idle: IdleApp, options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error) as raised:
        idle.questpie.queue.record.schedule({"tag": "x"}, "0 6 * * *", **options)
    assert isinstance(raised.value, ValueError)
    assert stored(idle) == []


def test_a_bad_cron_payload_or_keyword_writes_nothing(idle: IdleApp) -> None:
    record = idle.questpie.queue.record
    with pytest.raises(PublishOptionsError):
        record.schedule({"tag": "x"}, "0 6 * *")
    with pytest.raises(PayloadValidationError):
        record.schedule({"tag": 5}, "0 6 * * *")
    with pytest.raises(TypeError, match="countdown"):
        record.schedule({"tag": "x"}, "0 6 * * *", countdown=5)
    assert stored(idle) == []


def test_unschedule_removes_every_schedule_of_the_job(idle: IdleApp) -> None:
    idle.questpie.register(cron_job("0 1 * * *"))
    idle.questpie.sync_job_schedules()
    client = idle.questpie.queue["cron.job"]
    client.schedule({}, "0 2 * * *")
    assert sorted(r.source for r in stored(idle)) == ["call", "option"]
    assert client.unschedule() is None
    assert stored(idle) == []
    idle.questpie.sync_job_schedules()  # a worker or beat starting brings the option back
    assert [r.source for r in stored(idle)] == ["option"]


def test_a_due_tick_fires_one_dispatch_however_many_beats_fire_it(
    idle: IdleApp, tmp_path: Path
) -> None:
    idle.questpie.queue.record.schedule({"tag": "tick"}, "* * * * *")
    tick = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=1)
    make_due(idle, "record", tick)
    _, other = jobapp.build(broker="memory://", ledger=sqlite_url(tmp_path), queue=idle.queue)
    fired_at = datetime.now(UTC)
    try:
        idle.questpie.schedules.fire_due()
        # A second beat that read the same tick before the first moved it on.
        make_due(idle, "record", tick)
        other.schedules.fire_due()
    finally:
        other.close()
    (row,) = stored(idle)
    assert row.last_fire_at == tick and row.next_fire_at > fired_at
    key = f"{FIRE_KEY_PREFIX}call:{tick:%Y-%m-%dT%H:%M:%SZ}"
    fired = idle.ledger.get(row.last_dispatch_id or "")
    assert fired is not None and fired.idempotency_key == key
    assert fired.payload == {**fired.payload, "tag": "tick"}
    assert idle.written() == (1, 1)  # one row, one message


def test_missed_ticks_fire_once_on_return(idle: IdleApp) -> None:
    idle.questpie.queue.record.schedule({"tag": "late"}, "* * * * *")
    make_due(idle, "record", datetime.now(UTC) - timedelta(minutes=30))
    fired_at = datetime.now(UTC)
    idle.questpie.schedules.fire_due()
    idle.questpie.schedules.fire_due()
    assert idle.written() == (1, 1)
    (row,) = stored(idle)
    assert row.next_fire_at > fired_at  # moved past every missed tick at once


def test_a_fire_goes_through_the_jobs_queue_policy(idle: IdleApp) -> None:
    stately = idle.questpie.queue.policy_stately
    waiting = stately.publish({"tag": "w"}, singleton_key="s")  # nobody reads: it waits
    assert waiting is not None
    stately.schedule({"tag": "report"}, "* * * * *", singleton_key="s")
    make_due(idle, "policy.stately", datetime.now(UTC) - timedelta(seconds=1))
    idle.questpie.schedules.fire_due()
    (info,) = idle.questpie.schedules.list()
    assert info.last_fire_at is not None and info.last_dispatch_id is None  # suppressed
    assert row_count(idle.ledger) == 1  # a stately report never piles up


def test_a_fire_with_the_broker_down_is_left_to_the_relay(tmp_path: Path) -> None:
    app, questpie = jobapp.build(
        broker="redis://127.0.0.1:9/0", ledger=sqlite_url(tmp_path), queue="nobody"
    )
    app.conf.broker_connection_retry = False
    app.conf.broker_transport_options = {"max_retries": 0, "socket_connect_timeout": 1}
    try:
        questpie.migrate()
        questpie.queue.record.schedule({"tag": "down"}, "* * * * *")
        own = open_ledger(sqlite_url(tmp_path))
        with own.engine.begin() as conn:
            conn.execute(
                update(schedule_table).values(next_fire_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        fired_at = datetime.now(UTC)
        questpie.schedules.fire_due()
        (after,) = questpie.schedules.list()
        assert after.last_dispatch_id is not None and after.next_fire_at > fired_at
        fired = own.get(after.last_dispatch_id)
        assert fired is not None and fired.status == "pending"  # the relay sends it later
        own.close()
    finally:
        questpie.close()


def test_cron_job_option_is_checked_against_the_schema_at_registration() -> None:
    with pytest.raises(JobDefinitionError, match=r"options\.cron.*user_id"):
        JobDefinition(
            name="needs", schema=NeedsUser, handler=nothing, options={"cron": "0 6 * * *"}
        )
    with pytest.raises(JobDefinitionError, match="cron"):
        cron_job("0 6 * *")


def test_option_schedules_follow_the_declaration(idle: IdleApp, tmp_path: Path) -> None:
    idle.questpie.register(cron_job("0 1 * * *"))
    idle.questpie.sync_job_schedules()
    (row,) = stored(idle)
    assert (row.source, row.cron, row.payload) == ("option", "0 1 * * *", {"kind": "nightly"})
    # Unchanged: its next tick is left alone (rewriting it could skip a tick).
    pinned = datetime(2030, 1, 1, 1, 0, tzinfo=UTC)
    make_due(idle, "cron.job", pinned)
    idle.questpie.sync_job_schedules()
    assert stored(idle)[0].next_fire_at == pinned

    def sync_with(definition: JobDefinition[Nightly]) -> list[ScheduleRow]:
        _, questpie = jobapp.build(
            broker="memory://", ledger=sqlite_url(tmp_path), queue=idle.queue
        )
        try:
            questpie.register(definition)
            questpie.sync_job_schedules()
        finally:
            questpie.close()
        return stored(idle)

    (changed,) = sync_with(cron_job("30 1 * * *"))
    assert changed.cron == "30 1 * * *" and changed.next_fire_at != pinned
    assert sync_with(cron_job(None)) == []  # the option removed: so is its schedule


def test_spent_fires_are_pruned_after_the_retention(idle: IdleApp) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=8)
    rows = [
        ("fire-old", f"{FIRE_KEY_PREFIX}call:2026-01-01T00:00:00Z", "completed", long_ago),
        ("fire-new", f"{FIRE_KEY_PREFIX}call:2026-11-01T00:00:00Z", "completed", datetime.now(UTC)),
        ("fire-waiting", f"{FIRE_KEY_PREFIX}call:2026-01-02T00:00:00Z", "queued", None),
        ("not-a-fire", "order:1", "completed", long_ago),
    ]
    with idle.ledger.engine.begin() as conn:
        for dispatch_id, key, status, finished in rows:
            conn.execute(
                insert(dispatch_table).values(
                    id=dispatch_id, job_name="record", idempotency_key=key, status=status,
                    options=StoredOptions(), attempt=1, send_count=0, secret=False,
                    run_after=long_ago, created_at=long_ago, finished_at=finished,
                )
            )  # fmt: skip
    idle.questpie.schedules.fire_due()  # a beat's pass prunes now and then: first, at once
    with idle.ledger.engine.connect() as conn:
        left = set(conn.execute(select(dispatch_table.c.id)).scalars())
    assert left == {"fire-new", "fire-waiting", "not-a-fire"}


def test_questpie_makes_beat_use_the_ledger_scheduler_unless_the_app_chose_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = sqlite_url(tmp_path)
    plain = Celery("plain", broker="memory://")
    Questpie(plain, ledger_url=url).close()
    assert plain.conf.beat_scheduler == LEDGER_SCHEDULER

    late = Celery("late", broker="memory://")
    Questpie(late, ledger_url=url).close()
    late.config_from_object({"beat_scheduler": "django_celery_beat.schedulers:DatabaseScheduler"})
    with caplog.at_level(logging.WARNING):
        assert late.conf.beat_scheduler == "django_celery_beat.schedulers:DatabaseScheduler"
    assert any("will not fire questpie schedules" in r.getMessage() for r in caplog.records)


def test_of_two_beats_one_sends_each_tick_of_a_beat_schedule_entry(idle: IdleApp) -> None:
    entry = ScheduleEntry(
        name="nightly-record", task="record", schedule=crontab(),
        args=({"tag": "entry"},), options={"queue": idle.queue}, app=idle.celery_app,
    )  # fmt: skip
    beats = [LedgerScheduler(idle.celery_app, lazy=True) for _ in range(2)]
    for beat in beats:
        beat.apply_entry(entry, producer=None)
    assert idle.messages() == 1


def test_tick_names_are_the_same_in_every_beat() -> None:
    app = Celery("t")
    at = datetime(2026, 11, 30, 12, 6, 42, tzinfo=UTC)
    # A */5 entry last run at 12:00: its 12:05 tick, whether a beat gets to it on time or
    # a minute late (named by when it fell due, not by when it is applied).
    five = ScheduleEntry(
        name="m", task="t", schedule=crontab(minute="*/5"), app=app,
        last_run_at=datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC),
    )  # fmt: skip
    assert tick_name(five, at) == "2026-11-30T12:05Z"
    ten = ScheduleEntry(name="i", task="t", schedule=every(timedelta(seconds=10)), app=app)
    slot = int(at.timestamp() // 10)
    assert tick_name(ten, at) == f"every 10s #{slot}"
    assert tick_name(ten, at + timedelta(seconds=9)) != tick_name(ten, at)  # 12:06:51: next


def test_interval_entries_fall_due_at_their_multiples_in_every_beat(idle: IdleApp) -> None:
    beat = LedgerScheduler(idle.celery_app, lazy=True)
    wait_until(  # stay clear of a slot edge while the test looks
        lambda: datetime.now(UTC).timestamp() % 30 <= 28, "the clock to leave a slot's end", 5
    )
    now = datetime.now(UTC)
    slot_start = datetime.fromtimestamp(now.timestamp() // 30 * 30, UTC)
    entry = ScheduleEntry(
        name="i", task="record", schedule=every(timedelta(seconds=30)), app=idle.celery_app,
        last_run_at=slot_start + timedelta(seconds=1),
    )  # fmt: skip
    due, wait = beat.is_due(entry)
    # This slot ran: wait for the next multiple of 30 s, and the 20 ms past it the
    # scheduler adds on purpose (Celery wakes a little early).
    assert not due and 0 < wait <= 30.02
    earlier = ScheduleEntry(
        name="i", task="record", schedule=every(timedelta(seconds=30)), app=idle.celery_app,
        last_run_at=slot_start - timedelta(seconds=1),
    )  # fmt: skip
    assert beat.is_due(earlier)[0]  # the previous slot ran: due, whenever this beat began


def test_an_interval_entrys_first_run_is_at_the_next_multiple(idle: IdleApp) -> None:
    idle.celery_app.conf.beat_schedule = {
        "every-30s": {"task": "record", "schedule": 30.0, "args": ({"tag": "i"},)}
    }
    try:
        beat = LedgerScheduler(idle.celery_app)
        entry = beat.schedule["every-30s"]
        now = datetime.now(UTC).timestamp()
        assert entry.last_run_at.timestamp() == now // 30 * 30
        # Celery's own first look (its heap) agrees: due at the next multiple of 30 s.
        due, wait = entry.is_due()
        assert not due and abs(now + wait - (now // 30 + 1) * 30) < 1
    finally:
        idle.celery_app.conf.beat_schedule = {}


def test_a_crontab_tick_is_named_alike_across_a_fall_back_night() -> None:
    app = Celery("dst")
    app.conf.timezone = "Europe/Prague"
    prague = ZoneInfo("Europe/Prague")
    # 2026-10-25: the daily 02:30 tick fell due at 00:30Z (02:30 CEST). A beat that gets
    # there at 01:10Z (02:10 CET, the repeated hour) names it as the punctual one did.
    late_now = datetime(2026, 10, 25, 1, 10, tzinfo=UTC).astimezone(prague)
    punctual_now = datetime(2026, 10, 25, 0, 30, 1, tzinfo=UTC).astimezone(prague)
    yesterday = datetime(2026, 10, 24, 0, 30, tzinfo=UTC)
    names = set()
    for now in (late_now, punctual_now):
        daily = crontab(hour=2, minute=30, app=app, nowfun=lambda now=now: now)
        entry = ScheduleEntry(name="d", task="t", schedule=daily, app=app, last_run_at=yesterday)
        names.add(tick_name(entry, now.astimezone(UTC)))
    assert names == {"2026-10-25T00:30Z"}


def test_a_schedule_no_beat_can_fire_does_not_spin_the_beat_nor_block_others(
    idle: IdleApp, tmp_path: Path
) -> None:
    idle.questpie.queue.record.schedule({"tag": "alive"}, "* * * * *")
    past = datetime.now(UTC) - timedelta(minutes=5)
    with idle.ledger.engine.begin() as conn:  # 600 schedules of jobs deleted from the code
        conn.execute(
            insert(schedule_table),
            [
                {
                    "job_name": f"gone-{n}", "source": "call", "cron": "* * * * *", "tz": "UTC",
                    "payload": {}, "options": StoredOptions(), "next_fire_at": past,
                    "updated_at": past,
                }
                for n in range(600)
            ],
        )  # fmt: skip
    make_due(idle, "record", past + timedelta(seconds=1))
    # The first passes learn which jobs this beat cannot fire (500 rows a pass); after
    # that a pass finds nothing to do and beat sleeps instead of looping.
    delays = [idle.questpie.schedules.fire_due() for _ in range(4)]
    assert delays[-2] > 0 and delays[-1] > 0
    assert idle.written() == (1, 1)  # the registered job's tick fired despite the 600
    result = CliRunner().invoke(
        main, ["unschedule", "gone-7", "--ledger-url", sqlite_url(tmp_path)]
    )
    assert result.exit_code == 0 and "1 schedule(s) removed" in result.output


def test_a_row_this_beat_cannot_read_is_skipped_and_the_others_fire(
    idle: IdleApp, caplog: pytest.LogCaptureFixture
) -> None:
    idle.questpie.queue.record.schedule({"tag": "fine"}, "* * * * *")
    past = datetime.now(UTC) - timedelta(minutes=5)
    rows = [  # a zone this host's tzdata lacks, and the same job's other, sound schedule
        ("call", "Atlantis/Capital", past),
        ("option", "UTC", past + timedelta(seconds=2)),
    ]
    with idle.ledger.engine.begin() as conn:
        for source, tz, at in rows:
            conn.execute(
                insert(schedule_table).values(
                    job_name="send-welcome-email", source=source, cron="* * * * *", tz=tz,
                    payload={"tag": "x"}, options=StoredOptions(), next_fire_at=at,
                    updated_at=past,
                )
            )  # fmt: skip
    make_due(idle, "record", past + timedelta(seconds=1))
    with caplog.at_level(logging.ERROR):
        idle.questpie.schedules.fire_due()
        idle.questpie.schedules.fire_due()
    # record fired, and so did the job's sound schedule; the unreadable one sent nothing.
    assert idle.written() == (2, 2)
    assert any("send-welcome-email" in r.getMessage() for r in caplog.records)


def test_schedule_refuses_a_zero_start_and_secret_fields(idle: IdleApp) -> None:
    class WithSecret(BaseModel):
        token: SecretStr

    for refused in ({"start_after": 0}, {"start_after": 0.0}, {"idempotency_key": ""}):
        with pytest.raises(PublishOptionsError):
            idle.questpie.queue.record.schedule({"tag": "x"}, "0 6 * * *", **refused)
    secretive = JobDefinition(name="secretive", schema=WithSecret, handler=nothing)
    idle.questpie.register(secretive)
    with pytest.raises(PublishOptionsError, match="secret"):
        idle.questpie.queue.secretive.schedule({"token": "t"}, "0 6 * * *")
    assert stored(idle) == []


def test_pruning_keeps_up_with_many_spent_fires(idle: IdleApp) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=8)
    with idle.ledger.engine.begin() as conn:
        conn.execute(
            insert(dispatch_table),
            [
                {
                    "id": f"spent-{n}", "job_name": "record", "status": "completed",
                    "idempotency_key": f"{FIRE_KEY_PREFIX}call:{n}", "options": StoredOptions(),
                    "attempt": 1, "send_count": 0, "secret": False, "run_after": long_ago,
                    "created_at": long_ago, "finished_at": long_ago,
                }
                for n in range(2500)
            ],
        )  # fmt: skip
    idle.questpie.schedules.fire_due()
    assert row_count(idle.ledger) == 0


def test_the_schedules_command_lists_every_schedule(idle: IdleApp, tmp_path: Path) -> None:
    idle.questpie.queue.record.schedule({"tag": "cli"}, "0 6 * * 1-5", tz="Europe/Prague")
    url = sqlite_url(tmp_path)
    listed = CliRunner().invoke(main, ["schedules", "--ledger-url", url, "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)
    assert (row["job_name"], row["source"], row["cron"], row["tz"]) == (
        "record", "call", "0 6 * * 1-5", "Europe/Prague"
    )  # fmt: skip
    assert row["last_fire_at"] is None and row["next_fire_at"]
    plain = CliRunner().invoke(main, ["schedules", "--ledger-url", url])
    assert "record" in plain.output and "never fired" in plain.output


def test_a_beat_entry_of_a_jobs_task_without_its_payload_is_reported_as_beat_starts(
    idle: IdleApp, caplog: pytest.LogCaptureFixture
) -> None:
    """Told once, when beat starts, not once a tick at the worker; an entry with its
    payload, and one of a plain task, are not."""
    app = idle.celery_app
    app.conf.beat_schedule = {
        "no payload": {"task": "record", "schedule": 3600.0},
        "keywords": {"task": "record", "schedule": 3600.0, "kwargs": {"tag": "x"}},
        "fine": {"task": "record", "schedule": 3600.0, "args": [{"tag": "x"}]},
        "plain": {"task": "tests.gather", "schedule": 3600.0},
    }
    with caplog.at_level(logging.ERROR, logger="questpie_celery.beat"):
        LedgerScheduler(app, lazy=True).setup_schedule()
    reported = sorted(r.getMessage().split(":")[0] for r in caplog.records)
    assert reported == ["beat entry 'keywords'", "beat entry 'no payload'"]
