"""The operator's view of chords and batches: `questpie.operator.canvases()` and
`.canvas(id)`, `questpie-celery canvases list/show`, a member's `dispatches show`, and
the status page's section, on SQLite and PostgreSQL ledgers written directly (no broker,
no worker): what an operator sees, and that a callback's signature or a result never
shows."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import text, update

from questpie_celery import PublishOptionsError
from questpie_celery.canvas.results import encode
from questpie_celery.cli.commands import main
from questpie_celery.jobs.ids import random_dispatch_id
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import Ledger, NewDispatch, dispatch_table, open_ledger
from questpie_celery.ledger.canvases import NewCanvas
from questpie_celery.ledger.schema import CanvasKind, canvas_table
from questpie_celery.ops.operations import Operator
from questpie_celery.ops.receipts import CanvasStatus
from questpie_celery.web import overview_json, render, status_app

#: Planted in callbacks, errbacks and results: never in anything an operator sees.
CANARY = f"canary-{uuid.uuid4().hex}"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    return str(request.getfixturevalue("pg_db"))


@pytest.fixture
def ledger(url: str) -> Iterator[Ledger]:
    """A migrated, empty ledger of this test's own."""
    made = open_ledger(url)
    made.migration.migrate()
    yield made
    made.close()


@pytest.fixture
def operator(ledger: Ledger) -> Operator:
    return Operator(ledger)


def member(ledger: Ledger, canvas_id: str, status: str = "pending", **values: Any) -> str:
    """A member's dispatch row naming the canvas, moved to `status` behind the ledger's
    back (as a worker's outcome would leave it)."""
    new = NewDispatch(
        id=random_dispatch_id(),
        job_name="record",
        payload={"tag": "member"},
        options=StoredOptions(),
        canvas_id=canvas_id,
    )
    assert ledger.dispatches.insert(new)
    if status != "pending" or values:
        set_row(ledger, new.id, status=status, **values)
    return new.id


def set_row(ledger: Ledger, dispatch_id: str, **values: Any) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table).where(dispatch_table.c.id == dispatch_id).values(**values)
        )


def canvas(
    ledger: Ledger,
    kind: CanvasKind,
    members: list[str | None],
    *,
    canvas_id: str | None = None,
    callback_id: str | None = None,
    **fields: Any,
) -> str:
    """A canvas row over `members`, whose callback and errback hold the canary."""
    made = canvas_id or random_dispatch_id()
    secret_args = encode({"task": "tasks.tsum", "args": [CANARY]}, "json")
    assert secret_args is not None
    new = NewCanvas(
        id=made,
        kind=kind,
        members=members,
        callback=secret_args,
        errbacks=[secret_args] if kind == "chord" else None,
        callback_id=callback_id or random_dispatch_id(),
        **fields,
    )
    with ledger.canvases.session() as session, session.begin():
        ledger.canvases.record(new, session.connection())
    return made


def chord_with_a_failed_member(ledger: Ledger) -> tuple[str, list[str | None]]:
    """A chord the second member failed: one completed (with a result), one failed, one
    still running, one a queue policy refused."""
    chord_id = random_dispatch_id()
    done = member(
        ledger, chord_id, "completed", result=encode({"total": CANARY}, "json"),
        finished_at=datetime.now(UTC),
    )  # fmt: skip
    failed = member(ledger, chord_id, "failed", last_error="ValueError")
    running = member(ledger, chord_id, "active")
    members = [done, failed, running, None]
    canvas(ledger, "chord", members, canvas_id=chord_id)
    with ledger.canvases.closing(chord_id, "failed", failed_member=failed) as conn:
        assert conn is not None
    return chord_id, members


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--ledger-url", url])


# --- Python: Operator.canvas, .canvases, .canvas_members ---------------------------------


