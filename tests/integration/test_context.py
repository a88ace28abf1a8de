"""`Questpie(context=...)` in a real `celery worker`: PostgreSQL ledger, Redis broker.

The worker runs tests/support/contextapp.py, whose factory opens a database connection
per run and records opening, using and closing it (see that module).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from questpie_celery import Questpie
from tests.integration.conftest import StackFactory
from tests.support import contextapp
from tests.support.brokers import capture, deliver
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


@pytest.fixture
def context_stack(make_stack: StackFactory) -> Iterator[tuple[Stack, Questpie]]:
    """A stack whose worker runs contextapp, and this process's Questpie of it."""
    stack = make_stack("redis", start_worker=False)
    contextapp.events_metadata.create_all(stack.runs_engine)
    _, questpie = contextapp.build(
        broker=stack.env["QP_TEST_BROKER"],
        ledger=stack.env["QP_TEST_LEDGER"],
        queue=stack.queue_name,
    )
    stack.start_worker(app="tests.support.contextapp:celery_app")
    yield stack, questpie
    questpie.close()


def events(stack: Stack) -> list[dict[str, Any]]:
    table = contextapp.events_table
    with stack.runs_engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(table).order_by(table.c.id)).mappings()]


def lifecycle(stack: Stack, services_id: str) -> list[tuple[str, str | None]]:
    """(event, outcome) of one run's services, in order."""
    return [(e["event"], e["outcome"]) for e in events(stack) if e["services_id"] == services_id]


def uses(stack: Stack, t: str) -> list[dict[str, Any]]:
    return [e for e in events(stack) if e["event"] == "use" and e["tag"] == t]


def wait_closed(stack: Stack, services_id: str, timeout: float = 20.0) -> None:
    wait_until(
        lambda: "close" in [event for event, _ in lifecycle(stack, services_id)],
        f"services {services_id} to close",
        timeout,
        0.05,
        explain=lambda: f"its events: {lifecycle(stack, services_id)}",
    )


def test_each_attempt_builds_uses_and_closes_its_own_services_in_the_worker(
    context_stack: tuple[Stack, Questpie],
) -> None:
    stack, questpie = context_stack
    t = tag()
    dispatch_id = questpie.queue.context_step.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"ctx:{t}"
    )
    assert dispatch_id is not None
    assert stack.wait_status(dispatch_id, "completed").attempt == 2
    first, second = uses(stack, t)
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["services_id"] != second["services_id"]  # one per run
    assert first["pid"] != os.getpid()  # built in the worker, not here
    wait_closed(stack, second["services_id"])
    # Opened before the handler used it, closed after, told how the handler ended.
    assert lifecycle(stack, first["services_id"]) == [
        ("open", None),
        ("use", None),
        ("close", "RuntimeError"),
    ]
    assert lifecycle(stack, second["services_id"]) == [
        ("open", None),
        ("use", None),
        ("close", None),
    ]
    assert {e["pid"] for e in events(stack) if e["services_id"] == first["services_id"]} == {
        first["pid"]
    }


def test_a_duplicate_delivery_in_the_worker_builds_nothing(
    context_stack: tuple[Stack, Questpie],
) -> None:
    stack, questpie = context_stack
    t = tag()
    idle = f"idle-{uuid.uuid4().hex[:8]}"  # no worker reads it: the message waits there
    gate = stack.gate()
    dispatch_id = questpie.queue.context_step.publish(
        {"tag": t, "gate": str(gate)}, idempotency_key=f"dup:{t}", queue=idle
    )
    assert dispatch_id is not None
    message = capture(stack, idle)
    # Two copies while the gate holds the first run: the second meets a live claim.
    deliver(stack, message, copies=2)
    stack.wait_status(dispatch_id, "active")
    stack.wait_log(dispatch_id, "skipped (busy)")
    gate.open()
    stack.wait_status(dispatch_id, "completed")
    [use] = uses(stack, t)
    wait_closed(stack, use["services_id"])
    opened = [e for e in events(stack) if e["event"] == "open"]
    assert [e["services_id"] for e in opened] == [use["services_id"]]  # built once
