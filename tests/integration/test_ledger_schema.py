"""The ledger's schema: migrate, identities, schema errors, what pruning records, and
dispatch ids of any shape, through a migration that widened them, on both dialects."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, delete, insert, inspect, text

from questpie_celery import LedgerSchemaError, LedgerUnavailableError, metadata
from questpie_celery.jobs.ids import MAX_DISPATCH_ID_BYTES, random_dispatch_id, unstorable_id
from questpie_celery.ledger import SCHEMA_VERSION, Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.aio import AsyncLedger
from questpie_celery.ledger.schema import schema_version_table
from questpie_celery.ledger.statements import db_time
from tests.support.ledgers import JOB, new_row, row_of


def test_migrate_is_idempotent_and_matches_metadata(ledger: Ledger) -> None:
    first_id = ledger.migration.ledger_id()
    assert ledger.migration.migrate() == SCHEMA_VERSION
    assert ledger.migration.migrate() == SCHEMA_VERSION
    assert ledger.schema_version() == SCHEMA_VERSION
    tables = set(inspect(ledger.engine).get_table_names())
    assert set(metadata.tables) <= tables
    # One identity for the database, whoever asks, however often it is migrated.
    again = Ledger(ledger.engine)
    assert again.migration.ledger_id() == first_id
    fresh = open_ledger(ledger.engine.url.render_as_string(hide_password=False))
    try:
        assert fresh.migration.migrate() == SCHEMA_VERSION
        assert fresh.migration.ledger_id() == first_id
    finally:
        fresh.close()
    with ledger.engine.connect() as conn:
        assert ledger.migration.ledger_id(conn) == first_id


def empty_database(request: pytest.FixtureRequest, tmp_path: Path, dialect: str) -> str:
    """The URL of a fresh database of the test's own, with no tables, on `dialect`."""
    if dialect == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    url: str = request.getfixturevalue("pg_db")
    return url


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_missing_tables_give_a_schema_error(
    request: pytest.FixtureRequest, tmp_path: Path, dialect: str
) -> None:
    ledger = open_ledger(empty_database(request, tmp_path, dialect))
    try:
        with pytest.raises(LedgerSchemaError, match="migrate"):
            ledger.dispatches.insert(new_row())
        with pytest.raises(LedgerSchemaError):
            ledger.migration.ledger_id()
    finally:
        ledger.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_missing_column_gives_a_schema_error(
    request: pytest.FixtureRequest, tmp_path: Path, dialect: str
) -> None:
    """A schema older than the package (`migrate` not run since the upgrade) reads as one
    to migrate, which the fence and the publisher wait out or report, not as a failure."""
    ledger = open_ledger(empty_database(request, tmp_path, dialect))
    try:
        ledger.migration.migrate()
        with ledger.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {dispatch_table.name} DROP COLUMN started_at")
        with pytest.raises(LedgerSchemaError, match="run `questpie-celery migrate`"):
            ledger.get(random_dispatch_id())
    finally:
        ledger.close()


