"""A ledgered publish's broker send, made after `publish()` returned, on real brokers.

`publish()` returns once the row is durable; one thread of the process then sends it.
These tests hold what a caller is promised: the messages reach the broker in publish
order, a script that simply ends has sent everything, a broker lost while sends wait
leaves them to the relay (each still runs once), and threads publishing the same keys
at once decide them exactly as one thread would.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery.signals import before_task_publish
from kombu import Connection, Exchange, Queue
from sqlalchemy import create_engine, text

from tests.integration.conftest import StackFactory
from tests.support import jobapp
from tests.support.brokers import idle_queue, queue_depth
from tests.support.faultproxy import FaultProxy
from tests.support.services import ROOT
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

BROKERS = ["redis", "rabbitmq"]


def message_ids(stack: Stack, queue: str, count: int) -> list[str]:
    """The task ids of the first `count` messages waiting in `queue`, in queue order."""
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        simple = conn.SimpleQueue(Queue(queue, Exchange(queue), routing_key=queue))
        ids = []
        for _ in range(count):
            message = simple.get(block=True, timeout=10)
            ids.append(str(message.headers["id"]))
            message.ack()
        simple.close()
    return ids


@pytest.mark.parametrize("broker", BROKERS)
def test_messages_reach_the_broker_in_publish_order(make_stack: StackFactory, broker: str) -> None:
    stack = make_stack(broker, start_worker=False)
    queue = idle_queue()
    client = stack.questpie.queue.record
    published = [
        client.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=queue)
        for _ in range(80)
    ]
    assert stack.questpie.flush(30)
    assert message_ids(stack, queue, len(published)) == published
    # The broker's acceptance of each is in the ledger once flushed.
    assert {stack.row(str(i)).status for i in published} == {"queued"}


@pytest.mark.parametrize("broker", BROKERS)
def test_a_publish_many_reaches_the_broker_as_one_pipelined_batch_in_order(
    make_stack: StackFactory, broker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = make_stack(broker, start_worker=False)
    queue = idle_queue()
    client = stack.questpie.queue.record
    sender = stack.questpie._outbox._sender
    batches: list[list[str]] = []  # the dispatch ids each pipelined batch sent
    real_batch, real_send = sender.batch, sender.send

    @contextmanager
    def batch(size: int) -> Iterator[None]:
        batches.append([])
        with real_batch(size):
            yield

    def send(**message: Any) -> None:
        batches[-1].append(message["dispatch_id"])  # one batch at a time, never two
        real_send(**message)

    monkeypatch.setattr(sender, "batch", batch)
    monkeypatch.setattr(sender, "send", send)
    # Single publishes from another thread, so the send thread may be busy when the bulk
    # publish hands its rows over: either way they go as one batch, after those.
    singles: list[str | None] = []

    def publish_singles() -> None:
        for _ in range(40):
            singles.append(
                client.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=queue)
            )

    publisher = threading.Thread(target=publish_singles)
    publisher.start()
    publisher.join()
    many = client.publish_many(
        [{"tag": tag()} for _ in range(1000)],
        idempotency_keys=[uuid.uuid4().hex for _ in range(1000)],
        queue=queue,
    )
    assert stack.questpie.flush(30)
    assert message_ids(stack, queue, 1040) == singles + many
    # Never split, whoever sent it: its 1,000 in one batch, in order (after the singles
    # that waited with them, if any did).
    together = next(sent for sent in batches if many[0] in sent)
    assert together[together.index(many[0]) :] == many
    assert [i for sent in batches for i in sent] == singles + many
    assert {stack.row(str(i)).status for i in many} == {"queued"}


@pytest.mark.parametrize("broker", BROKERS)
def test_flush_after_a_publish_many_returns_once_the_broker_has_every_message(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, start_worker=False)
    queue = idle_queue()
    client = stack.questpie.queue.record
    for _ in range(3):  # a single publish ahead keeps the send thread busy, or not
        client.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=queue)
        client.publish_many(
            [{"tag": tag()} for _ in range(250)],
            idempotency_keys=[uuid.uuid4().hex for _ in range(250)],
            queue=queue,
        )
    assert stack.questpie.flush(30)
    with Connection(stack.env["QP_TEST_BROKER"]) as conn:
        declared = Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel)
        _, count, _ = declared.queue_declare(passive=True)
    assert count == 3 * 251


@pytest.mark.parametrize("broker", BROKERS)
def test_a_script_that_just_ends_has_sent_every_publish(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, start_worker=False)
    queue = idle_queue()
    script = textwrap.dedent(
        f"""
        import sys, uuid
        from tests.support import jobapp
        _, questpie = jobapp.build(broker={stack.env["QP_TEST_BROKER"]!r},
                                   ledger={stack.env["QP_TEST_LEDGER"]!r})
        for n in range(150):
            print(questpie.queue.record.publish(
                {{"tag": str(n)}}, idempotency_key=uuid.uuid4().hex, queue={queue!r}))
        # No flush, no close: the interpreter's exit waits for the sends.
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    ids = done.stdout.split()
    assert len(ids) == 150
    assert queue_depth(stack, queue) == 150
    # ... and their acceptance was written after the last send, before the exit.
    assert {stack.row(i).status for i in ids} == {"queued"}


