"""The read-only Django admin of the ledger, through Django's test client, on SQLite and
PostgreSQL: what it lists and shows, what it never shows (a payload, a secret's
ciphertext or wrapped key), that nothing can be written through it, and that its pages
at scale run a fixed, small number of queries and never count the whole table."""

from __future__ import annotations

import base64
import hashlib
import html
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from sqlalchemy import func, insert, select

from bench.fixture import fill
from questpie_celery.jobs.ids import MAX_DISPATCH_ID_BYTES, derive_dispatch_id
from questpie_celery.jobs.options import StoredOptions
from questpie_celery.ledger import Ledger, dispatch_table, open_ledger
from questpie_celery.ledger.schema import policy_table, schedule_table
from tests.support import django_site
from tests.support.services import PostgresServer

CANARY = "CANARY-7f3a9c-never-on-a-page"
SECRET_CANARY = b"CANARY-CIPHERTEXT-5b21e0"
KEY_CANARY = b"CANARY-WRAPPED-KEY-9d44aa"
FORBIDDEN = (
    CANARY,
    SECRET_CANARY.decode(),
    KEY_CANARY.decode(),
    SECRET_CANARY.hex(),
    KEY_CANARY.hex(),
    base64.b64encode(SECRET_CANARY).decode(),
    base64.b64encode(KEY_CANARY).decode(),
)
NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
UNKNOWN_ID = "no-such-dispatch"


@dataclass
class Site:
    ledger: Ledger
    client: Any
    ids: dict[str, str]
    base: str  # the dispatch admin's URL prefix

    def get(self, path: str, **params: str) -> Any:
        response = self.client.get(path, params)
        html = response.content.decode()
        for canary in FORBIDDEN:
            assert canary not in html, f"{canary!r} on {path} {params}"
        return response


def _row(dispatch_id: str, job: str, status: str, **extra: Any) -> dict[str, Any]:
    created = extra.pop("created_at", NOW)
    row: dict[str, Any] = {
        "id": dispatch_id,
        "job_name": job,
        "idempotency_key": None,
        "singleton_key": None,
        "status": status,
        "policy": None,
        "slot": None,
        "payload": {"note": CANARY},
        "secret": False,
        "secret_ciphertext": None,
        "secret_wrapped_key": None,
        "secret_key_id": None,
        "options": StoredOptions(),
        "attempt": 1 if status in ("completed", "failed", "active") else 0,
        "claim_token": None,
        "lease_expires_at": None,
        "run_after": created,
        "send_count": 1,
        "next_send_at": None,
        "last_error": None,
        "created_at": created,
        "queued_at": created + timedelta(milliseconds=50),
        "started_at": None,
        "finished_at": None,
    }
    row.update(extra)
    return row


def _fill(ledger: Ledger) -> dict[str, str]:
    ids = {
        "welcome": derive_dispatch_id("send-welcome-email", "welcome:usr_1"),
        "charge_failed": derive_dispatch_id("charge-card", "charge:ord_9"),
        "secret": derive_dispatch_id("send-magic-link", "magic:ada"),
        "charge_queued": "0b0c0d0e-0000-4000-8000-000000000001",
    }
    rows = [
        _row(
            ids["welcome"],
            "send-welcome-email",
            "completed",
            idempotency_key="welcome:usr_1",
            created_at=NOW - timedelta(minutes=3),
            started_at=NOW - timedelta(minutes=3) + timedelta(seconds=1),
            finished_at=NOW - timedelta(minutes=3) + timedelta(seconds=2),
        ),
        _row(
            ids["charge_failed"],
            "charge-card",
            "failed",
            idempotency_key="charge:ord_9",
            attempt=2,
            last_error="PermanentFailure",
            created_at=NOW - timedelta(minutes=2),
            finished_at=NOW - timedelta(minutes=1),
        ),
        _row(
            ids["secret"],
            "send-magic-link",
            "queued",
            idempotency_key="magic:ada",
            payload=None,
            secret=True,
            secret_ciphertext=SECRET_CANARY,
            secret_wrapped_key=KEY_CANARY,
            secret_key_id="key-2025",
            created_at=NOW - timedelta(minutes=1),
        ),
        _row(ids["charge_queued"], "charge-card", "queued", created_at=NOW),
    ]
    with ledger.engine.begin() as conn:
        conn.execute(insert(dispatch_table), rows)
        conn.execute(
            insert(schedule_table).values(
                job_name="nightly-report",
                source="call",
                cron="0 3 * * *",
                tz="Europe/Prague",
                payload={"note": CANARY},
                singleton_key=None,
                options=StoredOptions(),
                next_fire_at=NOW + timedelta(hours=15),
                last_fire_at=NOW - timedelta(hours=9),
                last_dispatch_id=ids["welcome"],
                updated_at=NOW,
            )
        )
        conn.execute(
            insert(policy_table).values(job_name="charge-card", policy="singleton", updated_at=NOW)
        )
    return ids


