"""`priority` runs higher first on Redis and on RabbitMQ."""

from __future__ import annotations

import uuid

import pytest

from tests.integration.conftest import StackFactory

PRIORITIES = [2, 7, 0, 9, 5, 3, 8, 1]


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_higher_priority_runs_first(broker: str, make_stack: StackFactory) -> None:
    queue = f"prio-{uuid.uuid4().hex[:8]}"
    # RabbitMQ needs x-max-priority declared on the queue; questpie never declares it.
    stack = make_stack(broker, env={"QP_TEST_PRIORITY_QUEUE": queue}, start_worker=False)
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    # Every message waits in the queue before a worker with one slot starts.
    ids = []
    for n, priority in enumerate(PRIORITIES):
        key = f"{prefix}:{n}" if n % 2 else None  # keyed and unkeyed alike
        ids.append(
            stack.questpie.queue.record.publish(
                {"tag": prefix}, priority=priority, queue=queue, idempotency_key=key
            )
        )
    stack.start_worker(concurrency=1, queues=queue)
    ends = stack.wait_ends(prefix, len(PRIORITIES), timeout=60)
    by_id = dict(zip(ids, PRIORITIES, strict=True))
    assert [by_id[r["dispatch_id"]] for r in ends] == sorted(PRIORITIES, reverse=True)