def test_a_chord_shows_its_members_by_status_and_the_member_that_failed_it(
    ledger: Ledger, operator: Operator
) -> None:
    chord_id, members = chord_with_a_failed_member(ledger)
    shown = operator.canvas(chord_id)
    assert shown is not None
    assert (shown.canvas_id, shown.kind, shown.status, shown.on_member_failure) == (
        chord_id, "chord", "failed", "fail",
    )  # fmt: skip
    assert shown.members == 4
    assert shown.counts == {"completed": 1, "failed": 1, "active": 1, "refused": 1}
    assert shown.failed_member == members[1]
    assert shown.finished_at is not None
    # A failed chord's body never ran: its dispatch has no row.
    assert shown.callback_id is not None and shown.callback_status is None
    # The same counts `get_status` answers for the chord.
    status = CanvasStatus.of(ledger.canvases, chord_id)
    assert status is not None and status.counts == shown.counts


def test_a_completed_chord_names_its_callbacks_dispatch_and_its_status(
    ledger: Ledger, operator: Operator
) -> None:
    chord_id = random_dispatch_id()
    members: list[str | None] = [member(ledger, chord_id, "completed") for _ in range(3)]
    callback_id = random_dispatch_id()
    canvas(ledger, "chord", members, canvas_id=chord_id, callback_id=callback_id)
    with ledger.canvases.closing(chord_id, "completed") as conn:
        assert conn is not None
        body = NewDispatch(
            id=callback_id, job_name="tsum", payload={"tag": "body"}, options=StoredOptions()
        )
        assert ledger.dispatches.insert(body, conn)
    shown = operator.canvas(chord_id)
    assert shown is not None
    assert (shown.status, shown.counts) == ("completed", {"completed": 3})
    assert (shown.callback_id, shown.callback_status) == (callback_id, "pending")
    # The callback's id finds its chord too, as `get_status` does.
    by_callback = operator.canvas(callback_id)
    assert by_callback is not None and by_callback.canvas_id == chord_id


def test_a_member_retention_removed_and_a_member_twice_count_as_get_status_counts(
    ledger: Ledger, operator: Operator
) -> None:
    batch_id = random_dispatch_id()
    twice = member(ledger, batch_id, "completed")
    gone = random_dispatch_id()  # its row was deleted by retention
    members: list[str | None] = [twice, twice, gone, member(ledger, batch_id)]
    canvas(ledger, "batch", members, canvas_id=batch_id)
    shown = operator.canvas(batch_id)
    assert shown is not None
    assert shown.counts == {"completed": 2, "removed": 1, "pending": 1}
    status = CanvasStatus.of(ledger.canvases, batch_id)
    assert status is not None and status.counts == shown.counts
    listed = operator.canvas_members(batch_id)
    assert listed is not None
    assert [(m.position, m.dispatch_id, m.status) for m in listed] == [
        (0, twice, "completed"), (1, twice, "completed"), (2, gone, "removed"),
        (3, members[3], "pending"),
    ]  # fmt: skip


def test_the_list_is_newest_first_and_filters_by_status_and_kind(
    ledger: Ledger, operator: Operator
) -> None:
    chord_id, _ = chord_with_a_failed_member(ledger)
    batch_id = random_dispatch_id()
    canvas(ledger, "batch", [member(ledger, batch_id, "queued")], canvas_id=batch_id)
    older = canvas(ledger, "chord", [])
    # Times a second apart, oldest first: older, the failed chord, the batch.
    now = datetime.now(UTC)
    with ledger.engine.begin() as conn:
        for age, made in ((3, older), (2, chord_id), (1, batch_id)):
            conn.execute(
                update(canvas_table)
                .where(canvas_table.c.id == made)
                .values(created_at=now - timedelta(seconds=age))
            )
    assert [c.canvas_id for c in operator.canvases()] == [batch_id, chord_id, older]
    assert [c.canvas_id for c in operator.canvases(limit=2)] == [batch_id, chord_id]
    assert [c.canvas_id for c in operator.canvases(kind="chord")] == [chord_id, older]
    assert [c.canvas_id for c in operator.canvases(status="failed")] == [chord_id]
    assert [c.canvas_id for c in operator.canvases(status="open", kind="batch")] == [batch_id]
    assert operator.canvases(status="cancelled") == []
    batch = operator.canvases(kind="batch")[0]
    assert (batch.kind, batch.status, batch.counts) == ("batch", "open", {"queued": 1})
    with pytest.raises(PublishOptionsError):
        operator.canvases(limit=0)


