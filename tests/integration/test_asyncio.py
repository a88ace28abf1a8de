"""apublish, apublish_many, aget_receipt and aget_status from an event loop, against
PostgreSQL, Redis and a real prefork worker (and the embedded SQLite ledger).

Each test runs its own event loop with `asyncio.run`, as a script would; an ASGI
server runs one for its life. Every loop's own asyncio engine is closed by
`questpie.aclose()` before the loop ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.signals import before_task_publish
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from questpie_celery import (
    LedgerUnavailableError,
    PayloadValidationError,
    PublishOptionsError,
    derive_dispatch_id,
)
from questpie_celery.ledger import dispatch_table, open_ledger
from tests.integration.conftest import new_stack
from tests.integration.test_faults import closed_ledger_url, depth
from tests.support import jobapp
from tests.support.aio import run
from tests.support.brokers import capture, queue_depth
from tests.support.services import RedisServer, free_port
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

SECRET = "an asyncio test secret of at least 32 bytes"


@pytest.fixture(scope="module")
def pg_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """PostgreSQL ledger, Redis, a prefork worker, and a secret for secret payloads."""
    made = new_stack(
        request, tmp_path_factory.mktemp("astack"), "redis", env={"QP_TEST_SECRET": SECRET}
    )
    yield made
    made.close()


@pytest.fixture(scope="module")
def app_url(pg_redis: Stack) -> str:
    return pg_redis.env["QP_TEST_LEDGER"]


def rows_with_tag(stack: Stack, t: str) -> int:
    with stack.ledger.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(dispatch_table)
                .where(dispatch_table.c.payload["tag"].as_string() == t)
            ).scalar_one()
        )


def test_apublish_keyed_runs_once_and_answers_repeats_with_the_same_id(pg_redis: Stack) -> None:
    t = tag()
    record = pg_redis.questpie.queue.record

    async def body() -> list[str | None]:
        # Fifty concurrent publishes of one key: one row, one run, one id for all.
        return await asyncio.gather(
            *(record.apublish({"tag": t}, idempotency_key=f"a:{t}") for _ in range(50))
        )

    ids = run(pg_redis.questpie, body)
    assert set(ids) == {derive_dispatch_id("record", f"a:{t}")}
    row = pg_redis.wait_status(ids[0] or "", "completed")
    assert row.attempt == 1
    assert len(pg_redis.runs(t)) == 1
    assert rows_with_tag(pg_redis, t) == 1


def test_apublish_unkeyed_is_a_plain_message_that_runs(pg_redis: Stack) -> None:
    t = tag()
    dispatch_id = run(
        pg_redis.questpie, lambda: pg_redis.questpie.queue.record.apublish({"tag": t})
    )
    assert dispatch_id is not None
    pg_redis.wait_runs(t, 1)
    assert pg_redis.ledger.get(dispatch_id) is None  # no ledger row, as publish()


def test_apublish_rejects_bad_input_before_writing_anything(pg_redis: Stack) -> None:
    record = pg_redis.questpie.queue.record
    before = pg_redis.dispatch_count()
    with pytest.raises(PayloadValidationError, match="tag: missing"):
        run(pg_redis.questpie, lambda: record.apublish({}, idempotency_key="bad"))
    with pytest.raises(PublishOptionsError):
        run(pg_redis.questpie, lambda: record.apublish({"tag": "x"}, priority=99))
    with pytest.raises(TypeError, match="idempotency_key"):
        run(pg_redis.questpie, lambda: record.apublish({"tag": "x"}, idempotency="k"))  # type: ignore[call-arg]
    with pytest.raises(PublishOptionsError, match="AsyncSession"):
        run(pg_redis.questpie, lambda: record.apublish({"tag": "x"}, session=object()))  # type: ignore[arg-type]
    assert pg_redis.dispatch_count() == before


def test_apublish_many_decides_as_publish_many_does(pg_redis: Stack) -> None:
    """The same inputs through apublish_many and publish_many: the same suppressions (a
    `short` slot taken earlier in the batch), the same rows."""
    short = pg_redis.questpie.queue.policy_short
    t1, t2 = tag(), tag()

    def inputs(t: str) -> dict[str, Any]:
        return {
            "payloads": [{"tag": t, "sleep": 0.2} for _ in range(4)],
            # Keyed items go to the job's one unkeyed slot, which the two calls would
            # share: slots of their own keep the calls apart.
            "singleton_keys": [f"{t}:slot", f"{t}:slot", f"{t}:other", f"{t}:slot"],
        }

    got = run(pg_redis.questpie, lambda: short.apublish_many(**inputs(t1)))
    want = short.publish_many(**inputs(t2))
    suppressed = [i is None for i in got]
    assert suppressed == [i is None for i in want] == [False, True, False, True]
    assert rows_with_tag(pg_redis, t1) == rows_with_tag(pg_redis, t2) == 2
    for dispatch_id in (*got, *want):
        if dispatch_id is not None:
            pg_redis.wait_status(dispatch_id, "completed", timeout=60)


def test_apublish_many_unkeyed_items_are_plain_messages(pg_redis: Stack) -> None:
    t = tag()
    ids = run(
        pg_redis.questpie,
        lambda: pg_redis.questpie.queue.record.apublish_many([{"tag": t}] * 5),
    )
    assert len(set(ids)) == 5
    pg_redis.wait_runs(t, 5)
    assert rows_with_tag(pg_redis, t) == 0


# --- in the caller's AsyncSession / AsyncConnection -------------------------------------


@pytest.fixture
def caller_engine(app_url: str) -> Iterator[Callable[[], AsyncEngine]]:
    """The application's own asyncio engine on the ledger's database, made in the loop
    that uses it."""
    made: list[AsyncEngine] = []

    def make() -> AsyncEngine:
        made.append(create_async_engine(app_url))
        return made[-1]

    yield make


def test_session_commit_sends_after_commit_and_rollback_leaves_nothing(
    pg_redis: Stack, caller_engine: Callable[[], AsyncEngine]
) -> None:
    t = tag()
    record = pg_redis.questpie.queue.record

    async def body() -> tuple[str | None, str | None, bool]:
        engine = caller_engine()
        try:
            async with AsyncSession(engine) as session, session.begin():
                kept = await record.apublish({"tag": t}, session=session, idempotency_key=f"s:{t}")
                # Not committed yet: nobody else sees it.
                unseen = pg_redis.ledger.get(kept or "") is None
            async with AsyncSession(engine) as session, session.begin():
                dropped = await record.apublish(
                    {"tag": t + "-rolled-back"}, session=session, idempotency_key=f"r:{t}"
                )
                await session.rollback()
            return kept, dropped, unseen
        finally:
            await engine.dispose()

    kept, dropped, unseen = run(pg_redis.questpie, body)
    assert unseen
    row = pg_redis.wait_status(kept or "", "completed")
    assert row.attempt == 1
    assert len(pg_redis.runs(t)) == 1
    assert pg_redis.ledger.get(dropped or "") is None
    # Nothing was sent for the rolled-back one: the worker, having taken every message
    # sent until now, never received a delivery of it.
    pg_redis.wait_taken()
    assert pg_redis.worker.log_about(dropped or "") == []
    assert pg_redis.runs(t + "-rolled-back") == []


def test_session_savepoint_rollback_drops_only_its_rows(
    pg_redis: Stack, caller_engine: Callable[[], AsyncEngine]
) -> None:
    t, idle = tag(), f"idle-{tag()}"
    record = pg_redis.questpie.queue.record

    async def body() -> tuple[str | None, str | None, int]:
        engine = caller_engine()
        try:
            async with AsyncSession(engine) as session, session.begin():
                kept = await record.apublish(
                    {"tag": t}, session=session, queue=idle, idempotency_key=f"k:{t}"
                )
                nested = await session.begin_nested()
                dropped = await record.apublish(
                    {"tag": t}, session=session, queue=idle, idempotency_key=f"d:{t}"
                )
                await nested.rollback()
                depth_before_commit = queue_depth(pg_redis, idle)
            return kept, dropped, depth_before_commit
        finally:
            await engine.dispose()

    kept, dropped, depth = run(pg_redis.questpie, body)
    assert depth == 0  # nothing is sent before the outermost commit
    message = capture(pg_redis, idle, timeout=5)  # the send threads sent it at commit
    assert message.headers["id"] == kept
    assert queue_depth(pg_redis, idle) == 0  # and only it
    assert pg_redis.ledger.get(dropped or "") is None


def test_flush_waits_for_the_sends_of_a_committed_session(
    pg_redis: Stack, caller_engine: Callable[[], AsyncEngine]
) -> None:
    t, idle = tag(), f"idle-{tag()}"
    questpie = pg_redis.questpie
    go = threading.Event()

    def hold(**_: Any) -> None:
        go.wait(30)  # the broker's part of the commit, held until the test lets it go

    async def body() -> tuple[str | None, bool, bool]:
        engine = caller_engine()
        try:
            async with AsyncSession(engine) as session, session.begin():
                kept = await questpie.queue.record.apublish(
                    {"tag": t}, session=session, queue=idle, idempotency_key=f"f:{t}"
                )
        finally:
            await engine.dispose()
        # The commit handed the send to a send thread, where it is held: not flushed.
        # (Before `aclose()`, which ends the send threads, waiting for them.)
        held = await asyncio.to_thread(questpie.flush, 1)
        go.set()
        return kept, held, await asyncio.to_thread(questpie.flush, 30)

    before_task_publish.connect(hold, weak=False)
    try:
        kept, held, flushed = run(questpie, body)
    finally:
        before_task_publish.disconnect(hold)
        go.set()
    assert (held, flushed) == (False, True)
    # Flushed means sent: the broker has it.
    assert queue_depth(pg_redis, idle) == 1
    assert capture(pg_redis, idle, timeout=5).headers["id"] == kept


def test_connection_publish_is_sent_by_the_relay_once_committed(
    pg_redis: Stack, caller_engine: Callable[[], AsyncEngine]
) -> None:
    t = tag()
    record = pg_redis.questpie.queue.record

    async def body() -> tuple[str | None, str | None]:
        engine = caller_engine()
        try:
            async with engine.begin() as conn:
                await conn.execute(text("SELECT 1"))  # the application's own work
                kept = await record.apublish({"tag": t}, connection=conn)
            async with engine.connect() as conn, conn.begin() as transaction:
                dropped = await record.apublish({"tag": t + "-gone"}, connection=conn)
                await transaction.rollback()
            return kept, dropped
        finally:
            await engine.dispose()

    kept, dropped = run(pg_redis.questpie, body)
    pg_redis.wait_status(kept or "", "completed")
    assert len(pg_redis.runs(t)) == 1
    assert pg_redis.ledger.get(dropped or "") is None


def test_apublish_many_in_a_session(
    pg_redis: Stack, caller_engine: Callable[[], AsyncEngine]
) -> None:
    t = tag()
    record = pg_redis.questpie.queue.record

    async def body() -> list[str | None]:
        engine = caller_engine()
        try:
            async with AsyncSession(engine) as session, session.begin():
                return await record.apublish_many(
                    [{"tag": t}] * 3,
                    session=session,
                    idempotency_keys=[f"{t}:{i}" for i in range(3)],
                )
        finally:
            await engine.dispose()

    ids = run(pg_redis.questpie, body)
    for dispatch_id in ids:
        pg_redis.wait_status(dispatch_id or "", "completed")
    assert len(pg_redis.runs(t)) == 3


# --- receipts and status ---------------------------------------------------------------


def test_aget_receipt_and_aget_status(pg_redis: Stack) -> None:
    t = tag()
    queue = pg_redis.questpie.queue

    async def publish() -> str | None:
        return await queue.secret_link.apublish(
            {"tag": t, "link": "https://example.com/magic/CANARY"},
            secret_payload=True,
            idempotency_key=f"secret:{t}",
        )

    dispatch_id = run(pg_redis.questpie, publish)
    assert dispatch_id is not None
    pg_redis.wait_status(dispatch_id, "completed")

    async def look() -> tuple[Any, Any, Any]:
        return (
            await queue.aget_receipt(dispatch_id),
            await queue.aget_status(dispatch_id),
            await queue.aget_receipt("no-such-dispatch"),
        )

    receipt, status, missing = run(pg_redis.questpie, look)
    assert receipt == queue.get_receipt(dispatch_id)
    assert receipt is not None and receipt.status == "completed"
    assert status == queue.get_status(dispatch_id)
    assert status is not None and status.secret and status.status == "completed"
    assert missing is None


# --- the embedded ledger (SQLite): the ledger work runs in threads ----------------------


def test_apublish_on_the_sqlite_ledger(sqlite_fs: Stack) -> None:
    t = tag()
    record = sqlite_fs.questpie.queue.record

    async def body() -> list[str | None]:
        return [
            *await asyncio.gather(
                *(record.apublish({"tag": t}, idempotency_key=f"q:{t}") for _ in range(5))
            ),
            *await record.apublish_many([{"tag": t}] * 2, idempotency_keys=[f"q:{t}", None]),
        ]

    ids = run(sqlite_fs.questpie, body)
    keyed = derive_dispatch_id("record", f"q:{t}")
    assert ids[:6] == [keyed] * 6
    unkeyed = ids[6]
    assert unkeyed is not None and unkeyed != keyed
    # The keyed one once, the unkeyed item once. The keyed row ended for good (a
    # completed row can be claimed no more); the unkeyed item has no row, so a second
    # run of it would take a second message, and the worker, having taken every
    # message sent until now, received only one.
    assert sqlite_fs.wait_status(keyed, "completed").attempt == 1
    sqlite_fs.wait_runs(t, 2)
    sqlite_fs.wait_taken()
    received = [line for line in sqlite_fs.worker.log_about(unkeyed) if "] received" in line]
    assert len(received) == 1, received
    assert sorted(run["dispatch_id"] for run in sqlite_fs.runs(t)) == sorted([keyed, unkeyed])


# --- faults: a down broker or ledger, bad input amid good ------------------------------


def test_a_down_broker_leaves_rows_for_the_relay_and_never_holds_the_loop(
    pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Twenty gathered publishes meet a broker nothing listens on. Each send stops in its
    send thread, before it tries the broker, until another task on the loop has ticked
    three more times: a loop that waited on the send could not tick, and the send would
    give up waiting. Then the broker refuses; the publishes return their ids, and the
    rows wait in the ledger for the relay. (How long the loop's other tasks wait while
    this goes on is a figure of bench/asyncio_lag.py, not a test.)"""
    t = tag()
    _, questpie = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_db)
    questpie.migrate()
    record = questpie.queue.record
    keys = [f"down:{t}:{i}" for i in range(20)]
    ticks = [0]  # the ticker's, counted on the loop
    ticked_while_held: list[bool] = []  # per send: the loop ticked while it was held

    def hold(sender: object = None, body: Any = None, **_: Any) -> None:
        if sender != "record" or body[0][0].get("tag") != t:
            return
        held_at = ticks[0]
        try:
            wait_until(lambda: ticks[0] >= held_at + 3, "the loop's ticks", 30, 0.001)
        except AssertionError:
            ticked_while_held.append(False)
        else:
            ticked_while_held.append(True)

    async def work() -> list[str | None]:
        publishing = True

        async def tick() -> None:
            while publishing:
                await asyncio.sleep(0.001)
                ticks[0] += 1

        ticker = asyncio.create_task(tick())
        try:
            return await asyncio.gather(
                *(record.apublish({"tag": t}, idempotency_key=key) for key in keys)
            )
        finally:
            publishing = False
            await ticker

    before_task_publish.connect(hold, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="questpie_celery"):
            ids = run(questpie, work)
    finally:
        before_task_publish.disconnect(hold)
        questpie.close()
    # The publishes returned, each with its key's id.
    assert ids == [derive_dispatch_id("record", key) for key in keys]
    # Their sends were made (one per batch: the broker refused the first of each), and
    # the loop went on with other work while each was under way.
    assert ticked_while_held and all(ticked_while_held), ticked_while_held
    refused = [r.getMessage() for r in caplog.records if "the broker refused it" in r.getMessage()]
    assert len(refused) == len(ticked_while_held), refused
    ledger = open_ledger(pg_db)
    try:
        for dispatch_id in ids:
            row = ledger.get(dispatch_id or "")
            assert row is not None and row.status == "pending"  # the relay sends it
    finally:
        ledger.close()


