"""Bulk publishing: `publish_many` decides, stores and sends exactly what the same
sequence of `publish` calls would, with real ledgers, brokers and workers."""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from questpie_celery import BrokerError, PayloadValidationError, PublishOptionsError
from questpie_celery.ledger import dispatch_table
from questpie_celery.send.outbox import PENDING_GRACE_SECONDS, REFUSED_SEND_RETRY_SECONDS
from questpie_celery.signals import publish_suppressed
from tests.support.brokers import queue_depth
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

StackFactory = Callable[..., Stack]


def idle() -> str:
    """A queue no worker reads: what is published there stays there."""
    return f"idle-{uuid.uuid4().hex[:8]}"


def stored(stack: Stack, job_name: str) -> list[tuple[str, ...]]:
    """What the ledger holds for a job, in a form two stacks can be compared by."""
    t = dispatch_table.c
    query = select(t.idempotency_key, t.singleton_key, t.slot, t.status, t.payload, t.policy)

    def read() -> list[tuple[str, ...]]:
        with stack.ledger.engine.connect() as conn:
            found = conn.execute(query.where(t.job_name == job_name))
            return sorted((tuple(map(str, row)) for row in found), key=repr)

    # The broker's acceptance is recorded in the background, a moment after the send.
    def settled() -> list[tuple[str, ...]] | None:
        rows = read()
        return rows if all(row[3] != "pending" for row in rows) else None

    return wait_until(settled, "every sent row marked queued")


def same_shape(bulk: list[str | None], one_by_one: list[str | None], keys: list[Any]) -> None:
    """Equal where an id is derived from a key; suppressed at the same places elsewhere
    (an unkeyed dispatch's id is random, so only its presence can match)."""
    assert len(bulk) == len(one_by_one)
    for index, (a, b, key) in enumerate(zip(bulk, one_by_one, keys, strict=True)):
        if key is not None:
            assert a == b, f"item {index}"
        else:
            assert (a is None) == (b is None), f"item {index}"


CASES: dict[str, tuple[str, list[str | None] | None, list[str | None] | None]] = {
    # job, idempotency keys, singleton keys
    "standard keys, repeats inside and unkeyed": (
        "record",
        ["a", "b", "a", None, "c", None, "b"],
        None,
    ),
    "short: one waiting per slot": ("policy.short", None, ["s1", "s1", "s2", None, None, "s2"]),
    "stately: one waiting per slot": ("policy.stately", None, ["s1", "s2", "s1", "s3"]),
    "exclusive: one overall, known keys still answered": (
        "policy.exclusive",
        ["k1", "k2", "k1", None],
        None,
    ),
    "singleton: all accepted while none runs": ("policy.singleton", None, ["x", "x", None]),
}


@pytest.mark.parametrize("ledger", ["postgresql", "sqlite"])
@pytest.mark.parametrize("case", list(CASES))
def test_publish_many_decides_as_sequential_publishes_do(
    make_stack: StackFactory, ledger: str, case: str
) -> None:
    job_name, keys, singles = CASES[case]
    count = len(keys or singles or [])
    t = tag()
    payloads = [{"tag": t, "sleep": float(i)} for i in range(count)]
    bulk_stack = make_stack("redis", ledger=ledger, start_worker=False)
    sequential_stack = make_stack("redis", ledger=ledger, start_worker=False)
    queue = idle()
    # A key published before the call is answered with its id by both.
    for stack in (bulk_stack, sequential_stack):
        stack.questpie.queue[job_name].publish(
            {"tag": t}, queue=queue, **({"idempotency_key": "a"} if keys else {})
        )

    suppressed: list[str] = []

    def on_suppressed(sender: str, **kwargs: Any) -> None:
        suppressed.append(sender)

    publish_suppressed.connect(on_suppressed)
    try:
        bulk = bulk_stack.questpie.queue[job_name].publish_many(
            payloads, idempotency_keys=keys, singleton_keys=singles, queue=queue
        )
        bulk_suppressed, suppressed[:] = len(suppressed), []
        one_by_one = [
            sequential_stack.questpie.queue[job_name].publish(
                payload,
                idempotency_key=keys[i] if keys else None,
                singleton_key=singles[i] if singles else None,
                queue=queue,
            )
            for i, payload in enumerate(payloads)
        ]
        assert bulk_suppressed == len(suppressed)
    finally:
        publish_suppressed.disconnect(on_suppressed)
    same_shape(bulk, one_by_one, keys or [None] * count)
    assert stored(bulk_stack, job_name) == stored(sequential_stack, job_name)
    # Each accepted dispatch was sent once, as one by one: the same number of messages.
    assert queue_depth(bulk_stack, queue) == queue_depth(sequential_stack, queue)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_thousand_keyed_payloads_run_once_each_and_again_return_the_same_ids(
    make_stack: StackFactory, broker: str
) -> None:
    stack = make_stack(broker)
    t = tag()
    keys = [f"order-{t}-{i}" for i in range(1000)]
    payloads = [{"tag": t} for _ in keys]
    ids = stack.questpie.queue.record.publish_many(payloads, idempotency_keys=keys)
    assert len(set(ids)) == 1000 and None not in ids
    stack.wait_runs(t, 1000, timeout=120)
    again = stack.questpie.queue.record.publish_many(payloads, idempotency_keys=keys)
    assert again == ids
    for dispatch_id in ids[::97]:
        assert dispatch_id is not None
        stack.wait_status(dispatch_id, "completed")
    assert len(stack.runs(t)) == 1000  # the second call ran nothing