def _open_site(url: str) -> Iterator[Site]:
    ledger = open_ledger(url)
    ledger.migration.migrate()
    ids = _fill(ledger)
    django_site.use_database(url)
    client = Client()
    client.force_login(django_site.superuser())
    yield Site(ledger, client, ids, django_site.admin_url("dispatch"))
    connections.close_all()
    ledger.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def site(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Site]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    else:
        url = request.getfixturevalue("postgres").create_database("admin")
    yield from _open_site(url)


def _listed(html: str) -> set[str]:
    """The dispatch ids the change list's rows link to."""
    return set(re.findall(r'<th class="field-id"><a href="[^"]*">([^<]+)</a></th>', html))


def test_the_change_list_shows_every_dispatch_and_no_secret(site: Site) -> None:
    html = site.get(site.base).content.decode()
    assert _listed(html) == set(site.ids.values())
    for shown in ("send-welcome-email", "welcome:usr_1", "PermanentFailure", "charge-card"):
        assert shown in html
    assert "4 dispatches" in html
    # Read-only: no add button, no actions (so no bulk delete), no sorting links.
    assert f'href="{site.base}add/"' not in html
    assert 'name="action"' not in html
    assert "action-checkbox" not in html
    assert "?o=" not in html
    assert "_facets" not in html


def test_filters_by_job_and_status(site: Site) -> None:
    by_job = site.get(site.base, job="charge-card").content.decode()
    assert _listed(by_job) == {site.ids["charge_failed"], site.ids["charge_queued"]}
    by_status = site.get(site.base, status="queued").content.decode()
    assert _listed(by_status) == {site.ids["secret"], site.ids["charge_queued"]}
    both = site.get(site.base, job="charge-card", status="failed").content.decode()
    assert _listed(both) == {site.ids["charge_failed"]}
    # The job filter offers every job in the ledger, the status filter the whole vocabulary.
    for job in ("charge-card", "send-magic-link", "send-welcome-email"):
        assert f"?job={job}" in by_job
    for status in ("pending", "parked", "retry", "completed"):
        assert f"status={status}" in by_job


def test_search_is_by_exact_id_or_key(site: Site) -> None:
    by_key = site.get(site.base, q="charge:ord_9").content.decode()
    assert _listed(by_key) == {site.ids["charge_failed"]}
    by_id = site.get(site.base, q=site.ids["charge_queued"]).content.decode()
    assert _listed(by_id) == {site.ids["charge_queued"]}
    assert _listed(site.get(site.base, q="charge:").content.decode()) == set()


def test_a_plain_calls_task_id_of_any_shape_is_listed_shown_and_found(site: Site) -> None:
    """A plain call of a policy job keeps its own task id, whatever its shape: its row is
    listed, its page opens from the list's link, and an exact search finds it, blanks
    around it included."""
    odd = [" lead", "trail ", "a/b?c#d_5F", "line\nbreak", "<b>ünï🚀</b>", "x" * 1000]
    with site.ledger.engine.begin() as conn:
        conn.execute(insert(dispatch_table), [_row(i, "plain-job", "failed") for i in odd])
    links = dict(
        (html.unescape(text), html.unescape(href))
        for href, text in re.findall(
            r'<th class="field-id"><a href="([^"]*)">([^<]*)</a></th>',
            site.get(site.base, job="plain-job").content.decode(),
        )
    )
    assert set(links) == set(odd)
    for dispatch_id, href in links.items():
        page = site.get(href)
        assert page.status_code == 200
        assert html.escape(dispatch_id) in page.content.decode()
        assert _listed(site.get(site.base, q=dispatch_id).content.decode()) == {
            html.escape(dispatch_id)
        }


def test_a_dispatch_page_is_read_only_and_shows_no_secret(site: Site) -> None:
    failed = site.get(f"{site.base}{site.ids['charge_failed']}/change/")
    assert failed.status_code == 200
    html = failed.content.decode()
    for shown in ("charge-card", "charge:ord_9", "PermanentFailure", "failed"):
        assert shown in html
    assert 'name="_save"' not in html
    assert "deletelink" not in html
    secret = site.get(f"{site.base}{site.ids['secret']}/change/")
    assert secret.status_code == 200
    assert "key-2025" in secret.content.decode()


