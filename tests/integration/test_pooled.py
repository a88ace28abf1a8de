"""The ledger behind a real PgBouncer in transaction mode with its stock settings (no
`ignore_startup_parameters`, no prepared statements), as fleets of prefork workers share
one PostgreSQL: `pooled=True`.

Without it the pooler's refusals name the setting. With it, the ledger-level tests run
two clients through the pooler in turn, so that their statements share server
connections as a busy fleet's do, and look at what each statement set on the server;
the stack tests (`pooled_stack`) run a real worker, its relay and publishers through it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, create_engine, select, text, update
from sqlalchemy.orm import Session

from questpie_celery import LedgerBusyError, LedgerUnavailableError, Questpie
from questpie_celery.cli.commands import main
from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.options import RunOptions, StoredOptions
from questpie_celery.ledger import (
    SCHEMA_VERSION,
    Ledger,
    NewDispatch,
    dispatch_table,
    open_ledger,
)
from questpie_celery.ledger.aio import AsyncLedger
from questpie_celery.ledger.schema import schedule_table
from tests.integration.conftest import POOLED_SECRET, StackFactory
from tests.support import jobapp
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.faults import held_dispatch
from tests.support.services import PgBouncerServer, PostgresServer, free_port
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

JOB = "record"
#: What every entry point's error says to do.
HINT = "pass pooled=True (--pooled, QUESTPIE_POOLED)"


def _new(dispatch_id: str | None = None, **fields: Any) -> NewDispatch:
    values: dict[str, Any] = {
        "id": dispatch_id or random_dispatch_id(),
        "job_name": JOB,
        "payload": {"tag": "x"},
        "options": StoredOptions(run=RunOptions(retry_limit=2)),
    }
    values.update(fields)
    return NewDispatch(**values)


@pytest.fixture
def database(postgres: PostgresServer, pgbouncer: PgBouncerServer) -> tuple[str, str]:
    """A fresh database: its URL directly, and through the pooler."""
    direct = postgres.create_database("pooled")
    return direct, pgbouncer.url(direct)


@pytest.fixture
def caller_engine(database: tuple[str, str]) -> Iterator[Engine]:
    """An application's own engine through the pooler, made pooler-safe as it must be."""
    engine = create_engine(database[1], connect_args={"prepare_threshold": None})
    yield engine
    engine.dispose()


def run_apart(calls: dict[str, Callable[[], object]]) -> dict[str, BaseException | object]:
    """Run each call in a thread of its own at once; what each returned or raised. The
    threads must end within a minute: none may hang."""
    outcomes: dict[str, BaseException | object] = {}

    def run(name: str, call: Callable[[], object]) -> None:
        try:
            outcomes[name] = call()
        except BaseException as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: not any(thread.is_alive() for thread in threads),
        "every call to return (a write hung on the caller)",
        60,
        0.05,
    )
    return outcomes


def in_loop(make: Callable[[], Coroutine[Any, Any, object]]) -> Callable[[], object]:
    return lambda: asyncio.run(make())


# --- the ledger through the pooler ---------------------------------------------------------


def test_without_pooled_the_poolers_refusals_name_the_setting(database: tuple[str, str]) -> None:
    _, through = database
    unpooled = open_ledger(through)
    try:
        with pytest.raises(LedgerUnavailableError, match=re.escape(HINT)) as refused:
            unpooled.migration.migrate()
        assert "startup parameter 'options'" in str(refused.value)
    finally:
        unpooled.close()
    pooled = open_ledger(through, pooled=True)
    assert pooled.migration.migrate() > 0
    new = _new()
    assert pooled.dispatches.insert(new)
    # Engines of an application's own, made without prepare_threshold=None: psycopg
    # prepares a statement after its fifth run, and two clients' prepared statements
    # meet on the server connection the pooler hands both.
    engines = [create_engine(through) for _ in range(2)]
    try:
        theirs = [Ledger(engine) for engine in engines]
        with pytest.raises(LedgerUnavailableError, match=re.escape(HINT)) as mixed:
            for _ in range(20):
                for ledger in theirs:
                    assert ledger.get(new.id) is not None
        assert "prepared statement" in str(mixed.value)
    finally:
        for engine in engines:
            engine.dispose()
        pooled.close()


