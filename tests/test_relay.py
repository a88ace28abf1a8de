"""The relay's sends, against real PostgreSQL and Redis (run in this process, one pass at a
time, on a database no worker's relay touches)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import update

from questpie_celery import Questpie
from questpie_celery.cli import main
from questpie_celery.ledger import dispatch_table
from questpie_celery.relay import MAX_RELAY_SENDS
from tests import jobapp
from tests.services import free_port

SECRET = "r" * 40


@pytest.fixture
def queue_name() -> str:
    return f"relay-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def relaying(pg_unit_url: str, redis_url: str, queue_name: str) -> Iterator[Questpie]:
    app = jobapp.make_celery(redis_url, queue=queue_name)
    # A short visibility timeout lets the test redeliver after one second.
    app.conf.broker_transport_options = {"visibility_timeout": 1}
    questpie = Questpie(
        app, ledger_url=pg_unit_url, jobs=jobapp.JOBS, secret=SECRET, redeliver_after=1
    )
    questpie.migrate()
    yield questpie
    questpie.close()


def waiting(redis_url: str, queue: str, dispatch_id: str | None = None) -> int:
    """Messages waiting in `queue` (for `dispatch_id` only, when given)."""
    client = redis.Redis.from_url(redis_url)
    try:
        messages = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        client.close()
    return len([m for m in messages if dispatch_id in (None, m["headers"]["id"])])


def make_due(questpie: Questpie, dispatch_id: str, **values: object) -> None:
    with open_ledger(str(questpie_url(questpie))).engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(next_send_at=datetime.now(UTC) - timedelta(seconds=1), **values)
        )


def wait_queued(questpie: Questpie, dispatch_id: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = questpie.ledger.get(dispatch_id)
        if row is not None and row.status == "queued":
            return
        time.sleep(0.05)
    raise AssertionError("the broker's acceptance was not recorded")


def test_lost_message_is_sent_again_after_redeliver_after(
    relaying: Questpie, redis_url: str, queue_name: str
) -> None:
    dispatch_id = relaying.queue.record.publish({"tag": "lost"}, idempotency_key=uuid.uuid4().hex)
    assert dispatch_id is not None
    wait_queued(relaying, dispatch_id)
    redis.Redis.from_url(redis_url).delete(queue_name)  # the message is lost (purged)
    relaying.relay.run_once()
    assert (
        waiting(redis_url, queue_name, dispatch_id) == 0
    )  # not yet: a worker may still be on its way
    time.sleep(1.2)
    relaying.relay.run_once()
    assert waiting(redis_url, queue_name, dispatch_id) == 1
    row = relaying.ledger.get(dispatch_id)
    assert row is not None and row.send_count == 1
    relaying.relay.run_once()
    assert waiting(redis_url, queue_name, dispatch_id) == 1  # backed off


def test_pending_row_of_a_publisher_whose_broker_was_down_is_sent(
    relaying: Questpie, pg_unit_url: str, redis_url: str, queue_name: str
) -> None:
    _, offline = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_unit_url)
    dispatch_id = offline.queue.record.publish({"tag": "p"}, idempotency_key=uuid.uuid4().hex)
    offline.close()
    assert dispatch_id is not None
    row = relaying.ledger.get(dispatch_id)
    assert row is not None and row.status == "pending"
    make_due(relaying, dispatch_id, options={**row.options, "queue": queue_name})
    relaying.relay.run_once()
    assert waiting(redis_url, queue_name, dispatch_id) == 1
    wait_queued(relaying, dispatch_id)


def test_far_off_start_after_waits_in_the_ledger(
    relaying: Questpie, redis_url: str, queue_name: str
) -> None:
    start = datetime.now(UTC) + timedelta(hours=2)
    dispatch_id = relaying.queue.record.publish({"tag": "later"}, start_after=start)
    assert dispatch_id is not None
    row = relaying.ledger.get(dispatch_id)
    assert row is not None  # ledgered although unkeyed: no broker ETA two hours out
    assert row.status == "pending" and row.run_after == start
    assert row.next_send_at == start - timedelta(seconds=60)
    relaying.relay.run_once()
    assert waiting(redis_url, queue_name, dispatch_id) == 0
    # Shortly before it is due, the relay hands it to the broker.
    make_due(relaying, dispatch_id, run_after=datetime.now(UTC) + timedelta(seconds=30))
    relaying.relay.run_once()
    assert waiting(redis_url, queue_name, dispatch_id) == 1


def test_after_the_last_send_the_dispatch_fails_and_a_secret_is_erased(
    relaying: Questpie,
) -> None:
    plain = relaying.queue.record.publish({"tag": "x"}, idempotency_key=uuid.uuid4().hex)
    secret = relaying.queue.secret_link.publish(
        {"tag": "x", "link": "https://example.test/once"},
        idempotency_key=uuid.uuid4().hex,
        secret_payload=True,
    )
    assert plain is not None and secret is not None
    for dispatch_id in (plain, secret):
        wait_queued(relaying, dispatch_id)
        make_due(relaying, dispatch_id, send_count=MAX_RELAY_SENDS)
    relaying.relay.run_once()
    for dispatch_id in (plain, secret):
        row = relaying.ledger.get(dispatch_id)
        assert row is not None
        assert (row.status, row.last_error) == ("failed", "RelayGaveUp")
        assert row.secret_ciphertext is None and row.secret_wrapped_key is None
    receipt = relaying.queue.get_receipt(secret)
    assert receipt is not None and receipt.status == "failed"


def test_two_relays_send_a_due_row_once(
    relaying: Questpie, pg_unit_url: str, redis_url: str, queue_name: str
) -> None:
    dispatch_id = relaying.queue.record.publish({"tag": "two"}, idempotency_key=uuid.uuid4().hex)
    assert dispatch_id is not None
    wait_queued(relaying, dispatch_id)
    redis.Redis.from_url(redis_url).delete(queue_name)
    make_due(relaying, dispatch_id)
    _, other = jobapp.build(broker=redis_url, ledger=pg_unit_url, queue=queue_name)
    barrier = threading.Barrier(2)

    def one_pass(questpie: Questpie) -> None:
        barrier.wait()
        questpie.relay.run_once()

    threads = [threading.Thread(target=one_pass, args=(q,)) for q in (relaying, other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Other tests' due rows may be sent to this queue too: count this dispatch's messages.
    assert waiting(redis_url, queue_name, dispatch_id) == 1
    row = relaying.ledger.get(dispatch_id)
    assert row is not None and row.send_count == 1
    other.close()


def test_relay_command_makes_one_pass(relaying: Questpie, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobapp, "questpie", relaying)
    result = CliRunner().invoke(main, ["relay", "-A", "tests.jobapp:questpie", "--once"])
    assert result.exit_code == 0, result.output
    assert "moved" in result.output
