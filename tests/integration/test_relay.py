"""The relay's sends, on PostgreSQL and a real broker (Redis and RabbitMQ).

Every stack here has no worker, so no relay runs but the passes a test makes
itself (`questpie.run_relay(once=True)`), and every message the relay sends
stays in the stack's queue where the test counts it. Tests put rows into the
state they need (due now, out of sends, an expired lease) by writing the ledger
table directly.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue
from kombu.transport.redis import PublishBatch
from sqlalchemy import Engine, text, update

from questpie_celery import BrokerError, Questpie
from questpie_celery.ledger import dispatch_table
from questpie_celery.send.broker import Sender
from questpie_celery.send.outbox import MAX_RELAY_SENDS, REFUSED_SEND_RETRY_SECONDS, Outbox
from questpie_celery.worker.outcomes import Unrun
from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.brokers import capture, idle_queue, queue_depth
from tests.support.faults import (
    closed_broker,
)
from tests.support.services import ROOT
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

BROKERS = ["redis", "rabbitmq"]
SECRET = "r" * 40


def set_row(stack: Stack, dispatch_id: str, **values: object) -> None:
    """Write ledger columns of one row directly: the state a test starts from."""
    with stack.ledger.engine.begin() as conn:
        found = conn.execute(
            update(dispatch_table).where(dispatch_table.c.id == dispatch_id).values(**values)
        ).rowcount
    assert found == 1, f"no ledger row {dispatch_id}"


def make_due(stack: Stack, dispatch_id: str, **values: object) -> None:
    set_row(stack, dispatch_id, next_send_at=datetime.now(UTC) - timedelta(seconds=1), **values)


def offline_questpie(stack: Stack, broker: str) -> Questpie:
    """A `Questpie` on the stack's ledger whose broker is down."""
    _, questpie = jobapp.build(
        broker=closed_broker(broker),
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
        secret=stack.env.get("QP_TEST_SECRET"),
    )
    return questpie


def published(stack: Stack, **options: Any) -> str:
    """A keyed dispatch of `record`, its acceptance by the broker recorded (`queued`)."""
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": tag()}, idempotency_key=uuid.uuid4().hex, **options
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued", timeout=10)
    return dispatch_id


def relay_stack(make_stack: StackFactory, broker: str, **env: str) -> Stack:
    """A stack with no worker: only the test's own relay passes send anything."""
    return make_stack(broker, env=env, start_worker=False)


@pytest.mark.parametrize("broker", BROKERS)
def test_lost_message_is_sent_again_after_redeliver_after(
    make_stack: StackFactory, broker: str
) -> None:
    # redeliver_after 2 s; on Redis, the visibility timeout must not hold it back.
    stack = relay_stack(make_stack, broker, QP_TEST_REDELIVER="2", QP_TEST_VISIBILITY="1")
    dispatch_id = published(stack)
    seen = stack.ledger.now()  # the database's clock, once the acceptance is marked
    row = stack.row(dispatch_id)
    assert row.queued_at is not None and row.next_send_at is not None
    # Due again redeliver_after after the broker took it: counted from the acceptance's
    # mark, which came between the acceptance and this test seeing it.
    redeliver = timedelta(seconds=2)
    assert row.queued_at + redeliver <= row.next_send_at <= seen + redeliver
    lost = capture(stack, stack.queue_name)  # the broker loses the message (purged, say)
    assert lost.headers["id"] == dispatch_id
    # Not yet: a worker may still be on its way to it.
    assert stack.questpie.run_relay(once=True) == 0
    assert queue_depth(stack, stack.queue_name) == 0
    # Passes until one sends it: that one ended after the row was due (by the database's
    # clock, the relay's own), so it was not sent early.
    passes: list[tuple[int, datetime]] = []  # (sent, the database's clock after the pass)

    def a_pass_sent() -> int:
        passes.append((stack.questpie.run_relay(once=True), stack.ledger.now()))
        return passes[-1][0]

    wait_until(a_pass_sent, "a relay pass to send the lost message again", 15, 0.1)
    sent, ended = passes[-1]
    assert sent == 1 and ended >= row.next_send_at, (row.next_send_at, passes)
    again = capture(stack, stack.queue_name)
    assert (again.headers["id"], again.headers["questpie"]["attempt"]) == (dispatch_id, 1)
    row = stack.row(dispatch_id)
    assert (row.status, row.send_count, row.attempt) == ("queued", 1, 0)
    # Backed off: the next pass does not send it yet again.
    assert stack.questpie.run_relay(once=True) == 0
    assert queue_depth(stack, stack.queue_name) == 0


