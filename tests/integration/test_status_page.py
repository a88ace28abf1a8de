"""The status page, served by `questpie-celery web` and looked at in headless Chromium, on a
PostgreSQL ledger that a real worker filled: completed, failed, parked, stuck and secret
dispatches, and the relay's backlog; and its Prometheus figures at `/metrics`, parsed with
prometheus_client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, insert, select, update

from questpie_celery.ledger import dispatch_table, open_ledger
from questpie_celery.ledger.schema import backlog_table
from tests.integration.conftest import StackFactory
from tests.support.faultproxy import FaultProxy
from tests.support.services import PostgresServer, free_port, wait_for_port
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WINDOW = (1280, 1500)
# The page's fills, as the stylesheet sets them.
FAILED_RED = (0xC6, 0x28, 0x28)
PARKED_YELLOW = (0xFF, 0xE9, 0xA8)
PLOT_BLUE = (0x15, 0x65, 0xC0)


@contextmanager
def serve(url: str, log: Path | None = None) -> Iterator[str]:
    """`questpie-celery web` on a free port, as a user runs it; its output goes to `log`
    when given."""
    port = free_port()
    with ExitStack() as files:
        output = files.enter_context(log.open("wb")) if log is not None else subprocess.PIPE
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "questpie-celery"), "web", "--ledger-url", url,
             "--port", str(port)],
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            try:
                wait_for_port(port)
            except AssertionError:
                process.kill()
                said = process.communicate()[0] if log is None else log.read_bytes()
                raise RuntimeError(f"the page never served: {said!r}") from None
            yield f"http://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.communicate(timeout=10)


@pytest.fixture
def filled(make_stack: StackFactory) -> Iterator[tuple[Stack, dict[str, str]]]:
    """A ledger a real worker left behind it, then killed, with stuck states set up
    behind its back (no relay runs any more to repair them while the page is read)."""
    stack = make_stack("redis", env={"QP_TEST_RELAY": "0.3", "QP_TEST_SECRET": "s" * 40})
    t = tag()
    queue = stack.questpie.queue
    done = [queue.record.publish({"tag": t}, idempotency_key=f"{t}:{n}") for n in range(3)]
    failed = queue.record.publish(
        {"tag": t, "fail_times": 1}, idempotency_key=f"{t}:f", retry_limit=0
    )
    # A stately job: one run holds the slot at a closed gate, the next one waits parked.
    gate = stack.gate()
    slot = f"tenant-{uuid.uuid4().hex[:6]}"
    running = queue.policy_stately.publish({"tag": t, "gate": str(gate)}, singleton_key=slot)
    assert running is not None
    stack.wait_status(running, "active")
    parked = queue.policy_stately.publish({"tag": t}, singleton_key=slot)
    idle = f"idle-{uuid.uuid4().hex[:8]}"
    canary = f"canary-{uuid.uuid4().hex}"
    secret = queue.secret_link.publish(
        {"tag": t, "link": canary}, idempotency_key=f"{t}:s", secret_payload=True, queue=idle
    )
    never_sent = queue.record.publish({"tag": t}, idempotency_key=f"{t}:n", queue=idle)
    assert parked and failed and secret and never_sent and all(done)
    for dispatch_id in done:
        stack.wait_status(dispatch_id, "completed")
    stack.wait_status(failed, "failed")
    stack.wait_status(parked, "parked")
    queue.record.schedule({"tag": t}, "0 6 * * 1-5", tz="Europe/Prague")
    # The worker's relay samples the backlog on its first pass.
    assert stack.questpie.operator.backlog(), "a running relay records the backlog"

    stack.worker.kill()  # its run stays active under a lease nobody renews
    stack.questpie.close()  # write the batched acceptances before the states are set below
    long_ago = datetime.now(UTC) - timedelta(hours=1)
    now = datetime.now(UTC)
    with stack.ledger.engine.begin() as conn:
        rows = dispatch_table.c
        conn.execute(
            update(dispatch_table).where(rows.id == running).values(lease_expires_at=long_ago)
        )
        for stuck in (never_sent, secret):
            conn.execute(
                update(dispatch_table)
                .where(rows.id == stuck)
                .values(status="pending", next_send_at=long_ago, queued_at=None)
            )
        # An hour of samples: a backlog that built up and drained.
        conn.execute(
            insert(backlog_table),
            [
                {
                    "sampled_at": now - timedelta(minutes=60 - m),
                    "backlog": max(0, 40 - abs(m - 30) * 3),
                }
                for m in range(0, 60, 2)
            ],
        )
    ids = {"failed": failed, "parked": parked, "running": running, "never_sent": never_sent}
    yield stack, {**ids, "secret": secret, "canary": canary, "tag": t}


def test_the_page_shows_the_ledger_at_a_glance_in_chromium(
    filled: tuple[Stack, dict[str, str]], tmp_path: Path
) -> None:
    stack, ids = filled
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: apt-get install chromium (scripts/test does)")
    with serve(stack.env["QP_TEST_LEDGER"]) as base:
        with urllib.request.urlopen(f"{base}/overview.json", timeout=30) as response:
            data = json.load(response)
        by_job = {row["job_name"]: row["counts"] for row in data["counts"]}
        assert by_job["record"]["completed"] >= 3
        assert by_job["record"]["failed"] == 1
        assert by_job["policy.stately"] == {"active": 1, "parked": 1}
        reasons = {row["dispatch_id"]: row["reason"] for row in data["stuck"]}
        assert reasons[ids["running"]] == "lease lapsed"
        assert reasons[ids["never_sent"]] == "never sent"
        assert reasons[ids["secret"]] == "never sent"  # listed, and still nothing of it shown
        assert [row["dispatch_id"] for row in data["failed"]] == [ids["failed"]]
        assert data["failed"][0]["last_error"] == "RuntimeError"
        assert [(p["job_name"], p["count"]) for p in data["parked"]] == [("policy.stately", 1)]
        assert max(sample["due"] for sample in data["backlog"]) == 40
        (schedule,) = data["schedules"]
        assert (schedule["job_name"], schedule["cron"], schedule["tz"]) == (
            "record", "0 6 * * 1-5", "Europe/Prague"
        )  # fmt: skip
        assert schedule["next_fire_at"] and schedule["last_fire_at"] is None

        shot = tmp_path / "status.png"
        chromium = [
            str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
        ]  # fmt: skip
        dom = subprocess.run(
            [*chromium, "--dump-dom", f"{base}/"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        subprocess.run(
            [*chromium, f"--screenshot={shot}", f"{base}/"],
            capture_output=True,
            timeout=60,
            check=True,
        )

    for shown in (ids["failed"], ids["running"], ids["never_sent"], "policy.stately"):
        assert shown in dom
    assert "lease lapsed" in dom and "RuntimeError" in dom and "0 6 * * 1-5" in dom
    # No payload reaches the page, secret or not, nor a key (payloads and keys carry the tag).
    for hidden in (ids["canary"], ids["tag"]):
        assert hidden not in dom and hidden not in json.dumps(data)

    image = Image.open(shot).convert("RGB")
    assert image.size == WINDOW
    if os.environ.get("QP_STATUS_SCREENSHOT"):  # how the README's screenshot is made
        shutil.copy(shot, os.environ["QP_STATUS_SCREENSHOT"])
    # What a person sees: a red failed cell, a yellow parked cell and the blue backlog line.
    assert pixels_near(image, FAILED_RED) > 300
    assert pixels_near(image, PARKED_YELLOW) > 300
    assert pixels_near(image, PLOT_BLUE) > 300


def pixels_near(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 10) -> int:
    colours = image.getcolors(image.width * image.height) or []
    return sum(
        count
        for count, pixel in colours
        if all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True))
    )


def test_a_page_for_this_machine_refuses_requests_addressed_to_another_name(
    filled: tuple[Stack, dict[str, str]],
) -> None:
    stack, _ = filled
    with serve(stack.env["QP_TEST_LEDGER"]) as base:
        # What a browser sends after a DNS rebinding attack: our address, their name.
        rebound = urllib.request.Request(f"{base}/overview.json", headers={"Host": "evil.example"})
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(rebound, timeout=30)
        assert raised.value.code == 400
        raised.value.close()
        with urllib.request.urlopen(f"{base}/overview.json", timeout=30) as response:
            assert response.status == 200


Figures = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(base: str) -> tuple[str, Figures]:
    """`/metrics` as Prometheus fetches it, and parsed: {name: {sorted labels: value}}."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = response.read().decode()
    figures = {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(body)
    }
    return body, figures


