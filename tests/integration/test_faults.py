"""Killed connections and servers that are down: clear errors, nothing lost, nothing run twice.

Killing a database's backends (`PostgresServer.terminate_backends`) is what a
failover, a server restart or an idle timeout does to every pooled connection. The
stacks here keep their `test_runs` table in a database of its own, so the kill hits
only the ledger and a handler's own bookkeeping survives it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy
from celery.signals import before_task_publish
from click.testing import CliRunner
from kombu import Connection, Exchange, Queue
from sqlalchemy import text as sql_text

from questpie_celery import (
    BrokerError,
    LedgerUnavailableError,
    QuestpieError,
    derive_dispatch_id,
)
from questpie_celery._runtime.outages import Outage
from questpie_celery.cli.commands import main as cli_main
from questpie_celery.ledger import DispatchRow, open_ledger
from questpie_celery.send.broker import PUBLISH_RETRY_POLICY
from questpie_celery.send.outbox import PENDING_GRACE_SECONDS, REFUSED_SEND_RETRY_SECONDS
from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.brokers import capture, deliver, idle_queue
from tests.support.faultproxy import FaultProxy
from tests.support.faults import SHORT_LEASE, own_runs_stack
from tests.support.services import PostgresServer, RedisServer, free_port
from tests.support.stack import Stack, build_stack, tag
from tests.support.waiting import wait_until

#: With SHORT_LEASE's fast relay, a lost outcome WOULD be rerun within the test's time.
LEASE_SECONDS = float(SHORT_LEASE["QP_TEST_LEASE"])


def closed_ledger_url() -> str:
    """A PostgreSQL URL on a port nothing listens on."""
    return f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"


def _kombu_queue(name: str) -> Queue:
    return Queue(name, Exchange(name), routing_key=name)


def depth(broker_url: str, queue: str) -> int:
    """How many messages wait in `queue` (declaring it, empty, if it does not exist)."""
    with Connection(broker_url) as conn:
        declared = _kombu_queue(queue)(conn.default_channel)
        declared.declare()
        _, count, _ = declared.queue_declare()
        return int(count)


def take(broker_url: str, queue: str, timeout: float = 10.0) -> tuple[dict[str, object], object]:
    """The headers and decoded body of the one message waiting in `queue`."""
    with Connection(broker_url) as conn:
        simple = conn.SimpleQueue(_kombu_queue(queue))
        message = simple.get(block=True, timeout=timeout)
        message.ack()
        simple.close()
        return dict(message.headers), message.decode()


def runs_database(postgres: PostgresServer) -> str:
    """A database for `test_runs` only, out of reach of the ledger's kills."""
    return postgres.create_database("runs")


def wait_while(stack: Stack, dispatch_id: str, status: str, timeout: float) -> DispatchRow:
    """Poll the ledger until the row leaves `status`; fail if it is still there."""

    def left() -> DispatchRow | None:
        row = stack.row(dispatch_id)
        return row if row.status != status else None

    return wait_until(left, f"dispatch {dispatch_id} to leave {status}", timeout, 0.05)


def assert_no_lost_claim(stack: Stack, dispatch_id: str) -> None:
    """The kill reached the worker's connections, and yet neither the worker nor its
    relay saw the claim lapse or the outcome get lost."""
    assert "ledger connection was dropped by the server" in stack.worker.log()
    lines = stack.worker.log_about(dispatch_id)
    for text in ("lease expired", "lost the execution claim", "after losing its claim"):
        assert not [line for line in lines if text in line], "\n".join(lines)


# --- killed connections ------------------------------------------------------------------


