"""Flower, the monitor many Celery projects run, against a real worker.

A real Flower process (the release from PyPI) hears the task events of a stack's worker
and publisher. Through its HTTP API, questpie jobs appear under their job names with
their dispatch ids as task ids; a secret dispatch's plaintext (a canary) appears in
none of what Flower shows or keeps: its task list, each task's detail, its pages, its
worker inspection, its metrics, its log and the task states it saves from the events.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.conftest import new_stack
from tests.integration.test_secrets import SECRET, assert_absent, canary
from tests.support.services import Flower
from tests.support.stack import Stack, tag
from tests.support.waiting import wait_until


@pytest.fixture(params=["redis", "rabbitmq"])
def flower_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Flower]]:
    """A stack with a secret whose worker and publishers send task events (the worker's
    and the `task-sent` ones), and a Flower listening to them."""
    env = {"QP_TEST_SECRET": SECRET, "QP_TEST_EXTENDED": "1"}
    stack = new_stack(request, tmp_path_factory.mktemp("flower"), request.param, env=env)
    flower = Flower(stack.env)
    try:
        flower.start()
        yield stack, flower
    finally:
        flower.close()
        stack.close()


def wait_heard(flower: Flower, heard: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Wait until Flower's task list shows, for each task id, that it heard each named
    event (Flower sets a field of that name, `succeeded` say, to the event's time, in
    whatever order its events come); return the list."""
    tasks: dict[str, Any] = {}
    missing: dict[str, list[str]] = {}

    def all_heard() -> dict[str, Any] | None:
        tasks.clear()
        tasks.update(flower.get("/api/tasks").json())
        missing.clear()
        missing.update(
            (task_id, [name for name in names if tasks.get(task_id, {}).get(name) is None])
            for task_id, names in heard.items()
        )
        return dict(tasks) if not any(missing.values()) else None

    return wait_until(
        all_heard,
        "flower to hear every event",
        60,
        0.1,
        explain=lambda: f"flower did not hear {missing}: {tasks}",
    )


def wait_page(flower: Flower, path: str) -> str:
    last: list[httpx.Response] = []

    def served() -> str | None:
        last[:] = [response := flower.get(path)]
        return response.text if response.status_code == 200 else None

    return wait_until(
        served,
        f"flower to serve {path}",
        60,
        0.1,
        explain=lambda: f"it answers {last[0].status_code}: {last[0].text[:500]}",
    )


def test_flower_shows_jobs_by_name_and_dispatch_id_and_no_secret(
    flower_stack: tuple[Stack, Flower],
) -> None:
    stack, flower = flower_stack
    queue = stack.questpie.queue
    secret, t = canary(), tag()
    plain = queue.record.publish({"tag": t})
    keyed = queue.send_welcome_email.publish({"tag": t}, idempotency_key=f"welcome:{t}")
    # A secret run that fails once (its error names the secret), is retried and
    # returns a value echoing it; another fails for good with the secret in its error.
    retried = queue.secret_link.publish(
        {"tag": t, "link": secret, "fail_times": 1},
        idempotency_key=f"link:{t}",
        secret_payload=True,
    )
    failed = queue.secret_link.publish(
        {"tag": t, "link": secret, "permanent": True},
        idempotency_key=f"link2:{t}",
        secret_payload=True,
    )
    assert plain and keyed and retried and failed
    stack.wait_status(retried, "completed", timeout=60)
    stack.wait_status(failed, "failed", timeout=60)
    names = {
        plain: "record",
        keyed: "send-welcome-email",
        retried: "secret.link",
        failed: "secret.link",
    }
    every = ("sent", "received", "started")
    tasks = wait_heard(
        flower,
        {
            plain: (*every, "succeeded"),
            keyed: (*every, "succeeded"),
            retried: (*every, "retried", "succeeded"),
            failed: (*every, "failed"),
        },
    )
    # The retry's events may come before the failed attempt's `task-retried`: then
    # Flower ends on RETRY (as for Celery's own retries), the ledger on completed.
    assert tasks[retried]["state"] in {"SUCCESS", "RETRY"}
    assert [tasks[i]["state"] for i in (plain, keyed, failed)] == ["SUCCESS", "SUCCESS", "FAILURE"]

    # Each job under its name, its dispatch id the task id, in the list and the detail.
    shown: dict[str, str] = {}
    for dispatch_id, name in names.items():
        listed = tasks[dispatch_id]
        assert (listed["name"], listed["uuid"]) == (name, dispatch_id)
        detail = flower.get(f"/api/task/info/{dispatch_id}")
        assert detail.status_code == 200
        info = detail.json()
        assert (info["name"], info["uuid"], info["state"]) == (name, dispatch_id, listed["state"])
        shown[f"task detail of {dispatch_id}"] = detail.text
    types = flower.get("/api/task/types").json()["task-types"]
    assert {"record", "send-welcome-email", "secret.link"} <= set(types)
    # A plain job's payload is shown, as Celery shows a task's arguments; a secret's not.
    assert t in tasks[plain]["args"] and t in tasks[keyed]["args"]
    assert tasks[retried]["args"] == tasks[failed]["args"] == "(None,)"
    # A secret's failure is shown by the class of what the handler raised, no message.
    assert tasks[failed]["exception"] == "SecretJobError('PermanentFailure')"

    # Everything Flower shows: the task list, its pages, the worker it inspects, the
    # results it reads from the backend, its metrics.
    worker = tasks[plain]["worker"]
    pages = [
        "/api/tasks",
        "/", "/workers", "/workers?json=1", "/tasks", "/metrics",
        "/tasks/datatable?draw=1&start=0&length=100&order[0][column]=0"
        "&order[0][dir]=asc&columns[0][data]=name",
        f"/api/workers?refresh=1&workername={worker}",
        *(f"/task/{dispatch_id}" for dispatch_id in names),
        *(f"/api/task/result/{dispatch_id}" for dispatch_id in names),
    ]  # fmt: skip
    for page in pages:
        response = flower.get(page)
        if "/result/" not in page:  # 503 where there is no result backend (RabbitMQ)
            assert response.status_code == 200, (page, response.text[:500])
        shown[page] = response.text
    # The worker's page: Flower inspects the worker for it (registered tasks, stats,
    # conf, ...), and answers 404 while no reply came within its inspect timeout.
    shown["the worker's page"] = wait_page(flower, f"/worker/{worker}")
    assert retried in shown["/api/tasks"] and retried in shown[f"/task/{retried}"]
    assert "secret.link" in shown["the worker's page"]  # its registered tasks
    for where, text in shown.items():
        assert_absent(secret, f"Flower's {where}", text)
        assert SECRET not in text, f"the ledger's secret is in Flower's {where}"

    # What Flower kept of the events (its saved task states), and its debug log.
    wait_until(
        lambda: retried.encode() in (kept := flower.saved_state()) and t.encode() in kept,
        "Flower to save what it heard",
        60,
        0.2,
    )
    flower.stop()
    saved = flower.saved_state()
    assert_absent(secret, "Flower's saved state", saved)
    assert_absent(secret, "Flower's log", flower.log())
    assert SECRET.encode() not in saved and SECRET not in flower.log()
