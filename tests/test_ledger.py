"""The ledger's statements on both dialects, against real databases."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, inspect

from questpie_celery import LedgerSchemaError, metadata
from questpie_celery.ids import random_dispatch_id
from questpie_celery.ledger import SCHEMA_VERSION, Ledger, NewDispatch, create_ledger_engine


def _new(dispatch_id: str | None = None) -> NewDispatch:
    return NewDispatch(
        id=dispatch_id or random_dispatch_id(),
        job_name="record",
        idempotency_key="k",
        singleton_key=None,
        payload={"tag": "x"},
        options={"run": {"retry_limit": 2}},
        run_after=datetime.now(UTC),
    )


def test_insert_is_insert_or_nothing(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    assert ledger.insert_dispatch(new) is True
    assert ledger.insert_dispatch(new) is False
    row = ledger.get(new.id)
    assert row is not None
    assert (row.status, row.attempt, row.payload) == ("pending", 0, {"tag": "x"})
    assert row.created_at.tzinfo is not None


def test_mark_queued_records_broker_acceptance(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    ledger.insert_dispatch(new)
    ledger.mark_queued([(new.id, datetime.now(UTC))])
    row = ledger.get(new.id)
    assert row is not None
    assert row.status == "queued"
    assert row.queued_at is not None


def test_claim_fences_every_kind_of_duplicate(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    ledger.insert_dispatch(new)
    assert ledger.claim("missing", 1, 60).outcome == "unknown"
    first = ledger.claim(new.id, 1, 60)
    assert first.outcome == "claimed"
    assert first.row is not None and first.row.attempt == 1 and first.token
    # A second delivery of the same attempt meets a live claim.
    assert ledger.claim(new.id, 1, 60).outcome == "busy"
    # A delivery meant for an attempt the row has not reached is not claimable either.
    assert ledger.claim(new.id, 3, 60).outcome == "stale"
    assert ledger.complete(new.id, first.token) is True
    assert ledger.claim(new.id, 1, 60).outcome == "done"
    assert ledger.claim(new.id, 2, 60).outcome == "done"


def test_only_the_token_holder_records_outcomes(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    ledger.insert_dispatch(new)
    claim = ledger.claim(new.id, 1, 60)
    assert claim.token is not None
    assert ledger.complete(new.id, "not-the-token") is False
    assert ledger.fail(new.id, "not-the-token", "X") is False
    assert ledger.renew(new.id, "not-the-token", 60) is False
    assert ledger.renew(new.id, claim.token, 60) is True
    assert ledger.fail(new.id, claim.token, "RuntimeError") is True
    row = ledger.get(new.id)
    assert row is not None
    assert (row.status, row.last_error, row.claim_token) == ("failed", "RuntimeError", None)
    # A finished row can no longer be touched with the old token.
    assert ledger.complete(new.id, claim.token) is False


def test_retry_releases_the_claim_and_moves_the_attempt_on(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    ledger.insert_dispatch(new)
    first = ledger.claim(new.id, 1, 60)
    assert first.token is not None
    assert ledger.schedule_retry(new.id, first.token, 5, "RuntimeError", relay_at=None) is True
    row = ledger.get(new.id)
    assert row is not None
    assert (row.status, row.attempt, row.claim_token) == ("retry", 1, None)
    assert row.run_after > datetime.now(UTC)
    # The old delivery (attempt 1) is stale now; the retry's delivery claims attempt 2.
    assert ledger.claim(new.id, 1, 60).outcome == "stale"
    second = ledger.claim(new.id, 2, 60)
    assert second.outcome == "claimed"
    assert second.row is not None and second.row.attempt == 2
    # The first worker's token is dead.
    assert ledger.complete(new.id, first.token) is False


def test_lease_expiry_is_visible_in_the_row(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    new = _new()
    ledger.insert_dispatch(new)
    claim = ledger.claim(new.id, 1, 0.2)
    assert claim.row is not None and claim.row.lease_expires_at is not None
    time.sleep(0.3)
    row = ledger.get(new.id)
    assert row is not None and row.lease_expires_at is not None
    assert row.lease_expires_at < datetime.now(UTC)


def test_migrate_is_idempotent_and_matches_metadata(ledger_engine: Engine) -> None:
    ledger = Ledger(ledger_engine)
    assert ledger.migrate() == SCHEMA_VERSION
    assert ledger.migrate() == SCHEMA_VERSION
    assert ledger.schema_version() == SCHEMA_VERSION
    tables = set(inspect(ledger_engine).get_table_names())
    assert set(metadata.tables) <= tables


def test_missing_tables_give_a_schema_error(tmp_path: pytest.TempPathFactory) -> None:
    engine = create_ledger_engine(f"sqlite:///{tmp_path}/empty.sqlite3")
    with pytest.raises(LedgerSchemaError, match="migrate"):
        Ledger(engine).insert_dispatch(_new())
    engine.dispose()