@pytest.mark.parametrize("broker", BROKERS)
def test_pending_row_of_a_publisher_whose_broker_was_down_is_sent(
    make_stack: StackFactory, broker: str
) -> None:
    stack = relay_stack(make_stack, broker)
    offline = offline_questpie(stack, broker)
    try:
        dispatch_id = offline.queue.record.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex)
    finally:
        offline.close()
    assert dispatch_id is not None  # accepted into the ledger although the broker refused
    row = stack.row(dispatch_id)
    assert (row.status, row.attempt, row.send_count) == ("pending", 0, 0)
    assert queue_depth(stack, stack.queue_name) == 0
    make_due(stack, dispatch_id)
    assert stack.questpie.run_relay(once=True) == 1
    message = capture(stack, stack.queue_name)
    assert (message.headers["id"], message.headers["task"]) == (dispatch_id, "record")
    assert message.headers["questpie"]["attempt"] == 1
    row = stack.wait_status(dispatch_id, "queued", timeout=10)
    assert row.send_count == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_far_off_start_after_waits_in_the_ledger(make_stack: StackFactory, broker: str) -> None:
    stack = relay_stack(make_stack, broker)
    start = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    dispatch_id = stack.questpie.queue.record.publish({"tag": tag()}, start_after=start)
    assert dispatch_id is not None
    row = stack.row(dispatch_id)  # ledgered although unkeyed: no broker ETA two hours out
    assert (row.status, row.run_after) == ("pending", start)
    assert row.next_send_at == start - timedelta(seconds=60)
    assert stack.questpie.run_relay(once=True) == 0
    assert queue_depth(stack, stack.queue_name) == 0
    # Shortly before it is due, the relay hands it to the broker, with its ETA.
    make_due(stack, dispatch_id, run_after=datetime.now(UTC) + timedelta(seconds=30))
    assert stack.questpie.run_relay(once=True) == 1
    message = capture(stack, stack.queue_name)
    assert message.headers["id"] == dispatch_id
    assert message.headers["eta"] is not None


@pytest.mark.parametrize("broker", BROKERS)
def test_after_the_last_send_the_dispatch_fails_and_a_secret_is_erased(
    make_stack: StackFactory, broker: str
) -> None:
    stack = relay_stack(make_stack, broker, QP_TEST_SECRET=SECRET)
    queue = stack.questpie.queue
    plain = published(stack)
    secret = queue.secret_link.publish(
        {"tag": tag(), "link": "https://example.test/once"},
        idempotency_key=uuid.uuid4().hex,
        secret_payload=True,
    )
    assert secret is not None
    stack.wait_status(secret, "queued", timeout=10)
    assert stack.row(secret).secret_ciphertext is not None
    for _ in range(2):
        capture(stack, stack.queue_name)  # both messages lost
    for dispatch_id in (plain, secret):
        make_due(stack, dispatch_id, send_count=MAX_RELAY_SENDS)
    assert stack.questpie.run_relay(once=True) == 2
    for dispatch_id in (plain, secret):
        row = stack.row(dispatch_id)
        assert (row.status, row.last_error) == ("failed", "RelayGaveUp")
        assert row.finished_at is not None
        assert row.secret_ciphertext is None and row.secret_wrapped_key is None
    assert queue_depth(stack, stack.queue_name) == 0  # given up: nothing sent
    receipt = queue.get_receipt(secret)
    assert receipt is not None and receipt.status == "failed"


