"""Regression tests for the second review's findings that need no servers: what a
publisher or an eager run shows of a secret payload, and how a handler's SystemExit
leaves the run. A real SQLite ledger file and Celery's in-memory broker or eager mode."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from pydantic import BaseModel, field_validator
from sqlalchemy import create_engine, text

from questpie_celery import (
    JobContext,
    LedgerError,
    PayloadValidationError,
    Questpie,
    job,
)

CANARY = "canary-4111-1111-1111-1111"
TEST_CARD = "4000-0000-0000-0002"
KNOWN_CARDS = {TEST_CARD: "test card"}


class Card(BaseModel):
    number: str

    @field_validator("number")
    @classmethod
    def known(cls, value: str) -> str:
        # A user's validator with a bug: KeyError(value) for an unknown card, its
        # message the input itself.
        KNOWN_CARDS[value]
        return value


class Exit(BaseModel):
    code: int


@job(name="review2.card", schema=Card)
def charge(payload: Card, ctx: JobContext) -> None:
    pass


@job(name="review2.exit", schema=Exit, options={"retry_limit": 0})
def leave(payload: Exit, ctx: JobContext) -> None:
    raise SystemExit(payload.code)


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[Questpie]:
    """A Questpie with a secret, on a SQLite file, publishing to memory:// (no worker)."""
    app = Celery("review2-idle", broker="memory://")
    made = Questpie(
        app, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", jobs=[charge], secret="s" * 40
    )
    made.migrate()
    yield made
    made.close()


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[Questpie]:
    app = Celery("review2-eager", broker="memory://")
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    made = Questpie(app, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", jobs=[leave])
    made.migrate()
    yield made
    made.close()


def test_validator_error_of_a_secret_publish_does_not_quote_the_payload(
    idle: Questpie,
) -> None:
    """A schema validator that raises something other than ValueError (here a KeyError
    whose message is the input) becomes a PayloadValidationError naming only its class.
    Before the fix the KeyError escaped publish(secret_payload=True) as it was, the card
    number in its message and in the frames of its traceback."""
    with pytest.raises(PayloadValidationError) as raised:
        idle.queue.review2_card.publish(
            {"number": CANARY}, idempotency_key="v", secret_payload=True
        )
    logged = "".join(traceback.format_exception(raised.value))
    assert CANARY not in logged
    assert "KeyError" in str(raised.value)
    assert raised.value.__cause__ is None
    assert raised.value.__context__ is None


def test_g_a_failed_ledger_insert_names_no_statement_values(idle: Questpie, tmp_path: Path) -> None:
    """A publish whose insert fails for a reason other than a slot conflict raises a
    LedgerError chained to the driver's error. Before the fix that cause's text listed
    the statement's parameters, the payload among them, for every log that prints the
    traceback (on PostgreSQL a secret's ciphertext and wrapped key too: see the
    integration test). Now the ledger's engines hide them."""
    own = create_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")  # the fixture's file
    with own.begin() as conn:  # every insert now fails with an SQLite error
        conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON questpie_queue_dispatch "
                "BEGIN SELECT abs(-9223372036854775808); END"
            )
        )
    own.dispose()
    with pytest.raises(LedgerError) as raised:
        idle.queue.review2_card.publish({"number": TEST_CARD}, idempotency_key="k")
    logged = "".join(traceback.format_exception(raised.value))
    assert "integer overflow" in logged  # the driver's reason is there ...
    assert TEST_CARD not in logged  # ... and no statement value


def test_a_handler_s_system_exit_keeps_its_exit_code(eager: Questpie) -> None:
    """The fence records a handler's SystemExit as a failed attempt, then lets the
    process stop as asked, with the exit code the handler gave. Before the fix it raised
    a new SystemExit() without arguments: exit code 0, a clean exit."""
    with pytest.raises(SystemExit) as raised:
        eager.queue.review2_exit.publish({"code": 3}, idempotency_key="exit")
    assert raised.value.code == 3