def test_the_metrics_tell_prometheus_what_the_ledger_holds(
    filled: tuple[Stack, dict[str, str]],
) -> None:
    stack, ids = filled
    ledger, rows = stack.ledger, dispatch_table.c

    def waiting_since(dispatch_id: str) -> float:
        with ledger.engine.connect() as conn:
            run_after = conn.execute(
                select(rows.run_after).where(rows.id == dispatch_id)
            ).scalar_one()
        return (ledger.now() - run_after).total_seconds()

    with serve(stack.env["QP_TEST_LEDGER"]) as base:
        # The record job's one waiting dispatch, due since its creation: its longest wait.
        before = waiting_since(ids["never_sent"])
        body, figures = scrape(base)
        after = waiting_since(ids["never_sent"])

    assert figures["questpie_ledger_up"] == {(): 1}
    # Every count, read from the table itself; every other status of each job is a zero.
    with ledger.engine.connect() as conn:
        held = {
            (job, status): count
            for job, status, count in conn.execute(
                select(rows.job_name, rows.status, func.count()).group_by(
                    rows.job_name, rows.status
                )
            )
        }
    dispatches = figures["questpie_dispatches"]
    served = {(dict(k)["job"], dict(k)["status"]): v for k, v in dispatches.items()}
    assert {k: v for k, v in served.items() if v} == held
    assert len(served) == 8 * len({job for job, _ in held})  # every status, zeros included
    assert served[("record", "cancelled")] == 0
    assert served[("record", "failed")] == 1
    assert served[("policy.stately", "active")] == served[("policy.stately", "parked")] == 1

    assert figures["questpie_dispatches_waiting"][(("job", "policy.stately"),)] == 1
    assert figures["questpie_dispatches_waiting"][(("job", "record"),)] == sum(
        held.get(("record", status), 0) for status in ("pending", "queued", "parked")
    )
    assert before <= figures["questpie_oldest_waiting_seconds"][(("job", "record"),)] <= after
    stuck = figures["questpie_dispatches_stuck"]
    assert stuck[(("job", "policy.stately"), ("reason", "lease lapsed"))] == 1
    assert stuck[(("job", "record"), ("reason", "never sent"))] == 1
    assert stuck[(("job", "secret.link"), ("reason", "never sent"))] == 1
    assert sum(stuck.values()) == 3  # and nothing else is stuck
    assert figures["questpie_parked_runs"][(("job", "policy.stately"),)] == 1
    assert figures["questpie_parked_oldest_age_seconds"][(("job", "policy.stately"),)] > 0

    sampled_at, due = ledger.relay.backlog_history(3600)[-1]
    assert figures["questpie_relay_backlog"] == {(): due}
    assert figures["questpie_relay_backlog_sampled_timestamp_seconds"] == {
        (): pytest.approx(sampled_at.timestamp())
    }
    # Only the ledger's figures (no process metrics), and nothing of a payload or a key.
    assert all(name.startswith("questpie_") for name in figures)
    assert ids["canary"] not in body and ids["tag"] not in body