def test_pooled_clients_in_turn_share_the_poolers_connections(database: tuple[str, str]) -> None:
    """Every statement of the hot path, many times over, from two clients in turn, then
    from two event loops' asyncio engines in turn: no statement is prepared."""
    _, through = database
    clients = [open_ledger(through, pooled=True) for _ in range(2)]
    loops = [asyncio.new_event_loop() for _ in clients]
    aledgers = [AsyncLedger(ledger) for ledger in clients]
    try:
        clients[0].migration.migrate()
        for _ in range(8):
            for ledger in clients:
                new = _new(idempotency_key=uuid.uuid4().hex)
                assert ledger.dispatches.insert(new)
                assert not ledger.dispatches.insert(new)
                batch = [_new(), _new()]
                assert ledger.dispatches.insert_many(batch) == {b.id for b in batch}
                ledger.dispatches.mark_queued([new.id], 3600)
                claim = ledger.claims.claim(new.id, JOB, 1, 60)
                assert claim.outcome == "claimed" and claim.token is not None
                assert ledger.claims.renew(new.id, claim.token, 60)
                assert ledger.claims.finish(new.id, claim.token, "completed", None)
                taken = ledger.relay.take_due(
                    100, max_sends=50, first_backoff=1, max_backoff=5, accepted_backoff=5
                )
                assert {b.id for b in batch} <= {row.id for row in taken}
                ledger.relay.give_back(taken, 0)  # an executemany
                assert ledger.policies.get("nothing") is None
        for _ in range(8):
            for aledger, loop in zip(aledgers, loops, strict=True):
                new = _new()
                assert loop.run_until_complete(aledger.insert(new))
                assert loop.run_until_complete(aledger.insert_many([_new(), _new()]))
                assert loop.run_until_complete(aledger.get(new.id)) is not None
    finally:
        for aledger, loop in zip(aledgers, loops, strict=True):
            loop.run_until_complete(aledger.close())
            loop.close()
        for ledger in clients:
            ledger.close()


def test_a_pooled_ledger_sets_its_settings_in_each_statement_and_leaves_none_behind(
    database: tuple[str, str], caller_engine: Engine
) -> None:
    """A trigger deferred to each commit notes the settings the commit ran with: the
    lock timeout and a relaxed ledger's `synchronous_commit=off` for the ledger's own
    writes, `on` for a secret's (durable even on a relaxed ledger), and none of them in
    a caller's transaction. Afterwards the pooler's server connections have their
    defaults back."""
    direct, through = database
    admin = create_engine(direct, isolation_level="AUTOCOMMIT")
    name = direct.rsplit("/", 1)[1]
    ledger = open_ledger(through, relaxed=True, pooled=True)
    try:
        with admin.connect() as conn:
            # The test server runs with synchronous_commit off: this database does not.
            conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = on'))
        ledger.migration.migrate()
        with admin.begin() as conn:
            conn.execute(text("CREATE TABLE seen (op text, id text, sync text, lock text)"))
            conn.execute(
                text(
                    "CREATE FUNCTION note_settings() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN INSERT INTO seen VALUES (TG_OP, NEW.id, "
                    "current_setting('synchronous_commit'), current_setting('lock_timeout')); "
                    "RETURN NULL; END $$"
                )
            )
            conn.execute(
                text(
                    "CREATE CONSTRAINT TRIGGER note_settings AFTER INSERT OR UPDATE ON "
                    f"{dispatch_table.name} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW "
                    "EXECUTE FUNCTION note_settings()"
                )
            )
        plain, batched, theirs = _new(), _new(), _new()
        assert ledger.dispatches.insert(plain)
        secret = _new(
            payload=None, secret_ciphertext=b"c", secret_wrapped_key=b"w", secret_key_id="k"
        )
        assert ledger.dispatches.insert(secret)
        assert ledger.dispatches.insert_many([batched]) == {batched.id}
        claim = ledger.claims.claim(plain.id, JOB, 1, 60)
        assert claim.outcome == "claimed"
        with caller_engine.begin() as conn:
            assert ledger.dispatches.insert(theirs, conn=conn)
        with admin.connect() as conn:
            seen = {(op, i): (s, lock) for op, i, s, lock in conn.execute(text("TABLE seen"))}
        assert seen == {
            ("INSERT", plain.id): ("off", "5s"),
            ("INSERT", secret.id): ("on", "5s"),
            ("INSERT", batched.id): ("off", "5s"),
            ("UPDATE", plain.id): ("off", "5s"),
            ("INSERT", theirs.id): ("on", "0"),
        }
        for _ in range(3):
            with caller_engine.connect() as conn:
                shown = conn.execute(text("SELECT current_setting('lock_timeout')")).scalar()
                commits = conn.execute(text("SHOW synchronous_commit")).scalar()
            assert (shown, commits) == ("0", "on")
    finally:
        ledger.close()
        admin.dispose()