def test_a_bad_item_is_named_and_nothing_is_written(make_stack: StackFactory) -> None:
    stack = make_stack("redis", start_worker=False)
    queue = idle()
    record = stack.questpie.queue.record
    payloads: list[Any] = [{"tag": "ok"}] * 3 + [{"tag": 5}] + [{"tag": "ok"}]
    with pytest.raises(PayloadValidationError, match="item 3"):
        record.publish_many(payloads, idempotency_keys=list("abcde"), queue=queue)
    with pytest.raises(PublishOptionsError, match="item 2"):
        record.publish_many([{"tag": "ok"}] * 3, idempotency_keys=["a", "b", ""], queue=queue)
    with pytest.raises(PublishOptionsError, match="2 entries for 3 payloads"):
        record.publish_many([{"tag": "ok"}] * 3, idempotency_keys=["a", "b"], queue=queue)
    with pytest.raises(PublishOptionsError, match="item 1: secret_payload needs"):
        stack.questpie.queue["secret.link"].publish_many(
            [{"tag": "x", "link": "l"}] * 2, idempotency_keys=["a", None], secret_payload=True
        )
    with pytest.raises(PublishOptionsError, match="list of payloads"):
        record.publish_many({"tag": "ok"})
    with pytest.raises(TypeError, match="idempotency_keys"):
        record.publish_many([{"tag": "ok"}], idempotency_key="a")  # type: ignore[call-arg]
    assert stack.dispatch_count() == 0
    assert queue_depth(stack, queue) == 0
    assert record.publish_many([]) == []


def test_secret_items_store_no_plaintext_and_reach_their_handlers(
    make_stack: StackFactory,
) -> None:
    stack = make_stack("redis", env={"QP_TEST_SECRET": "s" * 16 + "-test-secret-0123456789abcdef"})
    t = tag()
    canaries = [f"CANARY-{uuid.uuid4().hex}" for _ in range(20)]
    ids = stack.questpie.queue["secret.link"].publish_many(
        [{"tag": t, "link": canary} for canary in canaries],
        idempotency_keys=[f"{t}-{i}" for i in range(20)],
        secret_payload=True,
    )
    runs = stack.wait_runs(t, 20)
    digests = [hashlib.sha256(canary.encode()).hexdigest() for canary in canaries]
    assert sorted(run["note"] for run in runs) == sorted(digests)
    for dispatch_id in ids:
        assert dispatch_id is not None
        stack.wait_status(dispatch_id, "completed")
    with stack.ledger.engine.connect() as conn:
        everything = repr(conn.execute(select(dispatch_table)).all())
    assert not any(canary in everything for canary in canaries)


@pytest.mark.parametrize("ledger", ["postgresql", "sqlite"])
def test_in_a_session_rows_ride_its_transaction(make_stack: StackFactory, ledger: str) -> None:
    stack = make_stack("redis", ledger=ledger)
    t = tag()
    record = stack.questpie.queue.record
    engine = create_engine(stack.env["QP_TEST_LEDGER"])
    with Session(engine) as session:
        rolled = record.publish_many(
            [{"tag": t}] * 5, idempotency_keys=[f"{t}-r{i}" for i in range(5)], session=session
        )
        session.rollback()
    with Session(engine) as session:
        committed = record.publish_many(
            [{"tag": t}] * 5, idempotency_keys=[f"{t}-c{i}" for i in range(5)], session=session
        )
        if ledger == "postgresql":  # SQLite would wait on the session's write lock
            assert stack.dispatch_count() == 0  # not visible before the commit
        session.commit()
    stack.wait_runs(t, 5)
    assert stack.ledger.dispatches.get_many([i for i in rolled if i]) == []
    for dispatch_id in committed:
        assert dispatch_id is not None
        stack.wait_status(dispatch_id, "completed")
    assert len(stack.runs(t)) == 5
    engine.dispose()