def test_idle_publisher_with_killed_connections_publishes_on_its_next_call(
    make_stack: StackFactory, postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    stack = make_stack("redis", env={"QP_TEST_RUNS": runs_database(postgres)})
    queue = stack.questpie.queue
    # Warm up: concurrent publishes leave several connections in the publisher's pool.
    warm = tag()
    barrier = threading.Barrier(6)

    def publish_one(n: int) -> None:
        barrier.wait()
        queue.record.publish({"tag": warm}, idempotency_key=f"warm:{warm}:{n}")

    threads = [threading.Thread(target=publish_one, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n in range(6):
        stack.wait_status(derive_dispatch_id("record", f"warm:{warm}:{n}"), "completed")

    # The publisher is idle; the server drops every connection it had.
    assert postgres.terminate_backends(stack.env["QP_TEST_LEDGER"]) >= 1

    t = tag()
    with caplog.at_level(logging.INFO, logger="questpie_celery"):
        dispatch_ids = [
            queue.record.publish({"tag": t}, idempotency_key=f"after-kill:{t}:{n}")
            for n in range(3)
        ]
    # The first statement met a dead connection (so the kill did hit the pool).
    assert any("dropped by the server" in r.getMessage() for r in caplog.records)
    for dispatch_id in dispatch_ids:
        assert dispatch_id is not None
        assert stack.wait_status(dispatch_id, "completed").attempt == 1
    assert sorted(r["dispatch_id"] for r in stack.runs(t)) == sorted(dispatch_ids)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_backends_killed_while_a_handler_runs_complete_it_once(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    stack = own_runs_stack(make_stack, postgres, broker)
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=f"kill-run:{t}"
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    # The worker's claim, lease renewal and relay connections all die under the run.
    assert postgres.terminate_backends(stack.env["QP_TEST_LEDGER"]) >= 1
    gate.open()
    # A lost completion would leave the row active until its lease lapsed, and the relay
    # would then retry it: three leases is ample time to see that happen.
    row = wait_while(stack, dispatch_id, "active", timeout=3 * LEASE_SECONDS)
    assert (row.status, row.attempt, row.last_error) == ("completed", 1, None)
    # Completed is final (the fence turns any later delivery away): run counts are too.
    assert [r["attempt"] for r in stack.runs(t)] == [1]
    assert [r["attempt"] for r in stack.runs(t, phase="end")] == [1]
    assert_no_lost_claim(stack, dispatch_id)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_backends_killed_while_a_failing_handler_runs_retry_once(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    stack = own_runs_stack(make_stack, postgres, broker)
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate), "fail_times": 1},
        idempotency_key=f"kill-retry:{t}",
        retry_limit=3,
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    assert postgres.terminate_backends(stack.env["QP_TEST_LEDGER"]) >= 1
    gate.open()
    # The retry must be recorded by the worker itself (a lost retry write would leave the
    # row active until the relay lapsed it), and its message sent at once.
    row = stack.wait_status(dispatch_id, "completed", timeout=10 * LEASE_SECONDS)
    assert row.attempt == 2
    assert [r["attempt"] for r in stack.runs(t)] == [1, 2]
    assert [r["attempt"] for r in stack.runs(t, phase="end")] == [2]
    assert_no_lost_claim(stack, dispatch_id)


def test_a_worker_running_across_the_migration_runs_what_comes_after(
    make_stack: StackFactory,
) -> None:
    """A worker (and a publisher) that ran on version 4's tables long enough for psycopg
    to prepare the ledger's statements goes on once `migrate` changed the ids' type under
    it: the delivery that comes next runs, where its claim used to fail with a LedgerError
    and Celery acknowledged it unrun."""
    stack = make_stack("redis", concurrency=1, start_worker=False)
    with stack.ledger.engine.begin() as conn:  # the id columns as version 4 made them
        for table, column in (
            ("questpie_queue_dispatch", "id"),
            ("questpie_schedule", "last_dispatch_id"),
        ):
            conn.execute(sql_text(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar(36)"))
    stack.worker.start()
    t = tag()
    for n in range(8):  # past psycopg's prepare threshold in the pool process
        dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=f"{t}-{n}")
        assert dispatch_id is not None
        stack.wait_status(dispatch_id, "completed")
    stack.questpie.migrate()
    late = stack.questpie.queue.record.publish({"tag": f"{t}-late"}, idempotency_key=t)
    assert late is not None
    assert stack.wait_status(late, "completed").attempt == 1
    assert len(stack.runs(f"{t}-late")) == 1
    assert not [line for line in stack.worker.log_about(late) if "raised unexpected" in line]


# --- a ledger server that is down --------------------------------------------------------


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server this test alone may stop (the `postgres` one is shared)."""
    server = PostgresServer().start()
    yield server
    server.close()


def test_delivery_meeting_an_unreachable_ledger_is_not_lost(
    own_postgres: PostgresServer,
    postgres: PostgresServer,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    env = {
        "QP_TEST_BROKER": redis_server.url(redis_server.new_db()),
        "QP_TEST_BACKEND": redis_server.url(redis_server.new_db()),
        "QP_TEST_LEDGER": own_postgres.create_database(),
        "QP_TEST_RUNS": runs_database(postgres),
        **SHORT_LEASE,
    }
    stack = build_stack(env, tmp_path, "redis")
    try:
        t, idle = tag(), idle_queue()
        dispatch_id = stack.questpie.queue.record.publish(
            {"tag": t}, idempotency_key=f"pg-down:{t}", queue=idle
        )
        assert dispatch_id is not None
        message = capture(stack, idle)
        own_postgres.stop()
        deliver(stack, message)
        # The delivery met the unreachable ledger and is waiting, not acknowledged away.
        stack.wait_log(dispatch_id, "the ledger is unreachable")
        assert stack.runs(t) == []
        own_postgres.start()
        row = stack.wait_status(dispatch_id, "completed", timeout=90)
        assert row.attempt == 1
        assert [r["attempt"] for r in stack.runs(t)] == [1]
        assert stack.worker.alive()
    finally:
        stack.close()


#: A worker's log line: `[time: LEVEL/Process] message`.
LOG_LINE = re.compile(r"^\[[^\]]*: (?P<level>[A-Z]+)/(?P<process>[^\]]+)\] (?P<message>.*)$")
DOWN = "the dispatch ledger cannot be reached ("
BACK = "the dispatch ledger can be reached again, after"


def test_a_ledger_outage_is_one_line_per_process_with_its_cause_and_one_when_it_ends(
    make_stack: StackFactory, postgres: PostgresServer, proxy: FaultProxy
) -> None:
    """The ledger goes away under a worker whose run renews its lease, whose relay
    passes and listens, while a delivery waits to claim and the run's outcome waits to be
    written. Each process of the worker says once that the ledger cannot be reached, with
    the cause and no traceback, and once that it is back; which dispatch waits is INFO,
    said once. Before, every part warned on each try (renewals every second, claims and
    outcomes every few seconds, the relay's listener with a traceback every 5 s)."""
    direct = postgres.create_database("outage")
    stack = make_stack(
        "redis",
        env={
            "QP_TEST_LEDGER": proxy.url(direct, postgres.port),
            "QP_TEST_RUNS": runs_database(postgres),
            "QP_TEST_LEASE": "12",  # renewed every 4 s, a failed renewal tried every second
            "QP_TEST_RELAY": "0.5",
        },
    )
    stack.ledger.close()
    stack.ledger = open_ledger(direct)
    t, idle = tag(), idle_queue()
    gate = stack.gate()
    running = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=f"{t}:run"
    )
    waiting = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=f"{t}:wait", queue=idle
    )
    assert running is not None and waiting is not None
    stack.wait_status(running, "active")
    message = capture(stack, idle)
    stack.questpie.close()  # this process's acceptance marks are written; nothing more
    before = len(stack.worker.log().splitlines())

    proxy.cut()
    try:
        stack.wait_log(running, "could not renew the claim")
        deliver(stack, message)
        stack.wait_log(waiting, "the ledger is unreachable")
        gate.open()
        stack.wait_log(running, "could not record its outcome yet")
        # Every part tries again many times before the ledger is back.
        tries = proxy.refused
        wait_until(lambda: proxy.refused >= tries + 40, "forty more tries to connect", 60)
    finally:
        proxy.heal()
    stack.wait_status(running, "completed", timeout=60)
    stack.wait_status(waiting, "completed", timeout=60)

    def said() -> list[re.Match[str]]:
        found = [LOG_LINE.match(line) for line in stack.worker.log().splitlines()[before:]]
        return [m for m in found if m is not None]

    def told(text: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for m in said():
            if text in m["message"]:
                counts[m["process"]] = counts.get(m["process"], 0) + 1
        return counts

    wait_until(lambda: told(BACK) == told(DOWN), "every process to say the ledger is back", 30)
    log = "\n".join(stack.worker.log().splitlines()[before:])
    down, back = told(DOWN), told(BACK)
    assert "MainProcess" in down, log  # the relay (and its listener)
    assert len(down) >= 2, log  # ... and the pool process that ran the handler
    assert set(down.values()) == {1} and down == back, log
    assert "Traceback" not in log, log
    loud = [m.group(0) for m in said() if m["level"] in ("WARNING", "ERROR", "CRITICAL")]
    assert all(DOWN in line or BACK in line for line in loud), "\n".join(loud)
    for m in said():
        if DOWN in m["message"]:
            assert "OperationalError" in m["message"], m.group(0)  # the cause
    # Which dispatch waited is said once per wait, at INFO.
    renewals = [line for line in stack.worker.log_about(running) if "could not renew" in line]
    assert len(renewals) == 1, renewals
    assert len(stack.runs(t)) == 2


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_relay_whose_broker_goes_away_says_so_once_reminds_and_says_when_it_is_back(
    make_stack: StackFactory, broker: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker goes away under a relay that has dispatches to send: its refused
    sends tell the log once that the broker cannot be reached, with the cause and no
    traceback, then remind while it lasts, and say once that it is back, when the
    dispatches go out. Which dispatch waits is INFO. (A reminder comes each minute; this
    relay's comes every two seconds, so the test sees one without waiting a minute.)"""
    stack = make_stack(broker, start_worker=False)
    direct = stack.env["QP_TEST_BROKER"]
    port = urlsplit(direct).port
    assert port is not None
    proxy = FaultProxy(port)
    _, relay = jobapp.build(
        broker=proxy.url(direct, port),
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
        relay_interval=0.2,
    )
    relay._outbox.broker_outage = Outage("the broker", remind_every=2.0)
    stop = threading.Event()
    running = threading.Thread(target=lambda: relay.run_relay(stop=stop), daemon=True)
    remind = "the broker still cannot be reached, for "
    try:
        proxy.cut()
        t = tag()
        # Refused at once: each row stays pending, due for the relay in a few seconds.
        waiting = [
            relay.queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}") for n in range(3)
        ]
        assert relay.flush(30)  # the refused sends (made after publish returned) are done
        caplog.set_level(logging.INFO, logger="questpie_celery")
        caplog.clear()
        running.start()

        def said(text: str) -> list[logging.LogRecord]:
            return [r for r in list(caplog.records) if text in r.getMessage()]

        try:
            wait_until(lambda: said("the broker cannot be reached ("), "the outage told", 60)
            wait_until(lambda: said(remind), "a reminder", 60)
        finally:
            proxy.heal()
        wait_until(lambda: said("the broker can be reached again, after"), "the broker back", 60)
        got = sorted(
            str(capture(stack, stack.queue_name, timeout=30).headers["id"]) for _ in waiting
        )
        assert got == sorted(str(d) for d in waiting)
    finally:
        stop.set()
        running.join(timeout=30)
        relay.close()
        proxy.close()
    records = list(caplog.records)
    log = "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}" for r in records)
    (down,) = said("the broker cannot be reached (")
    assert len(said("the broker can be reached again")) == 1, log
    assert "Error" in down.getMessage().split("(", 1)[1], log  # the cause's class
    assert not [r for r in records if r.exc_info], log  # no traceback
    loud = [r for r in records if r.levelno >= logging.WARNING and r.name.startswith("questpie")]
    assert all(r.name == "questpie_celery._runtime.outages" for r in loud), log
    assert said("refused the relay's send") and all(
        r.levelno == logging.INFO for r in said("refused the relay's send")
    ), log


def test_unreachable_ledger_raises_and_sends_nothing(redis_server: RedisServer) -> None:
    """(How long the caller waits for the error is a figure of bench/outages.py.)"""
    broker, idle = redis_server.url(redis_server.new_db()), idle_queue()
    _, questpie = jobapp.build(broker=broker, ledger=closed_ledger_url(), queue=idle)
    try:
        with pytest.raises(LedgerUnavailableError) as caught:
            questpie.queue.record.publish({"tag": "x"}, idempotency_key="k")
        assert isinstance(caught.value, QuestpieError)
        assert "cannot be reached" in str(caught.value)
        assert depth(broker, idle) == 0
    finally:
        questpie.close()


@contextlib.contextmanager
def sends_of(t: str) -> Iterator[list[dict[str, Any]]]:
    """The sends of `record` dispatches tagged `t` this process makes meanwhile, as Celery
    announces them (before the broker is tried): each one's retry policy."""
    sends: list[dict[str, Any]] = []

    def heard(sender: object = None, body: Any = None, **kwargs: Any) -> None:
        if sender == "record" and body[0][0].get("tag") == t:
            sends.append(dict(kwargs.get("retry_policy") or {}))

    before_task_publish.connect(heard, weak=False)
    try:
        yield sends
    finally:
        before_task_publish.disconnect(heard)


def test_unreachable_broker_leaves_a_pending_row_and_returns_before_its_send(
    pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A keyed publish returns once its row is written: its send, which the broker
    refuses, is made afterwards. (How long each takes is a figure of bench/outages.py.)"""
    _, questpie = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_db)
    questpie.migrate()
    ledger = open_ledger(pg_db)
    t = tag()
    returned = threading.Event()
    held: list[bool] = []  # per send: whether publish() had returned while it was held

    def hold(sender: object = None, body: Any = None, **_: Any) -> None:
        if sender == "record" and body[0][0].get("tag") == t:
            held.append(returned.wait(30))  # a publish waiting for its send never returns

    before_task_publish.connect(hold, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger="questpie_celery"):
            dispatch_id = questpie.queue.record.publish({"tag": t}, idempotency_key="down")
            returned.set()
            assert questpie.flush(30)  # the send, refused, is done
        flushed = ledger.now()
        assert dispatch_id is not None
        assert held == [True]
        row = ledger.get(dispatch_id)
        assert row is not None
        assert (row.status, row.queued_at, row.attempt) == ("pending", None, 0)
        # Due for the relay REFUSED_SEND_RETRY_SECONDS after the refusal (which came after
        # the row was written and before the flush returned), not after the grace a
        # publisher gets.
        assert REFUSED_SEND_RETRY_SECONDS < PENDING_GRACE_SECONDS
        retry = timedelta(seconds=REFUSED_SEND_RETRY_SECONDS)
        assert row.next_send_at is not None
        assert row.created_at + retry <= row.next_send_at <= flushed + retry
        warnings = [
            r
            for r in caplog.records
            if r.name.startswith("questpie_celery") and dispatch_id in r.getMessage()
        ]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        assert "relay" in warnings[0].getMessage()
        # Publishing the key again answers from the ledger without touching the broker.
        with sends_of(t) as sends:
            again = questpie.queue.record.publish({"tag": t}, idempotency_key="down")
            assert questpie.flush(30)
            assert (again, sends) == (dispatch_id, [])
    finally:
        before_task_publish.disconnect(hold)
        returned.set()
        questpie.close()
        ledger.close()


def test_unreachable_broker_unledgered_publish_raises(pg_db: str) -> None:
    """Its one send is refused under the publish's short retry policy, not kombu's
    default one that waits for the broker for ever. (How long the caller waits for the
    error is a figure of bench/outages.py.)"""
    _, questpie = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_db)
    questpie.migrate()
    t = tag()
    try:
        with sends_of(t) as sends:
            with pytest.raises(BrokerError):
                questpie.queue.record.publish({"tag": t})
            assert sends == [dict(PUBLISH_RETRY_POLICY)], sends
    finally:
        questpie.close()


def test_unreachable_ledger_still_lets_an_unkeyed_standard_publish_through(
    redis_server: RedisServer,
) -> None:
    """It needs no ledger row; a job whose declared policy needs one is refused."""
    broker, idle = redis_server.url(redis_server.new_db()), idle_queue()
    _, questpie = jobapp.build(broker=broker, ledger=closed_ledger_url(), queue=idle)
    try:
        t = tag()
        dispatch_id = questpie.queue.record.publish({"tag": t})
        assert dispatch_id is not None
        headers, body = take(broker, idle)
        assert headers["id"] == dispatch_id
        assert headers["task"] == "record"
        header = headers["questpie"]
        assert isinstance(header, dict)
        assert header["ledgered"] is False
        assert isinstance(body, list | tuple)
        assert body[0][0]["tag"] == t
        # policy.exclusive declares the exclusive policy: every dispatch needs a row.
        with pytest.raises(LedgerUnavailableError):
            questpie.queue.policy_exclusive.publish({"tag": t})
        assert depth(broker, idle) == 0
    finally:
        questpie.close()


# --- a ledger that refuses the connection, or cannot be reached: which, and what to do --

#: The roles the server's pg_hba.conf guards for `guarded_server`: one needs a password,
#: one TLS (which this server does not offer, as a managed one requiring it would
#: refuse a client that does not ask for it), and one no rule lets in at all.
PASSWORD_ROLE, TLS_ROLE, NO_RULE_ROLE = "qp_needs_password", "qp_needs_tls", "qp_no_rule"


@pytest.fixture(scope="module")
def guarded_server(postgres: PostgresServer) -> Iterator[PostgresServer]:
    """The session's server, with rules for two roles of its own ahead of its own rules
    (which trust everyone); put back afterwards."""
    admin = sqlalchemy.create_engine(postgres.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sql_text(f"CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD 'right-one'"))
        conn.execute(sql_text(f"CREATE ROLE {TLS_ROLE} LOGIN"))
        conn.execute(sql_text(f"CREATE ROLE {NO_RULE_ROLE} LOGIN"))
        hba = Path(conn.execute(sql_text("SHOW hba_file")).scalar_one())
    rules = hba.read_text()
    hba.write_text(
        f"host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256\n"
        f"hostnossl all {TLS_ROLE} 127.0.0.1/32 reject\n"
        f"host all {NO_RULE_ROLE} 127.0.0.1/32 reject\n" + rules
    )

    def reload() -> None:
        with admin.connect() as conn:
            conn.execute(sql_text("SELECT pg_reload_conf()"))

    reload()
    # The postmaster reads the rules on its own time: wait until they hold.
    refused = f"postgresql+psycopg://{TLS_ROLE}@127.0.0.1:{postgres.port}/postgres"
    wait_until(lambda: not _connects(refused), "the new pg_hba.conf rules to hold")
    yield postgres
    hba.write_text(rules)
    reload()
    wait_until(lambda: _connects(refused), "the old pg_hba.conf rules to hold again")
    with admin.connect() as conn:
        conn.execute(sql_text(f"DROP ROLE {PASSWORD_ROLE}"))
        conn.execute(sql_text(f"DROP ROLE {TLS_ROLE}"))
        conn.execute(sql_text(f"DROP ROLE {NO_RULE_ROLE}"))
    admin.dispose()


def _connects(url: str) -> bool:
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect():
            return True
    except sqlalchemy.exc.OperationalError:
        return False
    finally:
        engine.dispose()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections and never answers: a host behind a black hole."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("{user}@{server}/postgres?connect_timeout=2", None),  # the control: it connects
        ("qp_no_such_role@{server}/postgres",
         'refused the connection: the server has no role "qp_no_such_role"; create it'),
        ("{user}@{server}/qp_no_such_db",
         'refused the connection: the server has no database "qp_no_such_db"; create it'),
        (f"{PASSWORD_ROLE}:wrong-one@{{server}}/postgres",
         f'refused the connection: authentication failed: the server refused the password of '
         f'role "{PASSWORD_ROLE}"'),
        (f"{PASSWORD_ROLE}@{{server}}/postgres",
         "refused the connection: the server asks for a password and the ledger URL gives none"),
        # The server refuses both in the same words: the message names both ways out.
        (f"{TLS_ROLE}@{{server}}/postgres",
         "refused the connection: the server's pg_hba.conf lets no unencrypted connection in "
         "for this host, role and database: if it takes them over TLS, add sslmode=require"),
        (f"{NO_RULE_ROLE}@{{server}}/postgres",
         "; otherwise add a rule for them to pg_hba.conf, or connect as a role one allows"),
        ("{user}@{server}/postgres?sslmode=require",
         "refused the connection: the ledger URL requires TLS (its sslmode) and the server "
         "offers none"),
        ("{user}@127.0.0.1:{free}/postgres",
         'cannot be reached: nothing accepts connections at host "127.0.0.1", port {free} '
         "(connection refused)"),
        ("{user}@qp-no-such-host.invalid/postgres",
         'cannot be reached: the host name "qp-no-such-host.invalid" does not resolve'),
        ("{user}@127.0.0.1:{silent}/postgres?connect_timeout=2",
         "cannot be reached: no answer from the ledger URL's host before the connect timeout"),
    ],
)  # fmt: skip
def test_a_ledger_that_refuses_or_cannot_be_reached_says_which_and_what_to_do(
    guarded_server: PostgresServer, silent_port: int, url: str, says: str | None
) -> None:
    values = {
        "user": guarded_server.user,
        "server": f"127.0.0.1:{guarded_server.port}",
        "free": str(free_port()),
        "silent": str(silent_port),
    }
    ledger = open_ledger("postgresql://" + url.format(**values))
    try:
        if says is None:
            assert ledger.migration.migrate() > 0
            return
        with pytest.raises(LedgerUnavailableError) as caught:
            ledger.migration.migrate()
        assert str(caught.value).startswith("the dispatch ledger database "), caught.value
        assert says.format(**values) in str(caught.value)
        assert "wrong-one" not in str(caught.value)
    finally:
        ledger.close()


def test_migrate_on_a_missing_role_prints_what_to_do(guarded_server: PostgresServer) -> None:
    url = f"postgresql://app@127.0.0.1:{guarded_server.port}/app"
    result = CliRunner().invoke(cli_main, ["migrate", "--ledger-url", url])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.output == (
        "Error: the dispatch ledger database refused the connection: the server has no role "
        '"app"; create it (CREATE ROLE "app" LOGIN PASSWORD \'...\') or put an existing role '
        "in the ledger URL\n"
    )