def test_a_pooled_ledgers_writes_wait_at_most_the_lock_timeout(
    database: tuple[str, str], caller_engine: Engine
) -> None:
    """A caller's open transaction holds an uncommitted row under a key's id and a lock
    on another row: the pooled ledger's insert, batch insert, asyncio insert and claim
    meeting them fail with LedgerBusyError after the lock timeout instead of waiting."""
    _, through = database
    ledger = open_ledger(through, pooled=True)
    try:
        ledger.migration.migrate()
        locked = _new()
        assert ledger.dispatches.insert(locked)
        held = _new(idempotency_key="held")

        async def ainsert() -> object:
            aledger = AsyncLedger(ledger)
            try:
                return await aledger.insert(_new(held.id))
            finally:
                await aledger.close()

        with caller_engine.begin() as conn:
            assert ledger.dispatches.insert(held, conn=conn)
            conn.execute(
                select(dispatch_table.c.id)
                .where(dispatch_table.c.id == locked.id)
                .with_for_update()
            )
            outcomes = run_apart(
                {
                    "insert": lambda: ledger.dispatches.insert(_new(held.id)),
                    "insert_many": lambda: ledger.dispatches.insert_many([_new(), _new(held.id)]),
                    "asyncio insert": in_loop(ainsert),
                    "claim": lambda: ledger.claims.claim(locked.id, JOB, 1, 60),
                }
            )
        for name, outcome in outcomes.items():
            assert isinstance(outcome, LedgerBusyError), (name, outcome)
            assert "lock_timeout" in str(outcome)
        # Once the caller's transaction has ended, the same writes go through.
        assert ledger.claims.claim(locked.id, JOB, 1, 60).outcome == "claimed"
        assert ledger.dispatches.insert(_new(held.id)) is False  # the caller's row, committed
    finally:
        ledger.close()


def test_a_pooled_migrate_waits_at_most_the_lock_timeout_for_the_table(
    database: tuple[str, str], caller_engine: Engine
) -> None:
    """Upgrading the schema takes the dispatch table's exclusive lock (version 5 widens
    the dispatch ids). Behind a caller's open transaction on the table, a pooled migrate
    fails with LedgerBusyError after the lock timeout, as an unpooled one does, instead of
    waiting as long as that transaction lasts with every ledger statement of the fleet
    queued behind its lock; once the transaction ended, it upgrades the table."""
    direct, through = database
    ledger = open_ledger(through, pooled=True)
    admin = create_engine(direct, isolation_level="AUTOCOMMIT")
    column = text(
        "SELECT data_type FROM information_schema.columns "
        "WHERE table_name = :table AND column_name = 'id'"
    )
    try:
        ledger.migration.migrate()
        with admin.connect() as conn:  # the dispatch table as schema version 4 made it
            conn.execute(
                text(f"ALTER TABLE {dispatch_table.name} ALTER COLUMN id TYPE varchar(36)")
            )
        with caller_engine.begin() as conn:
            assert ledger.dispatches.insert(_new(), conn=conn)
            outcome = run_apart({"migrate": ledger.migration.migrate})["migrate"]
        assert isinstance(outcome, LedgerBusyError), outcome
        assert "lock_timeout" in str(outcome)
        assert ledger.migration.migrate() == SCHEMA_VERSION
        with admin.connect() as conn:
            assert conn.execute(column, {"table": dispatch_table.name}).scalar() == "text"
    finally:
        ledger.close()
        admin.dispose()


