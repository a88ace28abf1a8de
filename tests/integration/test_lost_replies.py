"""A committed statement whose reply is lost: a TCP proxy in front of PostgreSQL
(tests/support/faultproxy.py) lets the claim, the unpark or the insert commit and then
cuts the connection before its reply. Each still ends in one run. Stacks whose ledger
goes through the proxy keep their `test_runs` table in a database of their own, and the
test reads the ledger directly: only the worker's and the publisher's traffic meets it.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select

from questpie_celery.ledger import dispatch_table
from tests.integration.conftest import StackFactory
from tests.support.brokers import capture, deliver
from tests.support.faultproxy import FaultProxy
from tests.support.faults import (
    BROKERS,
    held_dispatch,
    wait_ended,
)
from tests.support.stack import tag
from tests.support.waiting import wait_until


@pytest.mark.parametrize("broker", BROKERS)
def test_a_claim_whose_reply_is_lost_still_runs_the_attempt(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """The claim commits, its reply is lost and the server refuses connections for a
    moment; the delivery's next try finds its own token and runs. Before the fix each
    try minted a new token, read the landed claim back as "busy", and the orphaned
    claim lapsed into a failed attempt that never ran."""
    stack = via_proxy(broker)
    t = tag()
    dispatch_id, message = held_dispatch(stack, t, retry_limit=0)
    proxy.arm(dispatch_id.encode(), refuse_for=1.5)
    deliver(stack, message)
    assert proxy.fired.wait(20), "the worker never sent its claim"
    assert b"UPDATE" in proxy.fired_data
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt, row.last_error) == ("completed", 1, None)
    assert [r["attempt"] for r in stack.runs(t)] == [1]


@pytest.mark.parametrize("broker", BROKERS)
def test_an_unpark_whose_reply_is_lost_still_sends_the_parked_run(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """The unpark (parked -> queued) commits and its reply is lost; the retried update
    matches nothing, the row is read back and the run is sent. Before the fix it was
    taken for another process's win: the row stayed `queued` with no message, for an
    hour, holding the stately slot's waiting place."""
    stack = via_proxy(broker)
    t = tag()
    gate = stack.gate()
    jobs = stack.questpie.queue["policy.stately"]
    first = jobs.publish({"tag": t, "gate": str(gate)})
    assert first is not None
    stack.wait_status(first, "active")
    second = jobs.publish({"tag": t})
    assert second is not None
    stack.wait_status(second, "parked")
    # The worker logs this after its last statement naming the parked row; the
    # publisher's acceptance mark is written too: only the unpark names it next.
    stack.wait_log(second, "parked: its")
    wait_until(lambda: stack.row(second).queued_at is not None, "the acceptance mark")
    proxy.arm(second.encode())
    gate.open()
    assert proxy.fired.wait(20), "nobody unparked the parked run"
    assert b"UPDATE" in proxy.fired_data
    stack.wait_status(first, "completed")
    row = stack.wait_status(second, "completed")
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [first, second]


@pytest.mark.parametrize("broker", BROKERS)
def test_a_publish_whose_insert_reply_is_lost_returns_its_id_and_sends(
    proxy: FaultProxy, via_proxy: StackFactory, broker: str
) -> None:
    """An unkeyed publish of a singleton job whose INSERT commits and loses its reply:
    the retried insert conflicts with its own row, and publish returns the row's id and
    sends it. Before the fix it returned None ("suppressed, nothing written")."""
    stack = via_proxy(broker, start_worker=False)
    proxy.arm(b"INSERT INTO questpie_queue_dispatch")
    dispatch_id = stack.questpie.queue["policy.singleton"].publish({"tag": tag()})
    assert proxy.fired.is_set(), "the publish sent no insert"
    with stack.ledger.engine.connect() as conn:
        written = conn.execute(select(dispatch_table.c.id)).scalars().all()
    assert written == [dispatch_id]
    assert capture(stack, stack.queue_name).headers["id"] == dispatch_id
