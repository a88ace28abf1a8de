"""`priority` runs higher first on Redis and on RabbitMQ."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select

from tests import jobapp
from tests.services import Worker, rabbitmq_server

PRIORITIES = [2, 7, 0, 9, 5, 3, 8, 1]


@pytest.fixture(scope="module")
def amqp_url() -> Iterator[str]:
    with rabbitmq_server() as url:
        yield url


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_higher_priority_runs_first(
    broker: str, request: pytest.FixtureRequest, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker_url = request.getfixturevalue("redis_url" if broker == "redis" else "amqp_url")
    queue = f"prio-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("QP_TEST_PRIORITY_QUEUE", queue)
    _, questpie = jobapp.build(broker=broker_url, ledger=pg_url)
    questpie.migrate()
    engine = questpie.engine
    jobapp.runs_metadata.create_all(engine)
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    # Every message waits in the queue before a worker with one slot starts.
    for n, priority in enumerate(PRIORITIES):
        key = f"{prefix}:{n}" if n % 2 else None  # keyed and unkeyed alike
        questpie.queue.record.publish(
            {"tag": f"{prefix}:{priority}"}, priority=priority, queue=queue, idempotency_key=key
        )
    worker = Worker(
        {"QP_TEST_BROKER": broker_url, "QP_TEST_LEDGER": pg_url, "QP_TEST_PRIORITY_QUEUE": queue},
        concurrency=1,
        queues=queue,
    ).start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                tags = (
                    conn.execute(
                        select(jobapp.runs_table.c.tag)
                        .where(jobapp.runs_table.c.tag.like(f"{prefix}:%"))
                        .order_by(jobapp.runs_table.c.id)
                    )
                    .scalars()
                    .all()
                )
            if len(tags) == len(PRIORITIES):
                break
            time.sleep(0.2)
    finally:
        worker.stop()
        questpie.close()
    assert [int(t.rsplit(":", 1)[1]) for t in tags] == sorted(PRIORITIES, reverse=True)