def test_with_the_broker_down_keyed_items_wait_for_the_relay_and_plain_ones_raise(
    make_stack: StackFactory,
) -> None:
    down = make_stack("redis", start_worker=False, env={"QP_TEST_BROKER": "redis://127.0.0.1:1/0"})
    t = tag()
    record = down.questpie.queue.record
    ids = record.publish_many([{"tag": t}] * 10, idempotency_keys=[f"{t}-{i}" for i in range(10)])
    assert None not in ids
    assert down.questpie.flush(30)  # the sends (refused) are made after publish returns
    flushed = down.ledger.now()
    retry = timedelta(seconds=REFUSED_SEND_RETRY_SECONDS)
    assert REFUSED_SEND_RETRY_SECONDS < PENDING_GRACE_SECONDS
    for dispatch_id in ids:
        assert dispatch_id is not None
        row = down.row(dispatch_id)
        assert row.status == "pending" and row.next_send_at is not None
        # Due for the relay REFUSED_SEND_RETRY_SECONDS after the refusal (which came
        # after the row was written and before the flush returned), not after the grace
        # a live publisher gets.
        assert row.created_at + retry <= row.next_send_at <= flushed + retry
    # Without a key or a policy, an item has no ledger row: as apply_async, a refusal raises.
    with pytest.raises(BrokerError):
        record.publish_many([{"tag": t}] * 3)
    assert down.dispatch_count() == 10


@pytest.mark.parametrize("job_name", ["record", "policy.short"])
def test_concurrent_calls_in_opposite_orders_both_finish(
    make_stack: StackFactory, job_name: str
) -> None:
    # Each chunk is one statement holding many rows' locks: two calls taking the same
    # keys (or slots) in opposite orders can deadlock, and the loser is run again.
    stack = make_stack("redis", start_worker=False)
    queue = idle()
    t = tag()
    keys = [f"{t}-{i}" for i in range(1000)]
    barrier = threading.Barrier(2)
    results: list[list[str | None]] = []
    errors: list[BaseException] = []

    def publish(order: list[str]) -> None:
        barrier.wait()
        try:
            per_item = {"idempotency_keys" if job_name == "record" else "singleton_keys": order}
            results.append(
                stack.questpie.queue[job_name].publish_many(
                    [{"tag": t}] * len(order), queue=queue, **per_item
                )
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(o,)) for o in (keys, keys[::-1])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert stack.dispatch_count() == 1000  # each key (or slot) once
    accepted = [i for result in results for i in result if i is not None]
    assert len(set(accepted)) == 1000


def test_a_router_that_routes_by_payload_gets_every_queue_declared(
    make_stack: StackFactory,
) -> None:
    stack = make_stack("rabbitmq", start_worker=False)
    base = f"routed-{uuid.uuid4().hex[:6]}"

    def route(name: str, args: Any, kwargs: Any, options: Any, **rest: Any) -> Any:
        if name == "record" and args and isinstance(args[0], dict):
            return {"queue": f"{base}-{'a' if args[0].get('sleep', 0) % 2 == 0 else 'b'}"}
        return None

    stack.celery_app.conf.task_routes = (route,)
    t = tag()
    stack.questpie.queue.record.publish_many([{"tag": t, "sleep": float(i)} for i in range(4)])
    wait_until(lambda: queue_depth(stack, f"{base}-b") == 2, "both queues get their messages")
    assert queue_depth(stack, f"{base}-a") == 2


def test_a_pipeline_the_broker_refuses_says_some_may_have_arrived(
    make_stack: StackFactory, redis_server: Any
) -> None:
    stack = make_stack("redis", start_worker=False)
    admin = redis_lib.Redis(port=redis_server.port)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 1_000_000)
    try:
        with pytest.raises(BrokerError, match="some may have arrived"):
            stack.questpie.queue.record.publish_many([{"tag": "x" * 10_000}] * 300)
    finally:
        admin.config_set("maxmemory", 0)