@pytest.mark.parametrize(
    "bad_id",
    ["\x00", "job-\x00-1", "x" * (MAX_DISPATCH_ID_BYTES + 1)],
    ids=["nul", "nul-inside", "too-long"],
)
def test_an_id_no_row_can_have_is_answered_as_an_unknown_one(site: Site, bad_id: str) -> None:
    """Its page answers as an unknown id's does, without asking the ledger, so never
    with the database's error (PostgreSQL's text cannot hold a NUL). (A search for a NUL
    is Django's to refuse: its search form does.)"""
    with CaptureQueriesContext(connection) as asked:
        unknown = site.get(f"{site.base}{quote(UNKNOWN_ID)}/change/")
    assert unknown.status_code == 302  # to the index, saying no such dispatch exists
    assert _ledger_queries([q["sql"] for q in asked.captured_queries])
    with CaptureQueriesContext(connection) as asked:
        page = site.get(f"{site.base}{quote(bad_id)}/change/")
    assert (page.status_code, page["Location"]) == (unknown.status_code, unknown["Location"])
    assert _ledger_queries([q["sql"] for q in asked.captured_queries]) == []


def test_nothing_can_be_written(site: Site) -> None:
    def row() -> tuple[Any, ...]:
        with site.ledger.engine.connect() as conn:
            found = conn.execute(
                select(dispatch_table).where(dispatch_table.c.id == site.ids["charge_failed"])
            ).one()
        return tuple(found)

    before = row()
    change = f"{site.base}{site.ids['charge_failed']}/change/"
    assert site.client.post(change, {"status": "completed", "attempt": "9"}).status_code == 403
    assert site.client.get(f"{site.base}add/").status_code == 403
    assert site.client.post(f"{site.base}add/", {"id": "x"}).status_code == 403
    delete = f"{site.base}{site.ids['charge_failed']}/delete/"
    assert site.client.get(delete).status_code == 403
    assert site.client.post(delete, {"post": "yes"}).status_code == 403
    site.client.post(
        site.base, {"action": "delete_selected", "_selected_action": [site.ids["charge_failed"]]}
    )
    assert row() == before
    with site.ledger.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(dispatch_table)).scalar() == 4


def test_schedules_and_policies_are_listed_read_only(site: Site) -> None:
    base = site.base.rsplit("/", 2)[0]
    schedules = site.get(f"{base}/schedule/")
    assert schedules.status_code == 200
    html = schedules.content.decode()
    for shown in ("nightly-report", "0 3 * * *", "Europe/Prague", site.ids["welcome"]):
        assert shown in html
    assert f'href="{site.base}{site.ids["welcome"]}/change/"' in html
    assert 'schedule/add/"' not in html
    # No page per schedule: the list shows it all.
    assert site.client.get(f"{base}/schedule/nightly-report/change/").status_code == 404
    policies = site.get(f"{base}/policy/").content.decode()
    assert "charge-card" in policies
    assert "singleton" in policies
    index = site.get("/admin/").content.decode()
    for name in ("Dispatches", "Schedules", "Queue policies"):
        assert name in index


