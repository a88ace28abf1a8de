"""Databases and brokers that are down: clear errors, nothing lost, nothing hangs."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from questpie_celery import BrokerError, LedgerUnavailableError, QuestpieError
from tests import jobapp
from tests.services import free_port


def test_unreachable_ledger_raises_and_sends_nothing(redis_url: str) -> None:
    queue = "ledger-down"
    _, questpie = jobapp.build(
        broker=redis_url,
        ledger=f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none",
        queue=queue,
    )
    started = time.monotonic()
    with pytest.raises(LedgerUnavailableError) as caught:
        questpie.queue.record.publish({"tag": "x"}, idempotency_key="k")
    assert isinstance(caught.value, QuestpieError)
    assert time.monotonic() - started < 15
    assert redis.Redis.from_url(redis_url).llen(queue) == 0
    questpie.close()


def test_unreachable_broker_leaves_a_pending_row_and_returns_fast(
    pg_unit_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _, questpie = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_unit_url)
    questpie.migrate()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="questpie_celery"):
        dispatch_id = questpie.queue.record.publish({"tag": "x"}, idempotency_key="broker-down")
    elapsed = time.monotonic() - started
    assert dispatch_id is not None
    assert elapsed < 10, f"publish took {elapsed:.1f}s"
    row = questpie.ledger.get(dispatch_id)
    assert row is not None
    assert (row.status, row.queued_at) == ("pending", None)
    warnings = [r for r in caplog.records if r.name.startswith("questpie_celery")]
    assert len(warnings) == 1
    assert "pending" in warnings[0].getMessage()
    # Publishing the key again answers from the ledger without touching the broker.
    again_started = time.monotonic()
    assert questpie.queue.record.publish({"tag": "x"}, idempotency_key="broker-down") == dispatch_id
    assert time.monotonic() - again_started < 2
    questpie.close()


def test_unreachable_broker_unledgered_publish_raises(pg_unit_url: str) -> None:
    _, questpie = jobapp.build(broker=f"redis://127.0.0.1:{free_port()}/0", ledger=pg_unit_url)
    started = time.monotonic()
    with pytest.raises(BrokerError):
        questpie.queue.record.publish({"tag": "x"})
    assert time.monotonic() - started < 10
    questpie.close()
