"""On PostgreSQL, whose text cannot hold a NUL (a statement naming one fails with a
`DataError`) and whose driver cannot send a lone surrogate: an id no ledger row can have
is answered by every operation that takes a dispatch id, blocking and awaited (on the
asyncio driver), and by the command line, exactly as an unknown id is, never with a
`LedgerError`: it is decided before any statement names it. The fast lane holds the same
on SQLite (tests/unit/test_unstorable_ids.py), the Django admin's test its page.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from questpie_celery import Questpie
from tests.support import jobapp
from tests.support.services import PostgresServer
from tests.support.stack import tag
from tests.support.unstorable import (
    COMMANDS,
    OPERATIONS,
    UNKNOWN,
    UNSTORABLE,
    UNSTORABLE_TEXT,
    answer,
    run_command,
)


@pytest.fixture(scope="module")
def pg_url(postgres: PostgresServer) -> str:
    return postgres.create_database("unstorable")


@pytest.fixture(scope="module")
def questpie(pg_url: str) -> Iterator[Questpie]:
    """A Questpie on a migrated PostgreSQL ledger; its broker's queue nobody reads."""
    _, made = jobapp.build(broker="memory://", ledger=pg_url, queue=f"idle-{tag()}")
    made.migrate()
    yield made
    made.close()


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("bad_id", list(UNSTORABLE.values()), ids=list(UNSTORABLE))
def test_an_id_no_row_can_have_is_answered_as_an_unknown_one_on_postgresql(
    questpie: Questpie, operation: str, bad_id: object
) -> None:
    unknown, looked_up = answer(questpie, operation, UNKNOWN)
    assert looked_up  # an unknown id is asked about
    assert answer(questpie, operation, bad_id) == (unknown, 0)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("bad_id", list(UNSTORABLE_TEXT.values()), ids=list(UNSTORABLE_TEXT))
def test_the_command_line_answers_an_id_no_row_can_have_as_an_unknown_one_on_postgresql(
    questpie: Questpie, pg_url: str, command: str, bad_id: str
) -> None:
    unknown, looked_up = run_command(command, UNKNOWN, pg_url)
    assert unknown.exit_code == 1 and looked_up
    assert run_command(command, bad_id, pg_url) == (unknown.naming(UNKNOWN, bad_id), 0)