def test_the_command_line_takes_pooled(database: tuple[str, str]) -> None:
    _, through = database
    runner = CliRunner()
    refused = runner.invoke(main, ["migrate", "--ledger-url", through])
    assert refused.exit_code != 0
    assert HINT in refused.output
    migrated = runner.invoke(main, ["migrate", "--ledger-url", through, "--pooled"])
    assert migrated.exit_code == 0, migrated.output
    counts = runner.invoke(
        main, ["dispatches", "counts", "--ledger-url", through], env={"QUESTPIE_POOLED": "1"}
    )
    assert counts.exit_code == 0, counts.output
    assert "(the ledger is empty)" in counts.output
    shown = runner.invoke(main, ["policy", "show", "x", "--ledger-url", through, "--pooled"])
    assert shown.exit_code == 0, shown.output


# --- a worker, its relay and publishers through the pooler ----------------------------------


def other_questpie(stack: Stack, broker: str | None = None) -> Questpie:
    """Another process's `Questpie` on the stack's pooled ledger."""
    _, questpie = jobapp.build(
        broker=broker or stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
        secret=POOLED_SECRET,
        pooled=True,
    )
    return questpie


def test_keyed_publishes_run_once_and_duplicate_deliveries_are_fenced(
    pooled_stack: Stack,
) -> None:
    stack, t = pooled_stack, tag()
    queue = stack.questpie.queue
    # Enough runs of every statement, in every process, for psycopg to have prepared them.
    keys = [f"{t}-{n}" for n in range(12)]
    ids = [queue.record.publish({"tag": t}, idempotency_key=key) for key in keys[:6]]
    ids += queue.record.publish_many([{"tag": t}] * 6, idempotency_keys=keys[6:])
    assert [queue.record.publish({"tag": t}, idempotency_key=key) for key in keys] == ids
    for dispatch_id in ids:
        assert dispatch_id is not None
        stack.wait_status(dispatch_id, "completed")
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted(ids)

    gate, idle = stack.gate(), idle_queue()
    dispatch_id = queue.record.publish(
        {"tag": t + "-dup", "gate": str(gate)}, idempotency_key=f"{t}-dup", queue=idle
    )
    assert dispatch_id is not None
    message = capture(stack, idle)
    deliver(stack, message, copies=2)  # the second meets the first's live claim
    stack.wait_status(dispatch_id, "active")
    gate.open()
    stack.wait_status(dispatch_id, "completed")
    deliver(stack, message)
    stack.wait_log(dispatch_id, "skipped (done)")
    assert len(stack.runs(t + "-dup")) == 1


def test_retries_count_attempts_and_complete(pooled_stack: Stack) -> None:
    stack, t = pooled_stack, tag()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "fail_times": 2}, idempotency_key=f"retry:{t}", retry_limit=3
    )
    assert dispatch_id is not None
    assert stack.wait_status(dispatch_id, "completed").attempt == 3
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2, 3]


def test_a_busy_slot_parks_the_next_run_and_hands_it_on(pooled_stack: Stack) -> None:
    stack, t = pooled_stack, tag()
    client = stack.questpie.queue.policy_stately
    key, gate = f"slot-{t}", stack.gate()
    first = client.publish({"tag": t, "gate": str(gate)}, singleton_key=key)
    assert first is not None
    stack.wait_status(first, "active")
    second = client.publish({"tag": t}, singleton_key=key)
    assert second is not None
    assert stack.wait_status(second, "parked").attempt == 0
    assert client.publish({"tag": t}, singleton_key=key) is None  # one waits already
    gate.open()
    stack.wait_status(first, "completed")
    assert stack.wait_status(second, "completed").attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [first, second]