@pytest.mark.parametrize("broker", BROKERS)
def test_a_broker_lost_while_sends_wait_leaves_them_to_the_relay_and_each_runs_once(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker, start_worker=False)
    direct = stack.env["QP_TEST_BROKER"]
    port = int(direct.rsplit(":", 1)[1].split("/")[0])
    proxy = FaultProxy(port)
    _, publisher = jobapp.build(
        broker=direct.replace(f":{port}/", f":{proxy.port}/"),
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    first_send, go_on = threading.Event(), threading.Event()

    def hold_the_first_send(**_: Any) -> None:
        if not first_send.is_set():
            first_send.set()
            go_on.wait(30)

    before_task_publish.connect(hold_the_first_send, weak=False)
    try:
        tags = [tag() for _ in range(30)]
        ids = [
            publisher.queue.record.publish({"tag": t}, idempotency_key=uuid.uuid4().hex)
            for t in tags
        ]
        assert first_send.wait(10)  # the send thread holds the first; the rest wait
        proxy.cut()  # the broker is gone with the sends still to be made
        go_on.set()
        assert publisher.flush(60)
    finally:
        before_task_publish.disconnect(hold_the_first_send)
        go_on.set()
    # Every row is durable and left for the relay; none was lost with the thread's queue.
    rows = [stack.row(str(i)) for i in ids]
    assert {(row.status, row.attempt) for row in rows} == {("pending", 0)}
    assert all(row.next_send_at is not None for row in rows)
    # A worker (and its relay) on the broker sends and runs each of them once.
    stack.start_worker()
    for dispatch_id in ids:
        stack.wait_status(str(dispatch_id), "completed", timeout=60)
    assert [len(stack.runs(t)) for t in tags] == [1] * len(tags)
    publisher.close()
    proxy.close()


def test_threads_publishing_the_same_keys_decide_them_as_one_thread_would(
    make_stack: StackFactory,
) -> None:
    stack = make_stack("redis")
    keys = [f"k-{uuid.uuid4().hex[:8]}-{n}" for n in range(40)]
    tags = {key: tag() for key in keys}
    answers: list[dict[str, str | None]] = []
    barrier = threading.Barrier(8)

    def publish() -> None:
        mine = list(keys)
        random.shuffle(mine)
        barrier.wait()
        answers.append(
            {
                key: stack.questpie.queue.record.publish({"tag": tags[key]}, idempotency_key=key)
                for key in mine
            }
        )

    threads = [threading.Thread(target=publish) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 8
    # Every thread got the same dispatch for a key, and a key has one dispatch.
    for key in keys:
        assert len({answer[key] for answer in answers}) == 1, key
    assert len({answers[0][key] for key in keys}) == len(keys)
    for key in keys:
        stack.wait_status(str(answers[0][key]), "completed")
    assert [len(stack.runs(tags[key])) for key in keys] == [1] * len(keys)


def next_transaction_id(stack: Stack) -> int:
    """The id PostgreSQL gives the next transaction that writes (asking assigns none)."""
    with stack.ledger.engine.connect() as conn:
        query = text("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
        return int(conn.execute(query).scalar_one())


def test_threads_publishing_at_once_share_their_inserts_and_commits(
    make_stack: StackFactory,
) -> None:
    """Eight threads of one process publishing at once, each key from two of them: a
    publish that finds another's insert in flight goes into the next multi-row insert, so
    the rows take fewer write transactions (commits) than there are publishes; each key
    is written, sent once (a key twice in one statement is the first publish's) and
    answered with one id."""
    stack = make_stack("redis", start_worker=False)
    queue = idle_queue()
    client = stack.questpie.queue.record
    threads_, each = 8, 50
    keys = [f"k-{uuid.uuid4().hex[:8]}-{n}" for n in range(threads_ * each // 2)]
    barrier = threading.Barrier(threads_)
    answers: dict[str, set[str | None]] = {key: set() for key in keys}

    def publish(number: int) -> None:
        mine = [keys[(number * each // 2 + n) % len(keys)] for n in range(each)]
        barrier.wait()
        for key in mine:
            answers[key].add(client.publish({"tag": tag()}, idempotency_key=key, queue=queue))

    client.publish({"tag": tag()}, idempotency_key=uuid.uuid4().hex, queue=queue)
    assert stack.questpie.flush(30)
    first = next_transaction_id(stack)
    threads = [threading.Thread(target=publish, args=(n,)) for n in range(threads_)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stack.questpie.flush(30)
    writes = next_transaction_id(stack) - first
    published = threads_ * each
    assert all(len(ids) == 1 and None not in ids for ids in answers.values())
    ids = [str(next(iter(answers[key]))) for key in keys]
    assert len(set(ids)) == len(keys)
    # Each publish alone would be a write transaction of its own, and the broker's
    # acceptance is recorded in more; shared, the inserts take a fraction of that.
    assert writes < published, writes
    assert queue_depth(stack, queue) == len(keys) + 1  # one message per key
    assert {stack.row(i).status for i in ids} == {"queued"}


def test_a_publish_held_up_by_a_row_lock_holds_up_no_other_publish(
    make_stack: StackFactory,
) -> None:
    """A key's row held by a caller's open transaction: a publish of that key outside it
    waits for that transaction, and a publish of another key, behind it in the process,
    goes on meanwhile on its own statement instead of waiting (and failing) with it."""
    stack = make_stack("redis", start_worker=False)
    queue = idle_queue()
    client = stack.questpie.queue.record
    held, other = f"held-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    outcome: list[str | None] = []
    caller = create_engine(stack.ledger.engine.url)  # a project's own engine: transactions
    with caller.connect() as conn, conn.begin() as transaction:
        client.publish({"tag": tag()}, idempotency_key=held, queue=queue, connection=conn)
        blocked = threading.Thread(
            target=lambda: outcome.append(
                client.publish({"tag": tag()}, idempotency_key=held, queue=queue)
            )
        )
        blocked.start()
        wait_until(
            lambda: stack.questpie._publisher._shared._busy,
            "the held key's statement to wait for the lock (the shared inserts busy)",
            10,
            0.005,
        )
        # The other publish, while the held key's statement waits for the lock.
        other_id = client.publish({"tag": tag()}, idempotency_key=other, queue=queue)
        assert blocked.is_alive()  # still waiting for the open transaction
        assert other_id is not None and stack.row(other_id).idempotency_key == other
        transaction.commit()
    caller.dispose()
    blocked.join(30)
    assert len(outcome) == 1 and outcome[0] is not None
