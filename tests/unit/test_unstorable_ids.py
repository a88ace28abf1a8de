"""An id no ledger row can have (a NUL, a lone surrogate, longer than the ledger stores,
empty, not a str) is answered by every operation that takes a dispatch id exactly as an
unknown id is: `UnknownDispatchError` or None, the same message, the same exit code on
the command line. It is decided before the database is asked, so no dialect's refusal
of such an id (PostgreSQL's `DataError` for a NUL; see the integration test of the same
name) can show through."""

from __future__ import annotations

import pytest

from questpie_celery.ledger import Ledger
from tests.support.unstorable import (
    COMMANDS,
    OPERATIONS,
    UNKNOWN,
    UNSTORABLE,
    UNSTORABLE_TEXT,
    answer,
    run_command,
)
from tests.unit.helpers import IdleApp


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("bad_id", list(UNSTORABLE.values()), ids=list(UNSTORABLE))
def test_an_id_no_row_can_have_is_answered_as_an_unknown_one_without_asking_the_database(
    idle: IdleApp, operation: str, bad_id: object
) -> None:
    unknown, looked_up = answer(idle.questpie, operation, UNKNOWN)
    assert looked_up  # an unknown id is asked about
    assert answer(idle.questpie, operation, bad_id) == (unknown, 0)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("bad_id", list(UNSTORABLE_TEXT.values()), ids=list(UNSTORABLE_TEXT))
def test_the_command_line_prints_for_an_id_no_row_can_have_what_it_prints_for_an_unknown_one(
    ledger: Ledger, command: str, bad_id: str
) -> None:
    url = ledger.engine.url.render_as_string(hide_password=False)
    unknown, looked_up = run_command(command, UNKNOWN, url)
    assert unknown.exit_code == 1 and looked_up
    assert run_command(command, bad_id, url) == (unknown.naming(UNKNOWN, bad_id), 0)
