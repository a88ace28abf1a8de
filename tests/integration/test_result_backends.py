"""A Celery result backend that refuses (Redis with `maxmemory 1`) or stalls (SIGSTOP)
while the worker stores STARTED: the claim is neither orphaned nor lapsed.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis

from tests.integration.conftest import StackFactory
from tests.support.brokers import deliver
from tests.support.faults import (
    BROKERS,
    SHORT_LEASE,
    held_dispatch,
    wait_ended,
)
from tests.support.services import RedisServer
from tests.support.stack import tag
from tests.support.waiting import wait_until


@pytest.fixture
def refusing_backend() -> Iterator[RedisServer]:
    """A Redis result backend that refuses every write."""
    server = RedisServer().start()
    client = redis.Redis(port=server.port)
    client.config_set("maxmemory", 1)
    client.close()
    yield server
    server.close()


@pytest.mark.parametrize("broker", BROKERS)
def test_a_backend_refusing_started_does_not_orphan_the_claim(
    refusing_backend: RedisServer, make_stack: StackFactory, broker: str
) -> None:
    """With task_track_started, storing STARTED fails: the run goes on and completes.
    Before the fix the error escaped with the claim taken and nobody renewing it: the
    lease lapsed into a failed attempt that never ran."""
    stack = make_stack(
        broker,
        env={"QP_TEST_BACKEND": refusing_backend.url(1), "QP_TEST_EXTENDED": "1", **SHORT_LEASE},
    )
    t = tag()
    dispatch_id = stack.questpie.queue.record.publish({"tag": t}, idempotency_key=t, retry_limit=0)
    assert dispatch_id is not None
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t, "end")) == 1
    stack.wait_log(dispatch_id, "could not store its STARTED state")


@pytest.fixture
def stalling_backend() -> Iterator[RedisServer]:
    """A Redis result backend of its own, for a test to pause."""
    server = RedisServer().start()
    yield server
    server.close()


@pytest.mark.parametrize("broker", BROKERS)
def test_a_result_backend_stalling_at_started_does_not_lapse_the_claim(
    stalling_backend: RedisServer, make_stack: StackFactory, broker: str
) -> None:
    """With task_track_started, the result backend stalls while the fence stores STARTED,
    for longer than the lease: the claim is renewed all the while (STARTED is stored
    inside the lease hold), and the run goes on once the backend answers. Before the fix
    STARTED was stored before the renewer held the claim: the lease lapsed, the relay
    retried it, and the stalled run went on too: two completions."""
    lease = float(SHORT_LEASE["QP_TEST_LEASE"])
    stack = make_stack(
        broker,
        env={"QP_TEST_BACKEND": stalling_backend.url(1), "QP_TEST_EXTENDED": "1", **SHORT_LEASE},
    )
    t = tag()
    # Published (which subscribes to the result on this backend) before it stalls.
    dispatch_id, message = held_dispatch(stack, t)
    stalling_backend.pause()
    try:
        deliver(stack, message)
        first = stack.wait_status(dispatch_id, "active")
        assert first.started_at is not None

        def renewed_through_two_leases_or_ended() -> bool:
            row = stack.row(dispatch_id)
            if (row.status, row.claim_token) != ("active", first.claim_token):
                return True
            assert row.lease_expires_at is not None
            assert first.started_at is not None
            return row.lease_expires_at - first.started_at > timedelta(seconds=3 * lease)

        wait_until(renewed_through_two_leases_or_ended, "the claim to outlive two leases")
        row = stack.row(dispatch_id)
        assert (row.status, row.attempt, row.claim_token) == ("active", 1, first.claim_token)
        assert stack.runs(t) == []  # still storing STARTED: the handler has not begun
    finally:
        stalling_backend.resume()
    row = stack.wait_status(dispatch_id, "completed")
    assert row.attempt == 1
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1
