"""Retention: ended dispatches deleted (unkeyed) or pruned (keyed) after the period, on
both dialects, by the relay and by `questpie-celery prune`; nothing else touched.

Rows are aged on the database's clock (`db_time`), the clock retention compares with.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish
from click.testing import CliRunner
from sqlalchemy import create_engine, delete, insert, inspect, select, text, update
from sqlalchemy.orm import Session

from questpie_celery import ConfigurationError, LedgerSchemaError, PublishOptionsError, Questpie
from questpie_celery.cli.commands import main
from questpie_celery.jobs.ids import derive_dispatch_id, random_dispatch_id
from questpie_celery.jobs.options import FIRE_KEY_PREFIX, RunOptions, StoredOptions
from questpie_celery.ledger import DispatchRow, Ledger, NewDispatch, dispatch_table
from questpie_celery.ledger.canvases import NewCanvas
from questpie_celery.ledger.schema import SCHEMA_VERSION, canvas_table, schema_version_table
from questpie_celery.ledger.statements import db_time
from questpie_celery.ops.operations import Operator
from questpie_celery.worker.retention import Retention
from tests.integration.conftest import StackFactory
from tests.support.brokers import capture, deliver
from tests.support.ledgers import lock_timeouts
from tests.support.stack import tag
from tests.support.waiting import wait_until

JOB = "record"
DAY = 86400.0
WEEK = 7 * DAY
OPTIONS = StoredOptions(run=RunOptions(retry_limit=3), priority=4, queue="q")


def _insert(ledger: Ledger, key: str | None = None, **fields: Any) -> str:
    dispatch_id = derive_dispatch_id(JOB, key) if key is not None else random_dispatch_id()
    new = NewDispatch(
        id=dispatch_id,
        job_name=JOB,
        idempotency_key=key,
        payload={"tag": key or "unkeyed"},
        options=OPTIONS,
        **fields,
    )
    assert ledger.dispatches.insert(new)
    return dispatch_id


def _ended(ledger: Ledger, status: str, key: str | None = None, days_ago: float = 8) -> str:
    """A dispatch that ran and ended `days_ago` days ago (by the database's clock)."""
    dispatch_id = _insert(ledger, key)
    claim = ledger.claims.claim(dispatch_id, JOB, 1, 60)
    assert claim.token is not None
    assert ledger.claims.finish(
        dispatch_id, claim.token, status, "RuntimeError" if status == "failed" else None
    )  # type: ignore[arg-type]
    _age(ledger, dispatch_id, days_ago * DAY)
    return dispatch_id


def _age(ledger: Ledger, dispatch_id: str, seconds: float, **values: Any) -> None:
    """Move every time of the row `seconds` into the past."""
    t = dispatch_table.c
    old = db_time(-seconds)
    values = {"created_at": old, "run_after": old, **values}
    row = ledger.get(dispatch_id)
    assert row is not None
    for column in ("queued_at", "started_at", "finished_at", "next_send_at"):
        if getattr(row, column) is not None:
            values.setdefault(column, old)
    with ledger.engine.begin() as conn:
        conn.execute(update(dispatch_table).where(t.id == dispatch_id).values(**values))


def _row(ledger: Ledger, dispatch_id: str) -> DispatchRow:
    row = ledger.get(dispatch_id)
    assert row is not None
    return row


def _prune(
    ledger: Ledger, older_than: float = WEEK, redeliver_after: float = 3600
) -> tuple[int, int]:
    done = Retention(ledger, older_than, redeliver_after=lambda: redeliver_after).prune(older_than)
    assert done.done
    return done.deleted, done.pruned


def test_old_ended_unkeyed_rows_are_deleted(ledger: Ledger) -> None:
    completed, failed = _ended(ledger, "completed"), _ended(ledger, "failed")
    recent = _ended(ledger, "completed", days_ago=1)
    assert _prune(ledger) == (2, 0)
    assert ledger.get(completed) is None and ledger.get(failed) is None
    assert _row(ledger, recent).status == "completed"
    assert _prune(ledger) == (0, 0)  # nothing left to do, and nothing done twice


def test_old_ended_keyed_rows_keep_their_key_and_lose_payload_and_options(
    ledger: Ledger,
) -> None:
    completed = _ended(ledger, "completed", key="order-1")
    failed = _ended(ledger, "failed", key="order-2")
    before = {i: _row(ledger, i) for i in (completed, failed)}
    assert _prune(ledger) == (0, 2)
    for dispatch_id, was in before.items():
        row = _row(ledger, dispatch_id)
        assert row.pruned and not was.pruned
        assert (row.payload, row.options) == (None, StoredOptions())
        # Everything that answers the key, and every time, is kept as it was.
        assert row == replace(was, payload=None, options=StoredOptions(), pruned=True)
    # The same key gets the same id and runs nothing: the insert meets the row, and a
    # delivery of it finds it done.
    again = NewDispatch(
        id=completed, job_name=JOB, idempotency_key="order-1", payload={}, options=OPTIONS
    )
    assert ledger.dispatches.insert(again) is False
    assert ledger.claims.claim(completed, JOB, 1, 60).outcome == "done"
    assert ledger.claims.claim(completed, JOB, 2, 60).outcome == "done"
    # The operator sees that the options are gone, not defaults in their place; a pruned
    # failed dispatch cannot be requeued, its payload being gone.
    operator = Operator(ledger)
    shown = operator.show(failed)
    assert shown is not None
    assert (shown.pruned, shown.payload, shown.retry_limit, shown.expire_in_seconds) == (
        True,
        None,
        None,
        None,
    )
    assert (shown.status, shown.last_error, shown.idempotency_key) == (
        "failed",
        "RuntimeError",
        "order-2",
    )
    with pytest.raises(PublishOptionsError, match="retention"):
        operator.requeue(failed)
    assert ledger.views.requeue(failed) is False  # the statement refuses it too
    assert _prune(ledger) == (0, 0)


def test_a_row_that_has_not_ended_is_never_touched_whatever_its_age(ledger: Ledger) -> None:
    ids: dict[str, str] = {}
    for keyed in (False, True):

        def key(status: str, keyed: bool = keyed) -> str | None:
            return f"{status}-k" if keyed else None

        ids[f"pending{keyed}"] = _insert(ledger, key("pending"))
        ids[f"queued{keyed}"] = queued = _insert(ledger, key("queued"))
        ledger.dispatches.mark_queued([queued], 3600)
        ids[f"active{keyed}"] = active = _insert(ledger, key("active"))
        ledger.claims.claim(active, JOB, 1, 60)
        ids[f"retry{keyed}"] = retrying = _insert(ledger, key("retry"))
        token = ledger.claims.claim(retrying, JOB, 1, 60).token
        assert token is not None
        assert ledger.claims.retry(retrying, token, retry_in=3600, relay_in=3600, error="E")
        ids[f"parked{keyed}"] = parked = _insert(ledger, key("parked"))
        assert ledger.slots.park(parked, JOB, 1)
    # A year old, and even with a finish time, which no such row has: only the status
    # decides, so nothing here may go.
    for dispatch_id in ids.values():
        _age(ledger, dispatch_id, 365 * DAY, finished_at=db_time(-365 * DAY))
    before = {i: _row(ledger, i) for i in ids.values()}
    assert {r.status for r in before.values()} == {"pending", "queued", "active", "retry", "parked"}
    assert _prune(ledger, older_than=0) == (0, 0)
    assert {i: _row(ledger, i) for i in ids.values()} == before


def test_an_unkeyed_row_stays_while_a_copy_of_its_message_may_come_again(
    ledger: Ledger,
) -> None:
    """Its id may be a plain call's, taken into the ledger: a copy the broker hands out
    again is refused only while the row says it ran."""
    hour = 3600.0
    minutes_ago = _ended(ledger, "completed", days_ago=120 / DAY)
    hours_ago = _ended(ledger, "failed", days_ago=2 * hour / DAY)
    keyed = _ended(ledger, "completed", key="k", days_ago=120 / DAY)
    retention = Retention(ledger, 60, redeliver_after=lambda: hour)
    assert (retention.prune(60).deleted, retention.prune(0).deleted) == (1, 0)
    assert ledger.get(hours_ago) is None
    assert _row(ledger, minutes_ago).status == "completed"
    assert ledger.claims.claim(minutes_ago, JOB, 1, 60).outcome == "done"  # a copy is refused
    assert _row(ledger, keyed).pruned  # a keyed row keeps its id anyway: the period holds
    # The period still counts when it is the longer one.
    assert Retention(ledger, WEEK, redeliver_after=lambda: 60).prune(WEEK).deleted == 0
    assert Retention(ledger, 60, redeliver_after=lambda: 60).prune(60).deleted == 1


def test_a_lazily_configured_apps_prune_keeps_unkeyed_rows_for_its_visibility_timeout(
    tmp_path: Path,
) -> None:
    """A Celery app configured with `config_from_object` (as a Django project's is) reads
    its settings only when something first reads one; a process that only prunes (the
    `prune` command, a cron job) has sent and consumed nothing. Its floor is still the
    broker's visibility timeout (two hours here), not the default hour."""
    hour = 3600.0
    settings = SimpleNamespace(
        broker_url="redis://127.0.0.1:1/0",  # never connected to
        broker_transport_options={"visibility_timeout": 2 * hour},
    )
    celery_app = Celery("lazy")
    celery_app.config_from_object(settings)
    questpie = Questpie(celery_app, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    try:
        assert not celery_app.configured
        questpie.migrate()
        within = _ended(questpie._ledger, "completed", days_ago=1.5 * hour / DAY)
        past = _ended(questpie._ledger, "completed", days_ago=2.5 * hour / DAY)
        assert questpie.prune(older_than=0).deleted == 1
        assert questpie._ledger.get(past) is None
        assert _row(questpie._ledger, within).status == "completed"
    finally:
        questpie.close()


def test_the_period_is_honoured(ledger: Ledger) -> None:
    six = [_ended(ledger, "completed", days_ago=6), _ended(ledger, "failed", "six", days_ago=6)]
    eight = [_ended(ledger, "completed"), _ended(ledger, "failed", "eight")]
    assert _prune(ledger, WEEK) == (1, 1)
    assert ledger.get(eight[0]) is None and _row(ledger, eight[1]).pruned
    assert [_row(ledger, i).pruned for i in six] == [False, False]
    assert _prune(ledger, 5 * DAY) == (1, 1)
    assert ledger.get(six[0]) is None and _row(ledger, six[1]).pruned


def test_batches_follow_each_other_until_none_is_left(ledger: Ledger) -> None:
    unkeyed = [_ended(ledger, "completed") for _ in range(5)]
    keyed = [_ended(ledger, "completed", key=f"k{n}") for n in range(4)]
    done = Retention(ledger, WEEK).prune(WEEK, batch=2)
    assert (done.deleted, done.pruned, done.done) == (5, 4, True)
    assert all(ledger.get(i) is None for i in unkeyed)
    assert all(_row(ledger, i).pruned for i in keyed)


def test_schedule_fires_are_left_to_the_beat(ledger: Ledger) -> None:
    fire = _ended(ledger, "completed", key=f"{FIRE_KEY_PREFIX}call:2026-01-01T06:00:00Z")
    before = _row(ledger, fire)
    assert _prune(ledger) == (0, 0)
    assert _row(ledger, fire) == before
    # The beat's own pruning deletes it (after its fire_retention, a week by default).
    assert ledger.retention.prune_schedule_history(
        key_prefix=FIRE_KEY_PREFIX, older_than=WEEK, limit=10
    )
    assert ledger.get(fire) is None


def test_the_prune_command(ledger: Ledger) -> None:
    url = ledger.engine.url.render_as_string(hide_password=False)
    unkeyed, keyed = _ended(ledger, "completed", days_ago=3), _ended(ledger, "failed", "c", 3)
    old = _ended(ledger, "completed", days_ago=8)
    default = CliRunner().invoke(main, ["prune", "--ledger-url", url])  # a week
    assert default.exit_code == 0, default.output
    assert "deleted 1 ended unkeyed dispatch(es) and pruned 0" in default.output
    assert ledger.get(old) is None and ledger.get(unkeyed) is not None
    shorter = CliRunner().invoke(main, ["prune", "--ledger-url", url, "--older-than", "86400"])
    assert shorter.exit_code == 0, shorter.output
    assert "deleted 1 ended unkeyed dispatch(es) and pruned 1 ended keyed" in shorter.output
    assert ledger.get(unkeyed) is None and _row(ledger, keyed).pruned
    refused = CliRunner().invoke(main, ["prune", "--ledger-url", url, "--older-than", "-1"])
    assert refused.exit_code != 0


def test_an_older_schema_is_a_schema_error_and_the_relay_says_so_once(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(delete(schema_version_table))
        conn.execute(insert(schema_version_table).values(version=3, applied_at=db_time()))
    stale = Ledger(ledger.engine)  # a process that has not seen the new schema
    old = _ended(stale, "completed")
    with pytest.raises(LedgerSchemaError, match="migrate"):
        stale.retention.prune_ended(
            keyed=False, older_than=0, limit=10, spare_key_prefix=FIRE_KEY_PREFIX
        )
    retention = Retention(stale, WEEK)
    with caplog.at_level(logging.WARNING, logger="questpie_celery.worker.retention"):
        retention.now_and_then()
        retention._next_run = 0.0  # as if five minutes had passed
        retention.now_and_then()
    (warning,) = [r.getMessage() for r in caplog.records]  # once, not on every retry
    assert "migrate" in warning
    assert stale.get(old) is not None
    stale.migration.migrate()
    retention.now_and_then()  # not yet: it waits out its retry time
    assert stale.get(old) is not None
    retention._next_run = 0.0
    retention.now_and_then()
    assert stale.get(old) is None


def test_migrating_a_version_3_ledger_lets_options_be_pruned(ledger: Ledger) -> None:
    """A ledger made before retention: `options NOT NULL`, no index on finished_at."""
    keyed = _ended(ledger, "completed", key="v3")
    waiting = _insert(ledger, "v3-waiting", policy=None)
    _make_version_3(ledger)
    columns = {c["name"]: c for c in inspect(ledger.engine).get_columns("questpie_queue_dispatch")}
    assert not columns["options"]["nullable"]
    assert ledger.migration.migrate() == SCHEMA_VERSION
    assert ledger.migration.migrate() == SCHEMA_VERSION
    inspector = inspect(ledger.engine)
    columns = {c["name"]: c for c in inspector.get_columns("questpie_queue_dispatch")}
    assert columns["options"]["nullable"]
    indexes = {i["name"] for i in inspector.get_indexes("questpie_queue_dispatch")}
    assert {index.name for index in dispatch_table.indexes} <= indexes
    # The rows came through whole, and the slot indexes still hold.
    assert _row(ledger, waiting).options == OPTIONS
    assert _prune(ledger) == (0, 1)
    assert _row(ledger, keyed).pruned


def _make_version_3(ledger: Ledger) -> None:
    """Turn a migrated ledger back into what version 3 created."""
    name = "questpie_queue_dispatch"
    with ledger.engine.begin() as conn:
        conn.execute(text("DROP INDEX questpie_queue_dispatch_ended"))
        conn.execute(delete(schema_version_table).where(schema_version_table.c.version >= 4))
        conn.execute(insert(schema_version_table).values(version=3, applied_at=db_time()))
        if ledger.dialect == "postgresql":
            conn.execute(text(f"ALTER TABLE {name} ALTER COLUMN options SET NOT NULL"))
            return
        # SQLite: the same table, its options column NOT NULL again.
        (sql,) = conn.execute(
            text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :name"),
            {"name": name},
        ).one()
        assert "options JSON," in sql
        conn.execute(text(f"ALTER TABLE {name} RENAME TO old_dispatch"))
        conn.execute(text(sql.replace("options JSON,", "options JSON NOT NULL,")))
        conn.execute(text(f"INSERT INTO {name} SELECT * FROM old_dispatch"))
        conn.execute(text("DROP TABLE old_dispatch"))


def test_retention_skips_a_row_another_transaction_holds_instead_of_waiting(
    pg_ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    held, free = _ended(pg_ledger, "completed"), _ended(pg_ledger, "completed")
    with pg_ledger.engine.connect().execution_options(isolation_level="READ COMMITTED") as conn:
        tx = conn.begin()
        conn.execute(
            select(dispatch_table.c.id).where(dispatch_table.c.id == held).with_for_update()
        )
        # The row stays held until the rollback below: a prune that waited for it would
        # meet the lock timeout.
        with lock_timeouts(monkeypatch) as timeouts:
            assert _prune(pg_ledger) == (1, 0)
        assert timeouts == []
        assert pg_ledger.get(free) is None
        tx.rollback()
    assert _prune(pg_ledger) == (1, 0)
    assert pg_ledger.get(held) is None


def test_retention_is_configured_on_questpie(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"

    def made(**kwargs: Any) -> Questpie:
        return Questpie(Celery("cfg", broker="memory://"), ledger_url=url, **kwargs)

    default = made()
    assert default.retention == WEEK
    default.close()
    daily = made(retention=timedelta(days=1))
    assert daily.retention == DAY
    daily.close()
    for wrong in (0, -1, float("inf"), float("nan"), "7d", True, timedelta(0)):
        with pytest.raises(ConfigurationError, match="retention"):
            made(retention=wrong)
    forever = made(retention=None)
    assert forever.retention is None
    forever.migrate()
    with pytest.raises(ConfigurationError, match="for ever"):
        forever.prune()
    old = _ended(forever._ledger, "completed")
    assert forever.prune(older_than=timedelta(days=7)).deleted == 1
    assert forever._ledger.get(old) is None
    with pytest.raises(ConfigurationError, match="older_than"):
        forever.prune(older_than=-1)
    forever.close()


def test_the_running_relay_applies_retention(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    questpie = Questpie(Celery("relay", broker="memory://"), ledger_url=url, retention=DAY)
    questpie.migrate()
    ledger = questpie._ledger
    unkeyed, keyed = _ended(ledger, "completed", days_ago=2), _ended(ledger, "failed", "r", 2)
    recent = _ended(ledger, "completed", days_ago=0.5)
    stop = threading.Event()
    relay = threading.Thread(target=questpie.run_relay, kwargs={"stop": stop})
    relay.start()
    try:
        # Its first pass applies retention at once; later ones at most once a minute.
        wait_until(lambda: ledger.get(unkeyed) is None, "the relay to delete the old row")
        wait_until(lambda: _row(ledger, keyed).pruned, "the relay to prune the keyed row")
    finally:
        stop.set()
        relay.join(10)
        questpie.close()
    assert _row(ledger, recent).status == "completed"


@pytest.mark.parametrize(("broker", "dialect"), [("redis", "postgresql"), ("filesystem", "sqlite")])
def test_a_worker_prunes_and_a_pruned_key_never_runs_again(
    make_stack: StackFactory, broker: str, dialect: str
) -> None:
    stack = make_stack(broker, ledger=dialect)
    t = tag()
    key = f"{t}:once"
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=key)
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "completed")
    stack.wait_runs(t, 1)
    _age(stack.ledger, dispatch_id, 8 * DAY)
    # A worker's relay applies retention as it starts, then once a minute.
    second = stack.start_worker()
    assert second is not None
    wait_until(lambda: _row(stack.ledger, dispatch_id).pruned, "a relay to prune it", 30)
    sent: list[object] = []

    def on_publish(sender: object = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append((headers or {}).get("id"))

    before_task_publish.connect(on_publish, weak=False)
    try:
        again = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=key)
        fresh = stack.questpie.queue.record.publish({"tag": f"{t}-fresh"}, idempotency_key=t)
        assert stack.questpie.flush(30)  # the fresh key's send is made after publish returns
    finally:
        before_task_publish.disconnect(on_publish)
    assert again == dispatch_id
    # Answered from the ledger: no message (the fresh key's shows one would be seen), so
    # no second run can come.
    assert sent == [fresh]
    assert len(stack.runs(t)) == 1
    assert _row(stack.ledger, dispatch_id).status == "completed"


@pytest.mark.parametrize(
    ("broker", "env"),
    [("redis", {"QP_TEST_VISIBILITY": "7200"}), ("rabbitmq", {})],
    ids=["redis-visibility-2h", "rabbitmq"],
)
def test_pruning_never_lets_a_plain_calls_redelivered_copy_run_again(
    make_stack: StackFactory, broker: str, env: dict[str, str]
) -> None:
    """A plain call of a policy job runs under a row of its message's id. Retention keeps
    that row while the broker may still hand the message out again: at least
    `redeliver_after` (an hour here) and the broker's visibility timeout (Redis: 2 h)."""
    stack = make_stack(broker, env={"QP_TEST_RETENTION": "60", **env})
    window = 7200.0 if broker == "redis" else 3600.0
    t, idle = tag(), f"idle-{tag()}"
    sent = stack.questpie.tasks["policy.short"].apply_async(args=[{"tag": t}], queue=idle)
    message = capture(stack, idle)
    assert "questpie" not in message.headers  # a plain Celery message
    deliver(stack, message)
    assert stack.wait_status(sent.id, "completed").idempotency_key is None
    # Long past the app's retention, not yet past the window: kept, by the relay's
    # retention and by an explicit prune alike.
    _age(stack.ledger, sent.id, window - 600)
    assert stack.questpie.prune().deleted == 0
    assert stack.questpie.prune(older_than=0).deleted == 0
    deliver(stack, message)  # the same message again, byte for byte: a redelivery
    stack.wait_log(sent.id, "skipped (done)")
    assert [(r["dispatch_id"], r["attempt"]) for r in stack.runs(t)] == [(sent.id, 1)]
    # Past the window, it goes like any ended unkeyed dispatch.
    _age(stack.ledger, sent.id, window + 600)
    assert stack.questpie.prune().deleted == 1
    assert stack.ledger.get(sent.id) is None


def test_a_relaxed_fence_takes_back_no_stale_copy_of_a_row_retention_deleted(
    make_stack: StackFactory,
) -> None:
    """On a relaxed ledger the fence writes a missing row again from its message, but
    only for a message younger than half the time the ledger keeps finished rows: here
    retention's 4 s (unkeyed rows), not the fires' week."""
    stack = make_stack(
        "redis", start_worker=False, env={"QP_TEST_DURABILITY": "relaxed", "QP_TEST_RETENTION": "4"}
    )
    t = tag()
    app_engine = create_engine(stack.env["QP_TEST_LEDGER"])  # the application's own
    with Session(app_engine) as session:  # a transactional publish is ledgered
        dispatch_id = stack.questpie.queue.record.publish({"tag": t}, session=session)
        session.commit()
    app_engine.dispose()
    assert dispatch_id is not None and _row(stack.ledger, dispatch_id).idempotency_key is None
    message = capture(stack, stack.queue_name)
    deliver(stack, message)  # the copy that runs
    stack.worker.start()
    stack.wait_status(dispatch_id, "completed")
    # Pruned once it is 4 s old: its message, published before, is older still.
    wait_until(
        lambda: _prune(stack.ledger, older_than=4, redeliver_after=4) == (1, 0),
        "the row old enough to prune",
    )
    deliver(stack, message)  # a stale duplicate: a redelivery, a copy the relay sent
    stack.wait_log(dispatch_id, "older than rows the ledger has pruned")
    assert len(stack.runs(t)) == 1
    assert stack.ledger.get(dispatch_id) is None


def test_a_row_under_a_keys_id_that_does_not_know_its_key_is_kept(ledger: Ledger) -> None:
    # What a relaxed ledger's fence writes again from a message: the key's id, no key.
    dispatch_id = _ended(ledger, "completed")
    derived = derive_dispatch_id(JOB, "lost-key")
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table).where(dispatch_table.c.id == dispatch_id).values(id=derived)
        )
    assert _prune(ledger) == (0, 1)  # pruned like a keyed row, not deleted
    row = _row(ledger, derived)
    assert row.pruned and row.status == "completed"


def test_a_pruned_rows_result_goes_with_its_payload_and_an_old_canvas_is_deleted(
    ledger: Ledger,
) -> None:
    """What a run returned is the application's data, as its payload: pruned with it. A
    chord or batch that ended over the period ago is deleted (its members are pruned
    as any dispatch); an open one, and one that ended within it, stay."""
    dispatch_id = _insert(ledger, "order-result")
    claim = ledger.claims.claim(dispatch_id, JOB, 1, 60)
    assert claim.token is not None
    kept = {"content_type": "application/json", "content_encoding": "utf-8", "body": "42"}
    assert ledger.claims.finish(dispatch_id, claim.token, "completed", None, kept)
    assert _row(ledger, dispatch_id).result == kept
    _age(ledger, dispatch_id, 8 * DAY)
    with ledger.canvases.session() as session, session.begin():
        for name in ("old", "recent", "open"):
            ledger.canvases.record(
                NewCanvas(id=f"canvas-{name}", kind="batch", members=[]), session.connection()
            )
    for name, days in (("old", 8), ("recent", 1)):
        with ledger.canvases.closing(f"canvas-{name}", "completed") as ended:
            assert ended is not None
        t = canvas_table.c
        with ledger.engine.begin() as conn:
            conn.execute(
                update(canvas_table)
                .where(t.id == f"canvas-{name}")
                .values(finished_at=db_time(-days * DAY))
            )
    assert _prune(ledger) == (0, 1)
    assert _row(ledger, dispatch_id).result is None
    assert ledger.canvases.get("canvas-old") is None
    assert ledger.canvases.get("canvas-recent") is not None
    assert ledger.canvases.get("canvas-open") is not None
