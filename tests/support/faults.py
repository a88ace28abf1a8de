"""What the fault tests share: a dispatch held back for the test to deliver, and waits
for the rows and log lines a fault leaves. (Stacks whose ledger traffic goes through a
fault proxy come from the `via_proxy` fixture, tests/integration/conftest.py.)"""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kombu.message import Message
from sqlalchemy import func, select

from questpie_celery.ledger import DispatchRow, dispatch_table
from questpie_celery.ledger.schema import TERMINAL
from tests.support.brokers import capture, idle_queue
from tests.support.services import PostgresServer, free_port
from tests.support.stack import Stack
from tests.support.waiting import wait_until

if TYPE_CHECKING:  # conftest imports this module: only the type is wanted from it
    from tests.integration.conftest import StackFactory

BROKERS = ["redis", "rabbitmq"]


#: A short lease and a fast relay: a claim orphaned by a bug lapses within the test.
SHORT_LEASE = {"QP_TEST_LEASE": "3", "QP_TEST_RELAY": "0.5"}


def held_dispatch(stack: Stack, t: str, **options: Any) -> tuple[str, Message]:
    """A keyed `record` dispatch published to a queue no worker reads, its acceptance
    mark written (nothing but its claim names the id any more), and its message taken
    out of the broker: the test delivers it when it wants."""
    idle = idle_queue()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t}, idempotency_key=t, queue=idle, **options
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "queued")
    return dispatch_id, capture(stack, idle)


def wait_ended(stack: Stack, dispatch_id: str, timeout: float = 40.0) -> DispatchRow:
    """The row once it is terminal (completed or failed), however it ended."""

    def ended() -> DispatchRow | None:
        row = stack.ledger.get(dispatch_id)
        return row if row is not None and row.status in TERMINAL else None

    return wait_until(ended, f"dispatch {dispatch_id} to end", timeout)


def lease_lapsed(stack: Stack, dispatch_id: str) -> bool:
    """Whether the row's lease has run out by the database's clock."""
    c = dispatch_table.c
    with stack.ledger.engine.connect() as conn:
        return bool(
            conn.execute(
                select(c.lease_expires_at < func.now()).where(c.id == dispatch_id)
            ).scalar_one()
        )


def renewal_failures(stack: Stack, dispatch_id: str) -> int:
    return sum("could not renew the claim" in line for line in stack.worker.log_about(dispatch_id))


def closed_broker(broker: str) -> str:
    """A broker URL nothing listens on."""
    port = free_port()
    if broker == "redis":
        return f"redis://127.0.0.1:{port}/0"
    return f"amqp://guest:guest@127.0.0.1:{port}//"


def logged(stack: Stack, dispatch_id: str, *texts: str) -> bool:
    """Whether a worker of the stack logged any of `texts` on a line naming the dispatch."""
    workers = [stack.worker, *stack.extra_workers]
    return any(t in line for w in workers for line in w.log_about(dispatch_id) for t in texts)


def wait_logged(stack: Stack, dispatch_id: str, *texts: str, timeout: float = 30.0) -> None:
    wait_until(lambda: logged(stack, dispatch_id, *texts), f"{texts} about {dispatch_id}", timeout)


#: A run's soft time limit (its expire_in_seconds) in B: longer than it takes to start
#: the run and open its gate, short enough for a quick test.
SOFT_LIMIT = 6


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def log_times(lines: list[str]) -> list[datetime]:
    """The timestamps of worker log lines (Celery's format: `[2026-01-02 03:04:05,678: ...`)."""
    found = [LOG_TIME.match(line) for line in lines]
    return [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for m in found if m]


#: Soft time limits shorter than the fence's patience. The fence tries the ledger again
#: after pauses of 0.2, 0.4, 0.8, 1.6, 3.2 s ...: its tries fall at about 0, 0.2, 0.6,
#: 1.4, 3.0 and 6.2 s. With 5 s it sends the delivery back at the 3.0 s try (the limit's
#: margin starts there); with 6 s the margin starts at 4 s, inside the pause that runs
#: from 3.0 to 6.2 s, and the limit falls during that pause.
SOFT_LIMITS = [5, 6]


def own_runs_stack(make_stack: StackFactory, postgres: PostgresServer, broker: str) -> Stack:
    """A stack whose test_runs table is in a database of its own (it stays writable)."""
    return make_stack(broker, env={"QP_TEST_RUNS": postgres.create_database("runs"), **SHORT_LEASE})
