"""A PostgreSQL database set read-only, as a standby or a primary being demoted refuses
writes: completions and plain calls wait for a writable ledger, and a secret publish
logs no key material.
"""

from __future__ import annotations

import traceback

import pytest
from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, Questpie, QuestpieError, job
from tests.integration.conftest import StackFactory
from tests.support.faults import (
    BROKERS,
    own_runs_stack,
    wait_ended,
    wait_logged,
)
from tests.support.services import PostgresServer
from tests.support.stack import tag


@pytest.mark.parametrize("broker", BROKERS)
def test_a_completion_that_meets_a_read_only_ledger_waits_for_it(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """The handler returned; the ledger turns read-only (SQLSTATE 25006) before
    `completed` is recorded. The write waits it out like an outage and lands once the
    database takes writes again. Before the fix 25006 was a plain LedgerError: it
    escaped, the claim lapsed, and the relay ran the handler again."""
    stack = own_runs_stack(make_stack, postgres, broker)
    ledger_url = stack.env["QP_TEST_LEDGER"]
    t = tag()
    gate = stack.gate()
    dispatch_id = stack.questpie.queue.record.publish(
        {"tag": t, "gate": str(gate), "gate_attempts": 1}, idempotency_key=t
    )
    assert dispatch_id is not None
    stack.wait_status(dispatch_id, "active")
    postgres.set_read_only(ledger_url, True)
    try:
        gate.open()
        assert len(stack.wait_ends(t, 1)) == 1
        wait_logged(stack, dispatch_id, "read-only", "raised unexpected")
    finally:
        postgres.set_read_only(ledger_url, False)
    row = wait_ended(stack, dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert len(stack.runs(t)) == 1
    assert len(stack.runs(t, "end")) == 1


@pytest.mark.parametrize("broker", BROKERS)
def test_a_plain_call_that_meets_a_read_only_ledger_waits_for_it(
    make_stack: StackFactory, postgres: PostgresServer, broker: str
) -> None:
    """A plain call of a singleton job is taken into a ledger that is read-only: the
    worker waits until it takes writes again, then runs the call. Before the fix the
    adoption's LedgerError failed the task with the message acknowledged: no row, no
    run."""
    stack = own_runs_stack(make_stack, postgres, broker)
    ledger_url = stack.env["QP_TEST_LEDGER"]
    t = tag()
    postgres.set_read_only(ledger_url, True)
    try:
        sent = stack.celery_app.tasks["policy.singleton"].delay({"tag": t})
        wait_logged(stack, sent.id, "read-only", "raised unexpected")
    finally:
        postgres.set_read_only(ledger_url, False)
    row = stack.wait_status(sent.id, "completed", timeout=40)
    assert row.attempt == 1
    assert [r["dispatch_id"] for r in stack.runs(t)] == [sent.id]


class Letter(BaseModel):
    text: str


@job(name="readonly.letter", schema=Letter)
def letter(payload: Letter, ctx: JobContext) -> None:
    pass


def test_a_secret_publish_onto_a_read_only_ledger_logs_no_key_material(
    pg_db: str, postgres: PostgresServer
) -> None:
    """A secret publish meets a read-only PostgreSQL: the error, logged with its causes,
    names no statement value. Before the fix the driver error it chained printed the
    statement's parameters: the ciphertext and the wrapped data key as bytes."""
    questpie = Questpie(
        Celery("readonly", broker="memory://"), ledger_url=pg_db, jobs=[letter], secret="x" * 40
    )
    questpie.migrate()
    postgres.set_read_only(pg_db, True)
    try:
        with pytest.raises(QuestpieError) as raised:
            questpie.queue.readonly_letter.publish(
                {"text": "top secret"}, idempotency_key="k", secret_payload=True
            )
        shown = "".join(traceback.format_exception(raised.value))
        assert "read-only" in shown  # the driver's reason is there, no statement value
        assert "secret_wrapped_key" not in shown or "parameters hidden" in shown
        assert "b'" not in shown
    finally:
        postgres.set_read_only(pg_db, False)
        questpie.close()