def test_an_unreachable_ledger_fails_every_gathered_call_and_sends_nothing(
    redis_server: RedisServer,
) -> None:
    broker, idle = redis_server.url(redis_server.new_db()), f"idle-{tag()}"
    _, questpie = jobapp.build(broker=broker, ledger=closed_ledger_url(), queue=idle)
    record = questpie.queue.record
    try:

        async def work() -> list[Any]:
            return await asyncio.gather(
                *(record.apublish({"tag": "x"}, idempotency_key=f"k{i}") for i in range(5)),
                return_exceptions=True,
            )

        results = run(questpie, work)
        assert all(isinstance(r, LedgerUnavailableError) for r in results), results
        assert depth(broker, idle) == 0
    finally:
        questpie.close()


def test_bad_calls_among_good_ones_fail_alone(pg_redis: Stack) -> None:
    t = tag()
    record = pg_redis.questpie.queue.record

    async def work() -> list[Any]:
        return await asyncio.gather(
            record.apublish({"tag": t}, idempotency_key=f"good:{t}:0"),
            record.apublish({"no": "tag"}, idempotency_key=f"bad:{t}"),
            record.apublish({"tag": t}, idempotency_key=""),
            record.apublish({"tag": t}, idempotency_key=f"good:{t}:1"),
            return_exceptions=True,
        )

    results = run(pg_redis.questpie, work)
    assert isinstance(results[1], PayloadValidationError)
    assert isinstance(results[2], PublishOptionsError)
    assert results[0] == derive_dispatch_id("record", f"good:{t}:0")
    assert results[3] == derive_dispatch_id("record", f"good:{t}:1")
    assert pg_redis.ledger.get(derive_dispatch_id("record", f"bad:{t}")) is None
    pg_redis.wait_runs(t, 2)


