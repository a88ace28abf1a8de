"""The status page's parts without a browser: the backlog samples the relay records, the
plot, escaping, the refusal to serve beyond this machine unasked, and the Prometheus
figures at `/metrics`."""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, insert, select, text, update

from questpie_celery.cli.commands import main
from questpie_celery.ledger import Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.schema import backlog_table
from questpie_celery.ops.operations import Operator
from questpie_celery.web import (
    PLOT_WIDTH,
    backlog_plot,
    is_loopback,
    job_rows,
    render,
    status_app,
)
from tests.support.waiting import wait_until
from tests.unit.helpers import IdleApp, new_dispatch, sqlite_url


def due(ledger: Ledger, count: int, job_name: str = "record") -> list[str]:
    """Rows the relay should have sent an hour ago."""
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    made = [new_dispatch(job_name, next_send_at=long_ago) for _ in range(count)]
    for row in made:
        assert ledger.dispatches.insert(row)
    return [row.id for row in made]


def samples(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(backlog_table)).scalar_one())


def test_one_sample_per_period_however_often_asked_and_old_ones_go(ledger: Ledger) -> None:
    due(ledger, 3)
    with ledger.engine.begin() as conn:
        conn.execute(
            insert(backlog_table).values(
                sampled_at=datetime.now(UTC) - timedelta(hours=3), backlog=99
            )
        )
    for _ in range(3):  # three relays, one after another within the period
        ledger.relay.sample_backlog(every=30, keep=7200)
    history = ledger.relay.backlog_history(3600)
    assert [n for _, n in history] == [3]
    assert samples(ledger) == 1  # the three-hour-old sample was dropped


def test_a_running_relay_records_the_backlog(tmp_path: Path) -> None:
    idle = IdleApp.build(tmp_path)
    try:
        due(idle.ledger, 2)
        stop = threading.Event()
        relay = threading.Thread(target=idle.questpie.run_relay, kwargs={"stop": stop})
        relay.start()
        try:
            history = wait_until(lambda: idle.ledger.relay.backlog_history(60), "a backlog sample")
        finally:
            stop.set()
            relay.join(10)
        # Sampled after the pass that sent both: the relay keeps up.
        assert [n for _, n in history] == [0]
    finally:
        idle.close()


def test_a_ledger_without_the_table_keeps_its_relay_working(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    idle = IdleApp.build(tmp_path)
    try:
        with idle.ledger.engine.begin() as conn:  # a ledger migrated by an older version
            conn.execute(text("DROP TABLE questpie_relay_backlog"))
        first, second = due(idle.ledger, 2)
        stop = threading.Event()
        relay = threading.Thread(target=idle.questpie.run_relay, kwargs={"stop": stop})
        with caplog.at_level(logging.WARNING, logger="questpie_celery.worker.relay"):
            relay.start()
            try:
                wait_until(lambda: idle.ledger.get(first).status == "queued", "the first send")
                # Passes go on after the sample failed: a row made due later is sent too.
                with idle.ledger.engine.begin() as conn:
                    conn.execute(
                        update(dispatch_table)
                        .where(dispatch_table.c.id == second)
                        .values(status="pending", next_send_at=datetime.now(UTC))
                    )
                wait_until(lambda: idle.ledger.get(second).status == "queued", "a later send")
            finally:
                stop.set()
                relay.join(10)
        warnings = [r.getMessage() for r in caplog.records if "backlog" in r.getMessage()]
        assert len(warnings) == 1 and "questpie-celery migrate" in warnings[0]
        assert not [r for r in caplog.records if "relay pass failed" in r.getMessage()]
    finally:
        idle.close()


def test_the_plot_places_the_last_hour_and_scales_to_a_round_number() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    plot = backlog_plot(
        [
            (now - timedelta(hours=2), 500),  # too old to show
            (now - timedelta(minutes=30), 37),
            (now, 4),
        ],
        now,
    )
    assert plot.y_max == 50
    assert plot.points == f"{PLOT_WIDTH / 2},{160 - 37 / 50 * 160:.1f} {PLOT_WIDTH}.0,147.2"
    assert plot.last == (PLOT_WIDTH, 147.2)
    assert plot.latest == 4
    empty = backlog_plot([], now)
    assert (empty.points, empty.last, empty.latest, empty.y_max) == ("", None, None, 5)


def test_user_text_on_the_page_is_escaped(ledger: Ledger) -> None:
    hostile = "<script>alert(1)</script>"
    (dispatch_id,) = due(ledger, 1, job_name=hostile)
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == dispatch_id)
            .values(status="failed", last_error="<img src=x onerror=alert(2)>")
        )
    page = render(Operator(ledger).overview(), ledger="sqlite:///x", refresh_seconds=10)
    assert hostile not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert dispatch_id in page


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.9", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.com", False)],
)  # fmt: skip
def test_which_hosts_count_as_this_machine(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_serving_beyond_this_machine_needs_the_public_flag(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["web", "--ledger-url", sqlite_url(tmp_path), "--host", "0.0.0.0"]
    )
    assert result.exit_code == 2
    assert "--public" in result.output
    assert not (tmp_path / "ledger.sqlite3").exists()  # refused before opening anything


def test_a_far_off_start_is_not_counted_as_waiting_before_it_comes(ledger: Ledger) -> None:
    week = datetime.now(UTC) + timedelta(days=7)
    assert ledger.dispatches.insert(new_dispatch("later", run_after=week, next_send_at=week))
    (late,) = due(ledger, 1, job_name="late")
    with ledger.engine.begin() as conn:
        conn.execute(
            update(dispatch_table)
            .where(dispatch_table.c.id == late)
            .values(run_after=datetime.now(UTC) - timedelta(hours=2))
        )
    rows = {row.job_name: row for row in job_rows(Operator(ledger).overview())}
    assert rows["later"].oldest_waiting_seconds is None
    assert (rows["late"].oldest_waiting_seconds or 0) >= 7000


def test_a_ledger_of_an_older_schema_still_gets_its_page(ledger: Ledger) -> None:
    due(ledger, 1)
    with ledger.engine.begin() as conn:  # as a version-2 ledger is
        conn.execute(text("DROP TABLE questpie_relay_backlog"))
        conn.execute(text("DROP TABLE questpie_schedule"))
    overview = Operator(ledger).overview()
    assert overview.missing and "migrate" in overview.missing[0]
    page = render(overview, ledger="x", refresh_seconds=10)
    assert "Not shown" in page and "record" in page


def scrape(ledger: Ledger) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """`/metrics`, parsed by prometheus_client: {name: {sorted labels: value}}."""
    app = status_app(Operator(ledger), ledger="x")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.get("/metrics")

    response = asyncio.run(get())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(response.text)
    }


