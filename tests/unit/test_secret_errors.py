"""What the errors of a secret publish or a secret run show: no plaintext in their
messages, causes, contexts or the frames of their tracebacks, whatever the handler, the
schema's validators or the database raised. A real SQLite ledger file, with Celery's
in-memory broker (no worker) or eager mode."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType

import pytest
from celery import Celery
from pydantic import BaseModel, field_validator
from sqlalchemy import create_engine, text

from questpie_celery import (
    JobContext,
    LedgerError,
    PayloadValidationError,
    Questpie,
    SecretJobError,
    job,
)

CANARY = "canary-4111-1111-1111-1111"
TEST_CARD = "4000-0000-0000-0002"
KNOWN_CARDS = {TEST_CARD: "test card"}


class Link(BaseModel):
    link: str


class Card(BaseModel):
    number: str

    @field_validator("number")
    @classmethod
    def known(cls, value: str) -> str:
        # A user's validator with a bug: KeyError(value) for an unknown card, its
        # message the input itself.
        KNOWN_CARDS[value]
        return value


@job(name="secret_errors.leaky", schema=Link, options={"retry_limit": 0})
def leaky(payload: Link, ctx: JobContext) -> None:
    raise RuntimeError(f"mail server rejected {payload.link}")


@job(name="secret_errors.card", schema=Card)
def charge(payload: Card, ctx: JobContext) -> None:
    pass


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[Questpie]:
    """A Questpie with a secret, on a SQLite file, publishing to memory:// (no worker)."""
    app = Celery("secret-errors-idle", broker="memory://")
    made = Questpie(
        app, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", jobs=[charge], secret="s" * 40
    )
    made.migrate()
    yield made
    made.close()


@pytest.fixture
def eager(tmp_path: Path) -> Iterator[Questpie]:
    """An eager Questpie with a secret whose handler errors propagate to the caller."""
    app = Celery("secret-errors-eager", broker="memory://")
    app.conf.update(task_always_eager=True, task_eager_propagates=True)
    made = Questpie(
        app, ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", jobs=[leaky], secret="s" * 40
    )
    made.migrate()
    yield made
    made.close()


def run_frames(tb: TracebackType | None) -> list[FrameType]:
    """The traceback's frames from Celery's task tracer down to the raise: what a worker's
    task_failure receivers and error trackers see (in eager mode the frames above are
    the publisher's, which holds its caller's own payload)."""
    frames: list[FrameType] = []
    while tb is not None:
        if frames or tb.tb_frame.f_code.co_filename.endswith("celery/app/trace.py"):
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def test_no_frame_of_a_failed_secret_run_holds_the_plaintext(eager: Questpie) -> None:
    """The SecretJobError Celery receives for a secret run carries no plaintext in
    its message, cause, context or the locals of its traceback's frames. Before the fix
    it was raised in fence.run, whose frame still held the decrypted payload (`model`)
    and the handler's own exception (`failure`), message and all."""
    questpie = eager
    with pytest.raises(SecretJobError) as raised:
        questpie.queue.secret_errors_leaky.publish(
            {"link": CANARY}, idempotency_key="frames", secret_payload=True
        )
    error = raised.value
    assert CANARY not in str(error)
    assert error.__cause__ is None
    assert error.__context__ is None or error.__suppress_context__
    frames = run_frames(error.__traceback__)
    files = [frame.f_code.co_filename for frame in frames]
    assert any(f.endswith("questpie_celery/worker/fence.py") for f in files), files
    leaks = [
        (frame.f_code.co_name, name)
        for frame in frames
        for name, value in frame.f_locals.items()
        if CANARY in repr(value) or CANARY in str(value)
    ]
    assert leaks == []


def test_validator_error_of_a_secret_publish_does_not_quote_the_payload(
    idle: Questpie,
) -> None:
    """A schema validator that raises something other than ValueError (here a KeyError
    whose message is the input) becomes a PayloadValidationError naming only its class.
    Before the fix the KeyError escaped publish(secret_payload=True) as it was, the card
    number in its message and in the frames of its traceback."""
    with pytest.raises(PayloadValidationError) as raised:
        idle.queue.secret_errors_card.publish(
            {"number": CANARY}, idempotency_key="v", secret_payload=True
        )
    logged = "".join(traceback.format_exception(raised.value))
    assert CANARY not in logged
    assert "KeyError" in str(raised.value)
    assert raised.value.__cause__ is None
    assert raised.value.__context__ is None


def test_a_failed_ledger_insert_names_no_statement_values(idle: Questpie, tmp_path: Path) -> None:
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
        idle.queue.secret_errors_card.publish({"number": TEST_CARD}, idempotency_key="k")
    logged = "".join(traceback.format_exception(raised.value))
    assert "integer overflow" in logged  # the driver's reason is there ...
    assert TEST_CARD not in logged  # ... and no statement value