def test_a_user_without_view_permission_sees_nothing(site: Site) -> None:
    staff = get_user_model().objects.create_user("staff", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(site.base).status_code == 403
    assert client.get(f"{site.base}{site.ids['secret']}/change/").status_code == 403


# --- at scale --------------------------------------------------------------------------

SCALE_ROWS = 200_000
#: The id bench/fixture.py gives its row 1233 (keyed "order-1233", job-9).
FIXTURE_ID = str(uuid.UUID(hashlib.md5(b"qp1233").hexdigest()))


@pytest.fixture(scope="module")
def big_site(postgres: PostgresServer) -> Iterator[Site]:
    url = postgres.create_database("admin_big")
    ledger = open_ledger(url)
    ledger.migration.migrate()
    fill(ledger.engine, SCALE_ROWS)
    # The fixture's ids are not derived from its keys; a published keyed dispatch's is.
    keyed = derive_dispatch_id("job-9", "order-x-1")
    with ledger.engine.begin() as conn:
        conn.execute(
            insert(dispatch_table),
            [_row(keyed, "job-9", "completed", idempotency_key="order-x-1", created_at=NOW)],
        )
    django_site.use_database(url)
    client = Client()
    client.force_login(django_site.superuser())
    yield Site(ledger, client, {}, django_site.admin_url("dispatch"))
    connections.close_all()
    ledger.close()


def _queries(site: Site, path: str, **params: str) -> tuple[str, list[str]]:
    with CaptureQueriesContext(connection) as captured:
        response = site.get(path, **params)
    assert response.status_code == 200, (path, params)
    return response.content.decode(), [q["sql"] for q in captured.captured_queries]


def _ledger_queries(sqls: list[str]) -> list[str]:
    table = dispatch_table.name
    return [sql for sql in sqls if table in sql]


@pytest.mark.parametrize(
    ("params", "ledger_queries", "count_text", "rows"),
    [
        # job choices, capped count, planner estimate, the page
        ({}, 4, "about 2", 100),
        ({"status": "completed"}, 4, "about 1", 100),
        # One job of twelve: about 16,667 rows, as the planner samples its statistics.
        ({"job": "job-3"}, 4, r"about 1[4-9],\d{3} ", 100),
        ({"p": "2"}, 4, "about 2", 100),
        # Fewer than the cap: counted exactly, no estimate.
        ({"job": "job-4", "status": "failed", "p": "3"}, 3, "660 dispatches", 100),
        ({"status": "parked"}, 3, "198 dispatches", 100),
        # A key: the jobs (for the ids it derives), job choices, the count, the row.
        ({"q": "order-x-1"}, 4, "1 dispatch", 1),
        # An id: the same queries.
        ({"q": FIXTURE_ID}, 4, "1 dispatch", 1),
    ],
)
def test_list_pages_at_scale_never_count_the_table(
    big_site: Site, params: dict[str, str], ledger_queries: int, count_text: str, rows: int
) -> None:
    html, sqls = _queries(big_site, big_site.base, **params)
    ours = _ledger_queries(sqls)
    assert len(ours) == ledger_queries, ours
    # Beside the ledger: the session and the user, nothing else.
    assert len(sqls) - len(ours) <= 2, sqls
    for sql in ours:
        upper = sql.upper()
        assert "DISTINCT" not in upper, sql
        if "COUNT(" in upper:
            assert re.search(r"LIMIT 10001\)", upper), f"an unbounded count: {sql}"
        elif upper.startswith("SELECT"):
            assert re.search(r"LIMIT (100|1)\b", upper) or "WHERE" in upper, sql
    paginator = re.search(r'<p class="paginator">(.*?)</p>', html, re.S)
    assert paginator is not None
    assert re.search(count_text, paginator.group(1)), paginator.group(1)
    assert len(_listed(html)) == rows
    if "q" in params:
        assert _listed(html) <= {FIXTURE_ID, derive_dispatch_id("job-9", "order-x-1")}


@pytest.mark.parametrize("params", [{"o": "5"}, {"o": "-2.5"}, {"o": "3", "job": "job-4"}])
def test_a_hand_written_sort_is_ignored(big_site: Site, params: dict[str, str]) -> None:
    """Columns offer no sorting, and a `?o=` typed into the URL must not sort the whole
    table either: the page keeps the newest-first order its index serves."""
    _, sqls = _queries(big_site, big_site.base, **params)
    [page] = [sql for sql in _ledger_queries(sqls) if re.search(r"LIMIT 100\b", sql.upper())]
    assert re.search(r"ORDER BY \S*created_at\S* DESC", page), page


@pytest.mark.parametrize(
    "lookup", ["last_error__icontains", "idempotency_key__regex", "slot__isnull", "attempt__gt"]
)
def test_lookups_other_than_the_filters_are_refused(big_site: Site, lookup: str) -> None:
    response = big_site.get(big_site.base, **{lookup: "1"})
    assert response.status_code in (400, 302)  # refused, or sent back without the lookup
    if response.status_code == 302:
        assert lookup not in response["Location"]


def test_a_dispatch_page_at_scale_is_one_lookup(big_site: Site) -> None:
    html, sqls = _queries(big_site, f"{big_site.base}{FIXTURE_ID}/change/")
    assert "order-1233" in html
    ours = _ledger_queries(sqls)
    assert len(ours) == 1, ours
    assert "WHERE" in ours[0]


def test_deep_pages_stop_at_the_cap(big_site: Site) -> None:
    html, _ = _queries(big_site, big_site.base, p="100")
    assert "about " in html
    assert big_site.client.get(big_site.base, {"p": "101"}).status_code == 302  # ?e=1