def test_the_metrics_are_read_only_and_for_this_machine_like_the_page(pg_db: str) -> None:
    ledger = open_ledger(pg_db)
    ledger.migration.migrate()
    ledger.close()
    with serve(pg_db) as base:
        _, figures = scrape(base)
        assert figures["questpie_ledger_up"] == {(): 1}
        for refused, code in (
            (urllib.request.Request(f"{base}/metrics", method="POST", data=b""), 405),
            (urllib.request.Request(f"{base}/metrics", headers={"Host": "evil.example"}), 400),
        ):
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(refused, timeout=30)
            assert raised.value.code == code
            raised.value.close()


def test_an_unreachable_ledger_is_scraped_as_down() -> None:
    """Answered, with `questpie_ledger_up 0`: the scrape itself succeeds, so Prometheus's
    `up` still tells a stopped page from an unreachable ledger."""
    url = f"postgresql+psycopg://nobody:hunter2@127.0.0.1:{free_port()}/ledger"
    with serve(url) as base:
        body, figures = scrape(base)
    assert figures == {"questpie_ledger_up": {(): 0}}
    assert "hunter2" not in body


def test_an_unreachable_ledger_gets_a_page_that_says_so() -> None:
    unused = free_port()
    url = f"postgresql+psycopg://nobody:hunter2@127.0.0.1:{unused}/ledger?password=query-pw"
    with serve(url) as base:
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"{base}/", timeout=30)
        assert raised.value.code == 503
        body = raised.value.read().decode()
        raised.value.close()
        assert "cannot be reached" in body and str(unused) in body
        # The header names the ledger without a password, in the URL or its query string.
        assert "hunter2" not in body and "query-pw" not in body


def test_a_ledger_outage_is_one_line_in_the_pages_log_and_the_page_says_so(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """The ledger goes away under a running page that is read again and again (a
    browser refreshing it): each read answers at once that the ledger cannot be reached,
    and the page's log says so once, with the cause and no traceback, then once that it
    is back, after which the page shows the ledger again. Before, the page's process
    logged nothing of an outage."""
    proxy = FaultProxy(postgres.port)
    direct = postgres.create_database("pageoutage")
    migrated = open_ledger(direct)
    migrated.migration.migrate()
    log = tmp_path / "web.log"
    down = "the dispatch ledger cannot be reached ("
    back = "the dispatch ledger can be reached again, after"
    try:
        with serve(proxy.url(direct, postgres.port), log=log) as base:
            with urllib.request.urlopen(f"{base}/overview.json", timeout=30) as response:
                assert response.status == 200
            proxy.cut()
            try:
                for _ in range(5):
                    with pytest.raises(urllib.error.HTTPError) as raised:
                        urllib.request.urlopen(f"{base}/", timeout=30)
                    assert raised.value.code == 503
                    body = raised.value.read().decode()
                    raised.value.close()
                    assert "cannot be reached" in body, body
                wait_until(lambda: down in log.read_text(), "the outage in the log", 30)
            finally:
                proxy.heal()
            with urllib.request.urlopen(f"{base}/overview.json", timeout=30) as response:
                assert response.status == 200
            wait_until(lambda: back in log.read_text(), "the ledger back in the log", 30)
        said = log.read_text()
        assert said.count(down) == 1 and said.count(back) == 1, said
        assert "Traceback" not in said, said
        line = next(line for line in said.splitlines() if down in line)
        assert " WARNING questpie_celery.web: " in line, said  # with its time
        assert "OperationalError" in line, said  # the cause
    finally:
        proxy.close()
        migrated.close()