def test_two_ledgers_have_different_identities(ledger: Ledger, tmp_path: Path) -> None:
    other = open_ledger(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    try:
        other.migration.migrate()
        assert other.migration.ledger_id() != ledger.migration.ledger_id()
    finally:
        other.close()


def test_pruning_records_how_far_back_rows_may_be_gone_and_never_moves_it_back(
    ledger: Ledger,
) -> None:
    assert ledger.retention.pruned_before() is None  # nothing was ever pruned
    before = ledger.now()
    ledger.retention.prune_schedule_history(
        key_prefix="questpie-schedule:", older_than=3600, limit=10
    )
    after = ledger.now()
    first = ledger.retention.pruned_before()
    assert first is not None
    # An hour before the prune, by the database's clock.
    hour = timedelta(hours=1)
    assert before - hour <= first <= after - hour, (before, first, after)
    ledger.retention.prune_ended(keyed=False, older_than=7 * 86400, limit=10, spare_key_prefix="x")
    assert ledger.retention.pruned_before() == first  # an older cutoff does not move it back
    ledger.retention.prune_ended(keyed=True, older_than=60, limit=10, spare_key_prefix="x")
    later = ledger.retention.pruned_before()
    assert later is not None and later > first


# --- dispatch ids of any shape (a plain Celery call keeps its own task id) ----------------


#: Task ids Celery accepts and the ledger stores: long, unicode, punctuation, whitespace.
ODD_IDS = [
    "x" * 37,
    "é" * (MAX_DISPATCH_ID_BYTES // 2),  # two bytes each: the longest that fits
    "order 42 / retry #3 \t(ünïcödé) 🚀 'quoted' \"too\" ; DROP TABLE x; --",
    " \n ",
    "%_\\",  # what LIKE would take for patterns
]


@pytest.mark.parametrize("odd", ODD_IDS, ids=range(len(ODD_IDS)))
def test_a_dispatch_id_of_any_storable_shape_is_a_row_like_any_other(
    ledger: Ledger, odd: str
) -> None:
    assert unstorable_id(odd) is None
    new = new_row(odd, idempotency_key=None)
    assert ledger.dispatches.insert(new) is True
    assert ledger.dispatches.insert(new) is False
    assert ledger.dispatches.exists(odd) and ledger.dispatches.existing([odd, "other"]) == {odd}
    claim = ledger.claims.claim(odd, JOB, 1, 60)
    assert claim.outcome == "claimed" and claim.token is not None
    assert ledger.claims.claim(odd, JOB, 1, 60).outcome == "busy"
    assert ledger.claims.finish(odd, claim.token, "completed", None)
    assert row_of(ledger, odd).status == "completed"
    assert ledger.claims.claim(odd, JOB, 1, 60).outcome == "done"


def test_ids_the_ledger_cannot_store_are_named_with_the_reason() -> None:
    assert unstorable_id("a\0b") is not None and "NUL" in (unstorable_id("a\0b") or "")
    assert "surrogate" in (unstorable_id("a\udc80") or "")
    assert "bytes" in (unstorable_id("x" * (MAX_DISPATCH_ID_BYTES + 1)) or "")
    assert unstorable_id("") is not None and unstorable_id(None) is not None
    assert unstorable_id("x" * MAX_DISPATCH_ID_BYTES) is None


def test_migrating_a_version_4_ledger_widens_its_dispatch_ids(ledger: Ledger) -> None:
    """A ledger made before version 5 held ids of at most 36 characters."""
    kept = new_row()
    assert ledger.dispatches.insert(kept)
    before = _make_version_4(ledger)
    assert ledger.migration.migrate() == SCHEMA_VERSION
    assert ledger.migration.migrate() == SCHEMA_VERSION
    if ledger.dialect == "postgresql":
        inspector = inspect(ledger.engine)
        for table, name in (
            ("questpie_queue_dispatch", "id"),
            ("questpie_schedule", "last_dispatch_id"),
        ):
            column = next(c for c in inspector.get_columns(table) if c["name"] == name)
            assert getattr(column["type"], "length", 0) is None, (table, name)
        # A change to the catalog only: neither the table nor its indexes were rewritten.
        assert _storage(ledger) == before
    long_id = "plain-call-" + "x" * 200
    assert ledger.dispatches.insert(new_row(long_id, idempotency_key=None))
    assert ledger.claims.claim(long_id, JOB, 1, 60).outcome == "claimed"
    assert row_of(ledger, kept.id).payload == kept.payload  # the old row came through


def _storage(ledger: Ledger) -> dict[str, int]:
    """The files of the dispatch table and its indexes (PostgreSQL): a rewrite changes them."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT c.relname, c.relfilenode FROM pg_class c WHERE c.oid = "
                "'questpie_queue_dispatch'::regclass OR c.oid IN (SELECT indexrelid FROM "
                "pg_index WHERE indrelid = 'questpie_queue_dispatch'::regclass)"
            )
        ).all()
    return {name: int(node) for name, node in rows}


def _make_version_4(ledger: Ledger) -> dict[str, int]:
    """Turn a migrated ledger back into what version 4 created: ids of `VARCHAR(36)`.
    Returns the table's storage (PostgreSQL), to compare with after the migration."""
    with ledger.engine.begin() as conn:
        conn.execute(delete(schema_version_table).where(schema_version_table.c.version >= 5))
        conn.execute(insert(schema_version_table).values(version=4, applied_at=db_time()))
        if ledger.dialect == "postgresql":
            for table, name in (
                ("questpie_queue_dispatch", "id"),
                ("questpie_schedule", "last_dispatch_id"),
            ):
                conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN {name} TYPE varchar(36)"))
    # A longer id waits for the migration (a schema error, which the fence waits out)
    # rather than meeting the old width (PostgreSQL would refuse it).
    with pytest.raises(LedgerSchemaError, match="run `questpie-celery migrate`"):
        ledger.dispatches.insert(new_row("y" * 37, idempotency_key=None))
    return _storage(ledger) if ledger.dialect == "postgresql" else {}


def test_a_process_running_across_the_migration_goes_on(
    pg_ledger: Ledger, pg_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that ran the ledger's statements on version 4's tables has them prepared
    on its connections (psycopg prepares a statement after its fifth run); once another
    process migrated to version 5, PostgreSQL refuses to run them ("cached plan must not
    change result type": the ids' type changed). Each of them, sync and asyncio, then
    runs again on a fresh connection instead of failing for as long as the process lives
    (a worker's claim with a LedgerError, which Celery acknowledges unrun). An engine of
    one's own keeps its connections: there the error is a LedgerUnavailableError (a worker
    sends its delivery back rather than acknowledging it unrun) saying what to do."""
    _make_version_4(pg_ledger)
    pg_ledger.engine.dispose()  # connections opened on version 4's tables from here on
    theirs = Ledger(create_engine(pg_db))
    aledger = AsyncLedger(pg_ledger)
    loop = asyncio.new_event_loop()
    kept = new_row(idempotency_key=None)
    assert pg_ledger.dispatches.insert(kept)

    def hot_path(*, ours_only: bool = False) -> None:
        assert pg_ledger.dispatches.insert(new_row(idempotency_key=None))
        assert row_of(pg_ledger, kept.id).id == kept.id
        assert pg_ledger.claims.claim(random_dispatch_id(), JOB, 1, 60).outcome == "unknown"
        pg_ledger.relay.take_due(
            10, max_sends=5, first_backoff=1, max_backoff=5, accepted_backoff=5
        )
        assert loop.run_until_complete(aledger.insert(new_row(idempotency_key=None)))
        assert loop.run_until_complete(aledger.get(kept.id)) is not None
        if not ours_only:
            assert theirs.get(kept.id) is not None

    try:
        for _ in range(8):
            hot_path()
        other = open_ledger(pg_db)
        try:
            assert other.migration.migrate() == SCHEMA_VERSION
        finally:
            other.close()
        with pytest.raises(LedgerUnavailableError, match="prepare_threshold"):
            theirs.get(kept.id)
        with caplog.at_level(logging.INFO, logger="questpie_celery.ledger.store"):
            hot_path(ours_only=True)
        assert any("outlived a migration" in r.getMessage() for r in caplog.records), (
            "no statement met its stale plan"
        )
        fresh = new_row("plain-call-" + "x" * 40, idempotency_key=None)
        assert pg_ledger.dispatches.insert(fresh)
        assert pg_ledger.claims.claim(fresh.id, JOB, 1, 60).outcome == "claimed"
    finally:
        loop.run_until_complete(aledger.close())
        loop.close()
        theirs.close()