# --- what a hostile review found --------------------------------------------------------


def admin(pg_db: str, sql: str) -> Any:
    """Run `sql` on the server of `pg_db`, connected to its `postgres` database."""
    engine = create_engine(pg_db.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            result = conn.execute(text(sql))
            return result.scalar() if result.returns_rows else None
    finally:
        engine.dispose()


def test_callers_failed_together_get_exceptions_of_their_own_holding_no_other_secret(
    pg_db: str,
) -> None:
    """One failed statement fails every call of its group: each must get its own
    exception object, whose traceback (locals included) holds no other caller's payload."""
    _, questpie = jobapp.build(broker="memory://", ledger=pg_db, secret=SECRET)
    questpie.migrate()
    link = questpie.queue.secret_link
    database = pg_db.rsplit("/", 1)[1]
    saved: dict[str, BaseException] = {}

    async def caller(name: str, canary: str) -> None:
        try:
            await link.apublish(
                {"tag": name, "link": canary}, idempotency_key=f"k-{name}", secret_payload=True
            )
        except Exception as exc:
            saved[name] = exc

    async def body() -> None:
        await link.apublish(
            {"tag": "warm", "link": "warm"}, idempotency_key="warm", secret_payload=True
        )
        admin(pg_db, f"ALTER DATABASE {database} SET default_transaction_read_only = on")
        admin(
            pg_db,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND pid <> pg_backend_pid()",
        )
        await asyncio.gather(caller("A", "CANARY-AAAA"), caller("B", "CANARY-BBBB"))

    try:
        run(questpie, body)
    finally:
        admin(pg_db, f"ALTER DATABASE {database} SET default_transaction_read_only = off")
        questpie.close()
    assert set(saved) == {"A", "B"}
    assert saved["A"] is not saved["B"]
    for name, other in (("A", "CANARY-BBBB"), ("B", "CANARY-AAAA")):
        told = "".join(
            traceback.TracebackException.from_exception(saved[name], capture_locals=True).format()
        )
        assert other not in told, f"caller {name}'s exception shows the other's secret"


def test_loops_closed_without_aclose_leave_no_connections(pg_db: str) -> None:
    _, questpie = jobapp.build(broker="memory://", ledger=pg_db, queue=f"idle-{tag()}")
    questpie.migrate()
    database = pg_db.rsplit("/", 1)[1]
    record = questpie.queue.record

    async def one(i: int) -> None:
        await record.apublish({"tag": "loop"}, idempotency_key=f"loop-{i}")

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # psycopg: collected while open
            for i in range(15):
                asyncio.run(one(i))  # no aclose(): what a careless script does
            gc.collect()
        count = f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'"
        # A backend leaves pg_stat_activity a moment after its client closed it: allow that
        # moment, not a connection that stays open.
        wait_until(lambda: admin(pg_db, count) <= 3, "the loops' connections to close", 5)
    finally:
        questpie.close()


def test_gathered_calls_with_different_options_are_decided_in_arrival_order(
    pg_db: str,
) -> None:
    _, questpie = jobapp.build(broker="memory://", ledger=pg_db, queue=f"idle-{tag()}")
    questpie.migrate()
    exclusive = questpie.queue.policy_exclusive

    async def trial(i: int) -> list[str | None]:
        return await asyncio.gather(
            exclusive.apublish({"tag": "a"}, singleton_key=f"a{i}", priority=1),
            exclusive.apublish({"tag": "b"}, singleton_key=f"s{i}", priority=2),
            exclusive.apublish({"tag": "c"}, singleton_key=f"s{i}", priority=1),
        )

    async def body() -> list[list[str | None]]:
        return [await trial(i) for i in range(8)]

    try:
        for a, b, c in run(questpie, body):
            # As three publish() calls in this order: b takes slot s, c finds it taken.
            assert a is not None and b is not None and c is None
    finally:
        questpie.close()


def test_eager_apublish_in_a_session_runs_after_commit_and_not_after_rollback(
    pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QP_TEST_RUNS", pg_db)  # where the record job writes its runs
    monkeypatch.setattr(jobapp, "_engines", {})
    jobapp.runs_table.create(jobapp.runs_engine(), checkfirst=True)
    celery_app, questpie = jobapp.build(broker="memory://", ledger=pg_db)
    celery_app.conf.task_always_eager = True
    questpie.migrate()
    record = questpie.queue.record
    kept, dropped = tag(), tag()

    async def body() -> None:
        engine = create_async_engine(pg_db)
        try:
            async with AsyncSession(engine) as session, session.begin():
                await record.apublish({"tag": kept}, idempotency_key=kept, session=session)
                assert ran(kept) == 0  # not before the commit
                assert questpie.queue.get_status(derive_dispatch_id("record", kept)) is None
            async with AsyncSession(engine) as session, session.begin():
                await record.apublish({"tag": dropped}, idempotency_key=dropped, session=session)
                await session.rollback()
        finally:
            await engine.dispose()

    def ran(t: str) -> int:
        with jobapp.runs_engine().connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(jobapp.runs_table)
                    .where(jobapp.runs_table.c.tag == t, jobapp.runs_table.c.phase == "start")
                ).scalar_one()
            )

    try:
        run(questpie, body)
        # The after-commit send (which runs the job, eagerly) is on a send thread.
        wait_until(lambda: ran(kept), f"the committed {kept} to run", 10, 0.05)
        assert questpie.flush(timeout=10)  # every send handed over has been made
        assert ran(kept) == 1
        assert ran(dropped) == 0
        assert questpie.queue.get_status(derive_dispatch_id("record", dropped)) is None
    finally:
        questpie.close()


def test_rebinding_closes_the_async_connections_of_an_idle_loop(pg_db: str, tmp_path: Path) -> None:
    """The testing plugin rebinds a Questpie to a throwaway ledger per test; an asyncio
    engine left on a loop that outlives the test must be closed, not dropped open."""
    _, questpie = jobapp.build(broker="memory://", ledger=pg_db, queue=f"idle-{tag()}")
    questpie.migrate()
    database = pg_db.rsplit("/", 1)[1]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(
            questpie.queue.record.apublish({"tag": "r"}, idempotency_key="rebind")
        )
        previous = questpie.rebind_ledger(ledger_url=f"sqlite:///{tmp_path / 'other.db'}")
        previous.dispose()
        opened = admin(pg_db, f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'")
        assert opened == 0
    finally:
        loop.close()
        questpie.close()