def test_an_unknown_id_is_none(ledger: Ledger, operator: Operator) -> None:
    for unknown in (random_dispatch_id(), "", "a\x00b", "x" * 5000):
        assert operator.canvas(unknown) is None
        assert operator.canvas_members(unknown) is None


# --- the command line ---------------------------------------------------------------------


def test_canvases_list_on_the_command_line(ledger: Ledger, url: str) -> None:
    chord_id, members = chord_with_a_failed_member(ledger)
    result = cli(url, "canvases", "list")
    assert result.exit_code == 0, result.output
    (line,) = result.output.splitlines()
    assert line.startswith(f"{chord_id}  chord failed")
    assert "members=4 [active=1 completed=1 failed=1 refused=1]" in line
    assert f"failed_member={members[1]}" in line
    assert "(not sent)" in line
    as_json = cli(url, "canvases", "list", "--json", "--kind", "chord")
    assert as_json.exit_code == 0, as_json.output
    (row,) = json.loads(as_json.output)
    assert (row["canvas_id"], row["status"], row["failed_member"]) == (
        chord_id, "failed", members[1],
    )  # fmt: skip
    assert row["counts"] == {"completed": 1, "failed": 1, "active": 1, "refused": 1}
    empty = cli(url, "canvases", "list", "--kind", "batch")
    assert (empty.exit_code, empty.output) == (0, "(none)\n")
    wrong = cli(url, "canvases", "list", "--status", "done")
    assert wrong.exit_code == 2 and "'done' is not one of" in wrong.output


def test_canvases_show_on_the_command_line(ledger: Ledger, url: str) -> None:
    chord_id, members = chord_with_a_failed_member(ledger)
    result = cli(url, "canvases", "show", chord_id)
    assert result.exit_code == 0, result.output
    shown = dict(
        (name.strip(), value.strip())
        for name, value in (line.split(": ", 1) for line in result.output.splitlines())
    )
    assert shown["canvas_id"] == chord_id
    assert (shown["kind"], shown["status"], shown["members"]) == ("chord", "failed", "4")
    assert shown["counts"] == "active=1 completed=1 failed=1 refused=1"
    assert shown["failed_member"] == members[1]
    assert shown["callback_status"] == "not sent"
    with_members = cli(url, "canvases", "show", chord_id, "--members")
    assert with_members.exit_code == 0, with_members.output
    listed = [line.split() for line in with_members.output.splitlines() if line.startswith("  #")]
    assert [(line[1], line[3]) for line in listed] == [
        (members[0], "completed"), (members[1], "failed"), (members[2], "active"),
        ("-", "refused"),
    ]  # fmt: skip
    assert "error=ValueError" in with_members.output
    as_json = cli(url, "canvases", "show", chord_id, "--json", "--members")
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.output)
    assert data["failed_member"] == members[1]
    assert [m["status"] for m in data["member_list"]] == [
        "completed",
        "failed",
        "active",
        "refused",
    ]


def test_canvases_show_of_an_unknown_id_says_so_and_exits_1(ledger: Ledger, url: str) -> None:
    for unknown in (random_dispatch_id(), "a\x00b"):
        result = cli(url, "canvases", "show", unknown)
        assert result.exit_code == 1
        assert f"no chord or batch has the id {unknown}" in result.output


def test_dispatches_show_of_a_member_names_its_chord(ledger: Ledger, url: str) -> None:
    chord_id, members = chord_with_a_failed_member(ledger)
    assert members[1] is not None
    result = cli(url, "dispatches", "show", members[1])
    assert result.exit_code == 0, result.output
    assert f"chord/batch: {chord_id}" in result.output
    as_json = cli(url, "dispatches", "show", members[1], "--json")
    assert json.loads(as_json.output)["canvas_id"] == chord_id
    # A dispatch of no canvas says so.
    alone = member(ledger, "unused")
    set_row(ledger, alone, canvas_id=None)
    plain = cli(url, "dispatches", "show", alone)
    assert plain.exit_code == 0, plain.output
    assert "chord/batch: -" in plain.output