@pytest.mark.parametrize("broker", BROKERS)
def test_two_relays_send_a_due_row_once(make_stack: StackFactory, broker: str) -> None:
    stack = relay_stack(make_stack, broker)
    dispatch_id = published(stack)
    capture(stack, stack.queue_name)  # lost
    make_due(stack, dispatch_id)
    _, other = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    barrier = threading.Barrier(2)
    moved: list[int] = []
    lock = threading.Lock()

    def one_pass(questpie: Questpie) -> None:
        barrier.wait()
        result = questpie.run_relay(once=True)
        with lock:
            moved.append(result)

    try:
        threads = [threading.Thread(target=one_pass, args=(q,)) for q in (stack.questpie, other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        other.close()
    assert sorted(moved) == [0, 1]
    assert queue_depth(stack, stack.queue_name) == 1
    assert stack.row(dispatch_id).send_count == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_relay_command_makes_one_pass(make_stack: StackFactory, broker: str) -> None:
    stack = relay_stack(make_stack, broker)
    dispatch_id = published(stack)
    capture(stack, stack.queue_name)  # lost
    make_due(stack, dispatch_id)
    command = Path(sys.executable).parent / "questpie-celery"
    result = subprocess.run(
        [str(command), "relay", "--once", "-A", "tests.support.jobapp:questpie"],
        cwd=ROOT,
        env={**os.environ, **stack.env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "moved 1 dispatch(es)" in result.stdout
    message = capture(stack, stack.queue_name)
    assert message.headers["id"] == dispatch_id
    assert stack.row(dispatch_id).send_count == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_pass_with_the_broker_down_tries_one_send_and_still_ends_lapsed_leases(
    make_stack: StackFactory, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the broker down, a pass tries one send, not one per due row (each would wait
    out the broker's connection retries), and still ends the lapsed leases. (How long
    such a pass takes is a figure of bench/outages.py.)"""
    stack = relay_stack(make_stack, broker)
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    due = [published(stack, queue=idle) for _ in range(5)]
    lapsed_retry = published(stack, queue=idle, retry_limit=2)
    lapsed_last = published(stack, queue=idle, retry_limit=0)
    now = datetime.now(UTC)
    for dispatch_id in (lapsed_retry, lapsed_last):
        # A worker claimed it and died: its lease ran out five seconds ago.
        set_row(
            stack,
            dispatch_id,
            status="active",
            attempt=1,
            claim_token=str(uuid.uuid4()),
            started_at=now - timedelta(seconds=65),
            lease_expires_at=now - timedelta(seconds=5),
        )
    for dispatch_id in due:
        make_due(stack, dispatch_id)
    offline = offline_questpie(stack, broker)
    real_send, tried = Sender.send, []

    def send(self: Sender, **kwargs: Any) -> None:
        tried.append(kwargs["dispatch_id"])
        real_send(self, **kwargs)

    monkeypatch.setattr(Sender, "send", send)
    try:
        moved = offline.run_relay(once=True, end_lapsed_leases=True)
    finally:
        monkeypatch.undo()
        offline.close()
    # One due row's send, refused, and none after it (besides the retry of the lapsed
    # lease that has attempts left, sent as its lease ends).
    assert len([i for i in tried if i in due]) == 1, tried
    assert set(tried) - set(due) <= {lapsed_retry}, tried
    assert moved == 2  # the two lapsed leases; no send got through
    retry = stack.row(lapsed_retry)
    assert (retry.status, retry.attempt, retry.last_error) == ("retry", 1, "LeaseExpired")
    assert retry.claim_token is None and retry.lease_expires_at is None
    last = stack.row(lapsed_last)
    assert (last.status, last.attempt, last.last_error) == ("failed", 1, "LeaseExpired")
    # After the first refused send, the pass sent nothing more; every due row waits on.
    rows = [stack.row(i) for i in due]
    assert all(r.status == "queued" for r in rows)
    assert sum(r.send_count for r in rows) <= 1
    assert queue_depth(stack, stack.queue_name) == 0


@pytest.mark.parametrize("broker", BROKERS)
def test_a_refused_send_leaves_the_row_due_for_the_relay_soon(
    make_stack: StackFactory, broker: str
) -> None:
    """Outbox: "After a send the broker refused, the row is made due for the relay soon"
    (REFUSED_SEND_RETRY_SECONDS), not at the far-off time it was given in the hope that
    the send would succeed (the publisher's grace, or a retry's redeliver_after)."""
    stack = relay_stack(make_stack, broker)
    soon = timedelta(seconds=REFUSED_SEND_RETRY_SECONDS + 2)
    offline = offline_questpie(stack, broker)
    try:
        # A publisher's first send, refused.
        first = offline.queue.record.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex)
        assert first is not None
        assert offline.flush(30)  # the send (refused) is made after publish returns
        row = stack.row(first)
        assert row.status == "pending" and row.next_send_at is not None
        assert row.next_send_at - datetime.now(UTC) <= soon, "the relay waits too long"
        # A retry the relay sends after ending a lapsed lease, refused.
        lapsed = published(stack, queue=f"idle-{uuid.uuid4().hex[:8]}", retry_limit=2)
        now = datetime.now(UTC)
        set_row(
            stack,
            lapsed,
            status="active",
            attempt=1,
            claim_token=str(uuid.uuid4()),
            started_at=now - timedelta(seconds=65),
            lease_expires_at=now - timedelta(seconds=5),
        )
        assert offline.run_relay(once=True, end_lapsed_leases=True) == 1
    finally:
        offline.close()
    row = stack.row(lapsed)
    assert row.status == "retry" and row.next_send_at is not None
    # Not the redeliver_after (an hour here) the row was given for a send that succeeded.
    assert row.next_send_at - datetime.now(UTC) <= soon, "the retry waits too long"


# --- batches, two relays, and waking on a commit (PostgreSQL, Redis) ----------------------


def backlog(stack: Stack, count: int) -> list[str]:
    """`count` dispatches written with publish(connection=...): due for the relay at once."""
    ids = []
    with stack.runs_engine.begin() as conn:  # the application's own engine on the ledger
        for _ in range(count):
            dispatch_id = stack.questpie.queue.record.publish({"tag": tag()}, connection=conn)
            assert dispatch_id is not None
            ids.append(dispatch_id)
    return ids


def sent_ids(stack: Stack) -> list[str]:
    """The dispatch id of every message waiting in the stack's Redis queue (all priorities)."""
    client = redis.Redis.from_url(stack.env["QP_TEST_BROKER"])
    try:
        ids = []
        for key in client.keys(f"{stack.queue_name}*"):
            if client.type(key) == b"list":
                ids += [json.loads(raw)["headers"]["id"] for raw in client.lrange(key, 0, -1)]
        return ids
    finally:
        client.close()


def test_two_relays_send_every_dispatch_of_a_backlog_exactly_once(
    make_stack: StackFactory,
) -> None:
    stack = relay_stack(make_stack, "redis")
    ids = backlog(stack, 3000)
    _, other = jobapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    barrier = threading.Barrier(2)
    moved: list[int] = []

    def drain(questpie: Questpie) -> None:
        barrier.wait()
        total = 0
        while sent := questpie.run_relay(once=True):
            total += sent
        moved.append(total)

    try:
        threads = [threading.Thread(target=drain, args=(q,)) for q in (stack.questpie, other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        other.close()
    assert sum(moved) == len(ids)
    assert all(moved), f"one relay sent everything ({moved}): they never overlapped"
    messages = sent_ids(stack)
    assert len(messages) == len(ids) and sorted(messages) == sorted(ids)
    with stack.ledger.engine.connect() as conn:
        counts = conn.execute(
            text(
                "SELECT status, send_count, count(*) FROM questpie_queue_dispatch "
                "GROUP BY status, send_count"
            )
        ).all()
    assert [tuple(row) for row in counts] == [("queued", 1, len(ids))]


def take_ids(stack: Stack) -> list[str]:
    """Take every message waiting in the stack's queue out of the broker; their ids."""
    ids = []
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        simple = conn.SimpleQueue(Queue(stack.queue_name, Exchange(stack.queue_name)))
        try:
            while True:
                message = simple.get(block=True, timeout=1)
                message.ack()
                ids.append(message.headers["id"])
        except simple.Empty:
            pass
        finally:
            simple.close()
    return ids


def assert_due_again(stack: Stack, rows: list[Any], *, counted: int, since: datetime) -> None:
    """Rows the broker did not take: pending, due again within seconds of the refusal
    (which came after `since`, the database's time before the relay's pass), and `counted`
    of them with their refused send counted (the others given back, uncounted)."""
    elapsed = (stack.ledger.now() - since).total_seconds()  # a loaded machine is slow
    assert sorted(r.send_count for r in rows) == [0] * (len(rows) - counted) + [1] * counted
    for row in rows:
        assert row.status == "pending" and row.next_send_at is not None
        ahead = (row.next_send_at - since).total_seconds()
        assert 0 < ahead <= elapsed + REFUSED_SEND_RETRY_SECONDS + 1


def sent_again_once_each(stack: Stack, ids: list[str], already: list[str]) -> list[str]:
    """Make passes until every dispatch has reached the broker; all the ids it took."""
    taken = list(already)

    def all_taken() -> bool:
        if set(taken) == set(ids):
            return True
        stack.questpie.run_relay(once=True)
        taken.extend(take_ids(stack))
        return set(taken) == set(ids)

    wait_until(
        all_taken,
        "relay passes to send the rows left due again",
        30,
        0.2,
        explain=lambda: f"{len(set(ids) - set(taken))} of {len(ids)} never reached the broker",
    )
    return taken


@pytest.mark.parametrize("broker", BROKERS)
def test_a_batch_the_broker_refuses_part_way_leaves_the_rest_due_again(
    make_stack: StackFactory, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = relay_stack(make_stack, broker)
    ids = backlog(stack, 50)  # one batch
    real_send = Sender.send
    calls = 0

    def refuses_after_ten(self: Sender, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls > 10:
            raise BrokerError("the broker went away") from ConnectionRefusedError()
        real_send(self, **kwargs)

    monkeypatch.setattr(Sender, "send", refuses_after_ten)
    since = stack.ledger.now()
    sent = stack.questpie.run_relay(once=True)
    assert calls == 11, "the pass went on sending after the broker refused"
    monkeypatch.undo()
    arrived = take_ids(stack)
    # The sends made before the refusal still go out (on Redis, as the batch's pipeline).
    assert len(arrived) == sent == 10
    rows = [stack.row(i) for i in ids]
    assert all((r.status, r.send_count) == ("queued", 1) for r in rows if r.id in arrived)
    assert_due_again(stack, [r for r in rows if r.id not in arrived], counted=1, since=since)
    # Never stuck, and nothing sent twice: the given-back rows go out once due again.
    assert sorted(sent_again_once_each(stack, ids, arrived)) == sorted(ids)


def test_a_batch_whose_pipeline_fails_is_sent_again(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis reports the batch's pipeline failed: which messages arrived is unknown, so
    every row is due again (a second message of one that did arrive is dropped by the
    fence)."""
    stack = relay_stack(make_stack, "redis")
    ids = backlog(stack, 50)
    real_flush = PublishBatch.flush

    def lost_reply(self: PublishBatch) -> None:
        real_flush(self)  # the messages arrive, but the reply is lost
        raise ConnectionError("connection reset")

    monkeypatch.setattr(PublishBatch, "flush", lost_reply)
    since = stack.ledger.now()
    assert stack.questpie.run_relay(once=True) == 0
    monkeypatch.undo()
    assert sorted(take_ids(stack)) == sorted(ids)
    assert_due_again(stack, [stack.row(i) for i in ids], counted=1, since=since)
    again = sent_again_once_each(stack, ids, [])
    assert sorted(again) == sorted(ids)


def listening_backends(engine: Engine) -> list[int]:
    """The PostgreSQL backends listening for relay wake-ups on this database."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query = 'LISTEN questpie_relay'"
                )
            ).scalars()
        )


class RelayPasses:
    """When each pass of a running relay began and ended: the relay is idle, waiting out
    its interval, once as many passes ended as began."""

    def __init__(self, questpie: Questpie, monkeypatch: pytest.MonkeyPatch) -> None:
        self.began = 0
        self.ended = 0
        relay = questpie._relay
        real = relay._pass

        def counted(**kwargs: Any) -> tuple[int, bool]:
            self.began += 1
            try:
                return real(**kwargs)
            finally:
                self.ended += 1

        monkeypatch.setattr(relay, "_pass", counted)

    def wait_idle(self) -> int:
        """Wait until the relay ended a pass and began no other; how many began so far."""
        wait_until(
            lambda: self.ended >= 1 and self.ended == self.began,
            "the relay to end its pass and wait out its interval",
            15,
            explain=lambda: f"{self.began} passes began, {self.ended} ended",
        )
        return self.began


def test_a_commit_wakes_a_relay_long_before_its_interval(
    make_stack: StackFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish(connection=...) notifies the relays in the caller's transaction: with a
    30 s interval, a relay still sends the row within seconds of the commit. And when its
    listening connection is lost, the relay polls meanwhile and listens again."""
    stack = relay_stack(make_stack, "redis", QP_TEST_RELAY="30")
    passes = RelayPasses(stack.questpie, monkeypatch)  # counted before the relay starts
    stop = threading.Event()
    relay = threading.Thread(target=lambda: stack.questpie.run_relay(stop=stop), daemon=True)
    relay.start()
    try:
        listening = wait_until(
            lambda: listening_backends(stack.ledger.engine), "the relay to listen", 15, 0.1
        )
        for _ in range(2):
            # Idle, its next pass 30 s away: only the commit's notification starts one.
            idle_after = passes.wait_idle()
            (dispatch_id,) = backlog(stack, 1)
            message = capture(stack, stack.queue_name, timeout=5)
            assert message.headers["id"] == dispatch_id
            assert passes.began > idle_after  # a pass the commit woke sent it
        idle_after = passes.wait_idle()
        with stack.runs_engine.begin() as conn:  # publish_many(connection=...) wakes it too
            many = stack.questpie.queue.record.publish_many(
                [{"tag": tag()} for _ in range(3)], connection=conn
            )
        arrived: list[str] = []

        def all_arrived() -> bool:
            arrived.extend(take_ids(stack))  # waits a second for each message
            return sorted(arrived) == sorted(many)

        wait_until(
            all_arrived,
            "publish_many's dispatches to be sent",
            5,
            0,
            explain=lambda: f"it sent {arrived} of {many}",
        )
        assert passes.began > idle_after
        # The listening connection dies (a failover, an idle timeout): the relay listens
        # again within seconds, and a commit wakes it as before. The ledger itself
        # stayed reachable: said at INFO, and no outage.
        with caplog.at_level(logging.INFO, logger="questpie_celery"):
            with stack.ledger.engine.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": listening[0]})
            wait_until(
                lambda: listening_backends(stack.ledger.engine) not in ([], listening),
                "the relay to listen again, on another connection",
                20,
                0.1,
            )
            (dispatch_id,) = backlog(stack, 1)
            message = capture(stack, stack.queue_name, timeout=5)
            assert message.headers["id"] == dispatch_id
        said = [r.getMessage() for r in caplog.records]
        again = [r for r in caplog.records if "listens for committed dispatches again" in r.message]
        assert [r.levelno for r in again] == [logging.INFO], said
        assert "listening connection was lost" in again[0].message, said
        assert not [m for m in said if "cannot be reached" in m], said
        assert relay.is_alive()
    finally:
        stop.set()
        relay.join(10)
    assert not relay.is_alive(), "the relay did not stop when asked"


def test_an_interrupted_batch_gives_every_taken_row_back(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipelined batch left by an exception (Ctrl-C on `questpie-celery relay`, say) is
    # discarded unsent: none of its rows may wait an hour as if the broker had them.
    stack = relay_stack(make_stack, "redis")
    offline = offline_questpie(stack, "redis")
    ids = [
        offline.queue.record.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex)
        for _ in range(20)
    ]
    offline.close()
    for dispatch_id in ids:
        assert dispatch_id is not None
        make_due(stack, dispatch_id)
    real_send, calls = Sender.send, []

    def send(self: Sender, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 11:
            raise KeyboardInterrupt
        real_send(self, **kwargs)

    monkeypatch.setattr(Sender, "send", send)
    with pytest.raises(KeyboardInterrupt):
        stack.questpie.run_relay(once=True)
    for dispatch_id in ids:
        assert dispatch_id is not None
        row = stack.row(dispatch_id)
        assert row.status == "pending" and row.send_count == 0
        assert row.next_send_at is not None
        assert row.next_send_at <= datetime.now(UTC) + timedelta(seconds=10)


def test_a_delivery_that_ended_unrun_and_can_never_be_recorded_does_not_stop_the_relay(
    make_stack: StackFactory,
) -> None:
    """A report of a delivery ended unrun whose statement the ledger refuses for good (an
    id PostgreSQL cannot store, here) is logged and dropped: kept for the next pass, it
    would fail every pass after, and nothing due would ever be sent by that relay."""
    stack = relay_stack(make_stack, "redis")
    dispatch_id = published(stack, queue=f"idle-{uuid.uuid4().hex[:8]}")
    make_due(stack, dispatch_id)
    before = stack.row(dispatch_id).send_count
    stack.questpie._relay.hear_unrun(Unrun("bad\x00id", "record", 1, "lost"))
    stack.questpie.run_relay(once=True)
    assert stack.row(dispatch_id).send_count == before + 1  # the pass went on and sent it
    stack.questpie.run_relay(once=True)  # and the next pass does not meet the report again


@pytest.mark.parametrize("broker", BROKERS)
def test_a_refused_relay_send_of_a_retry_is_tried_again_soon(
    make_stack: StackFactory, broker: str
) -> None:
    """The relay sends a due `retry` row and the broker refuses: the row is due again in
    seconds (2**send_count), not after redeliver_after (an hour), since the broker never
    took this send. Before the fix every non-pending row waited the hour."""
    stack = make_stack(broker, start_worker=False)
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=idle_queue()
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    # Its first attempt failed and the retry's message was lost: due for the relay now.
    with stack.ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(
                status="retry",
                attempt=1,
                last_error="RuntimeError",
                next_send_at=datetime.now(UTC) - timedelta(seconds=1),
            )
        )
    _, offline = jobapp.build(
        broker=closed_broker(broker), ledger=stack.env["QP_TEST_LEDGER"], queue=stack.queue_name
    )
    try:
        assert offline.run_relay(once=True) == 0  # refused
    finally:
        offline.close()
    row = stack.row(dispatch_id)
    assert (row.status, row.send_count) == ("retry", 1)
    assert row.next_send_at is not None
    assert row.next_send_at - datetime.now(UTC) <= timedelta(seconds=10), "waits too long"


def test_a_pass_failing_on_a_bug_after_a_ledger_error_still_logs_its_traceback(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass that fails on a ledger error (its table locked past the lock timeout, by a
    migration say) is said once; passes that then fail on something else (a bug) log its
    traceback all the same, or it would repeat unseen on every pass for the life of the
    worker, and nothing due would ever be sent."""
    stack = relay_stack(make_stack, "redis", QP_TEST_RELAY="0.2")
    bugs: list[int] = []

    def relay_batch(self: Outbox, limit: int) -> Any:
        bugs.append(limit)
        raise TypeError("a bug in the relay's sends")

    # Reached only once the lock is gone: every pass before stops on the lock.
    monkeypatch.setattr(Outbox, "relay_batch", relay_batch)
    stop = threading.Event()
    relay = threading.Thread(target=lambda: stack.questpie.run_relay(stop=stop), daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="questpie_celery.worker.relay"):
            with stack.ledger.engine.connect() as conn:
                # The ledger's engine autocommits; the lock needs a transaction of its own.
                locker = conn.execution_options(isolation_level="READ COMMITTED")
                locker.begin()
                locker.execute(text("LOCK TABLE questpie_queue_dispatch IN ACCESS EXCLUSIVE MODE"))
                relay.start()
                wait_until(
                    lambda: [r for r in caplog.records if "relay pass failed (" in r.getMessage()],
                    "a pass failing on the held lock",
                )
                locker.rollback()
            wait_until(lambda: len(bugs) >= 2, "two passes meeting the bug")
    finally:
        stop.set()
        if relay.ident is not None:
            relay.join(10)
    said = [r.getMessage() for r in caplog.records]
    tracebacks = [r for r in caplog.records if "relay pass failed unexpectedly" in r.getMessage()]
    assert len(tracebacks) == 1, said  # once, not once a pass
    assert tracebacks[0].exc_info is not None
    assert "a bug in the relay's sends" in caplog.text