def test_the_metrics_count_what_the_ledger_holds_zeros_included(ledger: Ledger) -> None:
    due(ledger, 2)  # pending, an hour past their send: stuck as "never sent"
    (done,) = due(ledger, 1)
    (parked,) = due(ledger, 1, job_name="stately")
    with ledger.engine.begin() as conn:
        rows = dispatch_table.c
        conn.execute(update(dispatch_table).where(rows.id == done).values(status="completed"))
        conn.execute(
            update(dispatch_table)
            .where(rows.id == parked)
            .values(status="parked", slot="tenant", next_send_at=None)
        )
        conn.execute(insert(backlog_table).values(sampled_at=datetime.now(UTC), backlog=7))
    figures = scrape(ledger)

    dispatches = figures["questpie_dispatches"]
    assert dispatches[(("job", "record"), ("status", "pending"))] == 2
    assert dispatches[(("job", "record"), ("status", "completed"))] == 1
    assert dispatches[(("job", "record"), ("status", "failed"))] == 0
    assert dispatches[(("job", "stately"), ("status", "parked"))] == 1
    assert dispatches[(("job", "record"), ("status", "cancelled"))] == 0
    assert len(dispatches) == 2 * 8  # every status of every job
    assert figures["questpie_dispatches_waiting"] == {
        (("job", "record"),): 2,
        (("job", "stately"),): 1,
    }
    # Due since their run_after (their creation), a moment ago: an age, not None.
    assert figures["questpie_oldest_waiting_seconds"][(("job", "record"),)] >= 0
    stuck = figures["questpie_dispatches_stuck"]
    assert stuck[(("job", "record"), ("reason", "never sent"))] == 2
    assert stuck[(("job", "stately"), ("reason", "parked, slot free"))] == 1
    assert stuck[(("job", "record"), ("reason", "lease lapsed"))] == 0
    assert len(stuck) == 2 * 5  # every reason of every job
    assert figures["questpie_parked_runs"] == {(("job", "record"),): 0, (("job", "stately"),): 1}
    assert figures["questpie_relay_backlog"] == {(): 7}
    assert figures["questpie_ledger_up"] == {(): 1}
    # The page's own registry: no process or platform metrics, nothing but the ledger's.
    assert all(name.startswith("questpie_") for name in figures)


def test_the_stuck_counts_agree_with_the_stuck_list(ledger: Ledger) -> None:
    due(ledger, 3)
    due(ledger, 2, job_name="other")
    operator = Operator(ledger)
    listed: dict[tuple[str, str], int] = {}
    for reason, detail in operator.stuck():
        listed[(reason, detail.job_name)] = listed.get((reason, detail.job_name), 0) + 1
    counted = {(c.reason, c.job_name): c.count for c in operator.stuck_counts()}
    assert counted == listed == {("never sent", "record"): 3, ("never sent", "other"): 2}


def test_the_metrics_of_a_ledger_of_an_older_schema_leave_the_backlog_out(
    ledger: Ledger,
) -> None:
    due(ledger, 1)
    with ledger.engine.begin() as conn:  # as a version-2 ledger is
        conn.execute(text("DROP TABLE questpie_relay_backlog"))
        conn.execute(text("DROP TABLE questpie_schedule"))
    figures = scrape(ledger)
    assert "questpie_relay_backlog" not in figures
    assert figures["questpie_dispatches"][(("job", "record"), ("status", "pending"))] == 1
    assert figures["questpie_ledger_up"] == {(): 1}


def test_a_ledger_not_migrated_is_told_as_unreadable_not_as_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ledger that answers but has no tables is not "unreachable": the page's log says
    it cannot be read (with what to do), once however often the page is read, and that
    it can be read again once migrated."""
    ledger = open_ledger(sqlite_url(tmp_path))
    app = status_app(Operator(ledger), ledger="x")

    async def statuses(count: int) -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return [(await client.get("/overview.json")).status_code for _ in range(count)]

    caplog.set_level(logging.WARNING, logger="questpie_celery.web")
    assert asyncio.run(statuses(3)) == [503] * 3
    ledger.migration.migrate()
    assert asyncio.run(statuses(1)) == [200]
    said = [r.getMessage() for r in caplog.records if r.name == "questpie_celery.web"]
    assert len(said) == 2, said
    assert said[0].startswith("the dispatch ledger cannot be read (") and "migrate" in said[0]
    assert said[1].startswith("the dispatch ledger can be read again")
    assert not any("cannot be reached" in m for m in said), said