def test_the_relay_polls_and_sends_a_pending_row(pooled_stack: Stack) -> None:
    """A publisher whose broker is down leaves a pending row; the worker's relay, which
    polls instead of listening, sends it."""
    stack, t = pooled_stack, tag()
    offline = other_questpie(stack, broker=f"redis://127.0.0.1:{free_port()}/0")
    try:
        dispatch_id = offline.queue.record.publish({"tag": t}, idempotency_key=t)
    finally:
        offline.close()
    assert dispatch_id is not None
    assert stack.row(dispatch_id).status == "pending"
    with stack.ledger.engine.begin() as conn:  # due now, not after the publisher's grace
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(next_send_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    row = stack.wait_status(dispatch_id, "completed")
    assert (row.attempt, len(stack.runs(t))) == (1, 1)
    assert stack.ledger.relay.send_wakeups() is None
    direct = create_engine(stack.env["QP_TEST_RUNS"])
    try:
        with direct.connect() as conn:
            listening = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query ILIKE 'LISTEN%'"
                )
            ).scalar()
    finally:
        direct.dispose()
    assert listening == 0


def test_a_schedule_fires_once_from_two_beats(pooled_stack: Stack) -> None:
    stack, t = pooled_stack, tag()
    other = other_questpie(stack)
    try:
        stack.questpie.queue.record.schedule({"tag": t}, "* * * * *")
        with stack.ledger.engine.begin() as conn:  # its tick has come
            conn.execute(
                update(schedule_table)
                .where(schedule_table.c.job_name == JOB)
                .values(next_fire_at=datetime.now(UTC) - timedelta(seconds=1))
            )
        beats = [stack.questpie, other]
        barrier = threading.Barrier(len(beats))

        def fire(questpie: Questpie) -> Callable[[], object]:
            def at_once() -> object:
                barrier.wait()
                return questpie.schedules.fire_due()

            return at_once

        fired = run_apart({f"beat {n}": fire(q) for n, q in enumerate(beats)})
        assert not any(isinstance(outcome, BaseException) for outcome in fired.values()), fired
        [info] = stack.questpie.schedules.list()
        assert info.last_dispatch_id is not None
        stack.wait_status(info.last_dispatch_id, "completed")
        assert [r["dispatch_id"] for r in stack.runs(t)] == [info.last_dispatch_id]
        ticks = [q.schedules.claim_beat_tick("pooled-entry", t) for q in beats]
        assert sorted(ticks) == [False, True]
    finally:
        stack.questpie.queue.record.unschedule()
        other.close()


def test_a_secret_dispatch_runs_and_its_key_is_erased(pooled_stack: Stack) -> None:
    stack, t = pooled_stack, tag()
    link = f"https://example.test/magic/{uuid.uuid4().hex}"
    dispatch_id = stack.questpie.queue.secret_link.publish(
        {"tag": t, "link": link}, idempotency_key=t, secret_payload=True
    )
    assert dispatch_id is not None
    row = stack.wait_status(dispatch_id, "completed")
    assert (row.payload, row.secret_ciphertext, row.secret_wrapped_key) == (None, None, None)
    [run] = stack.runs(t)
    assert run["note"] == hashlib.sha256(link.encode()).hexdigest()


def test_a_cancel_through_the_pooler_holds_against_its_own_and_replayed_messages(
    pooled_stack: Stack,
) -> None:
    """Through PgBouncer in transaction mode: a cancelled dispatch's own message and two
    byte-identical copies of it reach the worker; each is acknowledged and nothing runs.
    A gated run cancelled while it runs goes on, is not retried, and ends cancelled."""
    stack, t = pooled_stack, tag()
    dispatch_id, message = held_dispatch(stack, t, retry_limit=0)
    assert stack.questpie.queue.cancel(dispatch_id) is True
    deliver(stack, message, copies=3)
    stack.wait_log(dispatch_id, "skipped (done)")
    assert stack.questpie.queue.record.cancel(idempotency_key=t) is False
    gate = stack.gate()
    running = stack.questpie.queue.record.publish(
        {"tag": t + "-run", "gate": str(gate), "fail_times": 1}, idempotency_key=t + "-run"
    )
    assert running is not None
    stack.wait_status(running, "active")
    assert stack.questpie.queue.cancel(running) is True
    gate.open()
    ended = stack.wait_status(running, "cancelled")
    assert ended.attempt == 1 and ended.cancel_requested_at is not None
    assert stack.runs(t) == [] and len(stack.runs(t + "-run")) == 1
    assert stack.row(dispatch_id).status == "cancelled"