def test_no_view_shows_a_callback_or_a_result(ledger: Ledger, url: str) -> None:
    chord_id, _ = chord_with_a_failed_member(ledger)
    batch_id = random_dispatch_id()
    # A secret member: its result is never kept, but were one there, it stays unseen.
    secret = member(ledger, batch_id, "completed", secret=True, result=encode(CANARY, "json"))
    canvas(ledger, "batch", [member(ledger, batch_id, "completed"), secret], canvas_id=batch_id)
    operator = Operator(ledger)
    overview = operator.overview()
    seen = {
        chord_id: [
            cli(url, "canvases", "list").output,
            cli(url, "canvases", "list", "--json").output,
            cli(url, "canvases", "show", chord_id, "--members").output,
            render(overview, ledger="test", refresh_seconds=10),
            json.dumps(overview_json(overview)),
            repr(operator.canvases()),
        ],
        secret: [
            cli(url, "canvases", "show", batch_id, "--json", "--members").output,
            cli(url, "canvases", "show", batch_id, "--members").output,
            cli(url, "dispatches", "show", secret, "--json").output,
            repr(operator.canvas_members(batch_id)),
        ],
    }
    for shown, outputs in seen.items():
        for output in outputs:
            assert shown in output
            assert CANARY not in output


# --- the status page ---------------------------------------------------------------------


def test_the_status_page_lists_chords_and_batches(ledger: Ledger) -> None:
    chord_id, members = chord_with_a_failed_member(ledger)
    batch_id = random_dispatch_id()
    callback_id = random_dispatch_id()
    canvas(
        ledger, "batch", [member(ledger, batch_id, "queued"), member(ledger, batch_id)],
        canvas_id=batch_id, callback_id=callback_id,
    )  # fmt: skip
    app = status_app(Operator(ledger), ledger="test")

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.get(path)

    page = asyncio.run(get("/"))
    assert page.status_code == 200
    section = page.text.split('<table id="canvases">', 1)[1].split("</table>", 1)[0]
    rows = {
        row.split("<code>", 1)[1].split("</code>", 1)[0]: row for row in section.split("<tr>")[2:]
    }
    assert set(rows) == {chord_id, batch_id}
    assert "<td>chord</td>" in rows[chord_id] and ">failed<" in rows[chord_id]
    assert "active 1 &middot; completed 1 &middot; failed 1 &middot; refused 1" in rows[chord_id]
    assert f"<code>{members[1]}</code>" in rows[chord_id]
    assert "<td>batch</td>" in rows[batch_id] and ">open<" in rows[batch_id]
    assert "pending 1 &middot; queued 1" in rows[batch_id]
    assert f"<code>{callback_id}</code> (not sent)" in rows[batch_id]

    data = asyncio.run(get("/overview.json")).json()
    by_id = {c["canvas_id"]: c for c in data["canvases"]}
    assert by_id[batch_id]["counts"] == {"queued": 1, "pending": 1}
    assert by_id[batch_id]["callback_id"] == callback_id
    assert by_id[chord_id]["failed_member"] == members[1]
    assert set(by_id[chord_id]) == {
        "canvas_id", "kind", "status", "on_member_failure", "members", "counts",
        "callback_id", "callback_status", "failed_member", "created_at", "finished_at",
    }  # fmt: skip


def test_the_status_page_says_when_there_are_none(ledger: Ledger) -> None:
    overview = Operator(ledger).overview()
    assert overview.canvases == []
    assert "No chords or batches." in render(overview, ledger="test", refresh_seconds=10)


def test_a_ledger_without_the_canvas_table_still_gets_its_page(ledger: Ledger) -> None:
    member(ledger, "unused")
    with ledger.engine.begin() as conn:
        conn.execute(text("DROP TABLE questpie_queue_canvas"))
    overview = Operator(ledger).overview()
    assert overview.canvases == []
    assert any("chords and batches" in what and "migrate" in what for what in overview.missing)
    page = render(overview, ledger="test", refresh_seconds=10)
    assert "Not shown: the chords and batches" in page and "record" in page