def test_a_callers_open_transaction_makes_rival_publishes_fail_not_hang(
    pooled_stack: Stack,
) -> None:
    """The slot row of an uncommitted `publish(session=...)` through the pooler: a rival
    publish, batch publish and apublish fail with LedgerBusyError after the lock
    timeout; the caller's dispatch runs once it commits."""
    stack, t = pooled_stack, tag()
    key = f"open-tx-{t}"
    client = stack.questpie.queue.policy_exclusive
    other = other_questpie(stack)
    caller = create_engine(stack.env["QP_TEST_LEDGER"], connect_args={"prepare_threshold": None})

    async def apublish() -> object:
        try:
            return await other.queue.policy_exclusive.apublish(
                {"tag": t + "-rival"}, singleton_key=key
            )
        finally:
            await other.aclose()

    try:
        with Session(caller) as session, session.begin():
            held = client.publish({"tag": t}, singleton_key=key, session=session)
            assert held is not None
            outcomes = run_apart(
                {
                    "publish": lambda: client.publish({"tag": t + "-rival"}, singleton_key=key),
                    "publish_many": lambda: client.publish_many(
                        [{"tag": t + "-rival"}], singleton_keys=[key]
                    ),
                    "apublish": in_loop(apublish),
                }
            )
    finally:
        caller.dispose()
    for name, outcome in outcomes.items():
        assert isinstance(outcome, LedgerBusyError), (name, outcome)
        assert "lock_timeout" in str(outcome)
    assert stack.wait_status(held, "completed").attempt == 1
    assert len(stack.runs(t)) == 1
    assert stack.runs(t + "-rival") == []


def test_a_lease_that_lapsed_while_the_pooler_stalled_is_not_ended_at_once(
    make_stack: StackFactory, pgbouncer: PgBouncerServer
) -> None:
    """A paused pooler stalls every statement instead of failing it: the relay's read of
    lapsed leases waits behind the pause, and so do the holders' renewals. A lease that
    ran out meanwhile belongs to a worker that could not renew: the pass must not end it
    the moment the pooler resumes, before the holder can renew."""
    stack = make_stack("redis", ledger="pooled", start_worker=False)
    dispatch_id = stack.questpie.queue.record.publish({"tag": tag()}, idempotency_key=tag())
    assert dispatch_id is not None
    token = str(uuid.uuid4())
    now = datetime.now(UTC)
    with create_engine(stack.env["QP_TEST_RUNS"]).begin() as conn:  # the database itself
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(
                status="active",
                attempt=1,
                claim_token=token,
                started_at=now,
                lease_expires_at=now + timedelta(seconds=1),  # runs out during the pause
            )
        )
    database_name = stack.env["QP_TEST_RUNS"].rsplit("/", 1)[1]
    pgbouncer.console(f"PAUSE {database_name}")
    try:
        passing = threading.Thread(
            target=lambda: stack.questpie.run_relay(once=True, end_lapsed_leases=True)
        )
        passing.start()
        time.sleep(3)  # the stall itself: this is the scenario, not a wait for an event
    finally:
        pgbouncer.console(f"RESUME {database_name}")
    passing.join(30)
    row = stack.row(dispatch_id)
    assert (row.status, row.claim_token) == ("active", token)
    # Once the ledger answers promptly again, a lease still lapsed is ended.
    assert stack.questpie.run_relay(once=True, end_lapsed_leases=True) >= 1
    assert stack.row(dispatch_id).status == "retry"
