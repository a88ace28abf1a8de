"""The shop against a real worker: what a Django project using questpie_celery can count on.

Run with PostgreSQL and a broker: `DATABASE_URL=postgres://... CELERY_BROKER_URL=redis://...
pytest` (see the README).
"""

import base64
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db.models import F
from django.test import Client
from orders.checkout import CONFIRM, confirmation_id
from orders.models import Order, OrderEvent
from shop.celery import questpie

from questpie_celery.contrib.django.models import Dispatch

PROJECT = Path(__file__).resolve().parent.parent

# Tests whose writes really commit, so that the worker (another process) sees them.
pytestmark = pytest.mark.django_db(transaction=True)

CANARY = "https://shop.example.com/login?token=CANARY-d2f1-never-on-a-page"


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {what}")
        time.sleep(0.1)


def confirmed(order_id: int) -> bool:
    return Order.objects.filter(pk=order_id, status=Order.Status.CONFIRMED).exists()


def status(dispatch_id: str) -> str | None:
    found = questpie.queue.get_status(dispatch_id)
    return found.status if found else None


def test_a_placed_order_is_confirmed_once(client: Client, worker: Path) -> None:
    response = client.post("/orders/", {"email": "ada@example.com", "item": "tea", "quantity": 2})
    assert response.status_code == 201, response.content
    order_id, dispatch_id = response.json()["order"], response.json()["dispatch"]
    assert dispatch_id == confirmation_id(order_id)

    wait_for(lambda: confirmed(order_id), "the worker confirms the order")
    wait_for(lambda: status(dispatch_id) == "completed", "the dispatch is completed")
    # The same key again (a retried request, a replayed publish): the same dispatch,
    # no second run.
    again = questpie.queue[CONFIRM].publish(
        {"order_id": order_id}, idempotency_key=f"order:{order_id}:confirm"
    )
    assert again == dispatch_id
    time.sleep(1.0)
    events = list(OrderEvent.objects.filter(order_id=order_id).values_list("kind", "dispatch_id"))
    assert events == [("confirmed", dispatch_id)]
    assert client.get(f"/orders/{order_id}/").json() == {
        "order": order_id,
        "status": "confirmed",
        "confirmation": "completed",
    }


def test_a_declined_card_rolls_everything_back(client: Client, worker: Path) -> None:
    before = Dispatch.objects.filter(job_name=CONFIRM).count()
    response = client.post(
        "/orders/", {"email": "bob@example.com", "item": "tea", "card": "tok_declined"}
    )
    assert response.status_code == 402
    # The publish happened before the charge failed; the rollback took it back with the
    # order: no order, no ledger row, and nothing was sent, so nothing runs.
    assert not Order.objects.exists()
    assert Dispatch.objects.filter(job_name=CONFIRM).count() == before
    time.sleep(1.5)
    assert not OrderEvent.objects.exists()


# Publishes inside an atomic block, and dies as the block commits: the callback below was
# registered before questpie's, so Django runs it first and the message is never sent.
DIE_AFTER_COMMIT = """
import os
from django.db import transaction
from orders.checkout import place_order

with transaction.atomic():
    transaction.on_commit(lambda: os._exit(0))
    order, dispatch_id = place_order(email="cy@example.com", item="tea", quantity=1, card="ok")
    print(order.pk, dispatch_id, flush=True)
"""


def test_a_process_killed_after_commit_still_confirms_once(
    worker: Path, project_env: dict[str, str]
) -> None:
    died = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", DIE_AFTER_COMMIT],
        cwd=PROJECT, env=project_env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert died.returncode == 0, died.stderr
    order_id, dispatch_id = died.stdout.split()[-2:]
    # Committed, never sent: the dispatch waits in the ledger as `pending`.
    row = Dispatch.objects.get(pk=dispatch_id)
    assert (row.status, row.send_count) == ("pending", 0)
    assert Order.objects.get(pk=order_id).status == Order.Status.PLACED
    # The relay leaves a pending row to its publisher for 30 s (its grace) before sending
    # it itself; rather than wait that out, move the row's relay time to its creation.
    Dispatch.objects.filter(pk=dispatch_id).update(next_send_at=F("created_at"))
    wait_for(lambda: confirmed(int(order_id)), "the relay sends it and the worker runs it")
    wait_for(lambda: status(dispatch_id) == "completed", "the dispatch is completed")
    time.sleep(1.0)
    assert list(OrderEvent.objects.filter(order_id=order_id).values_list("dispatch_id")) == [
        (dispatch_id,)
    ]


def test_the_admin_pages_render_and_never_show_a_secret(
    admin_client: Client, client: Client, worker: Path, mail_folder: Path
) -> None:
    # A sign-in link through the view: sent by the worker, its payload erased after.
    sent = client.post("/login-link/", {"email": "dee@example.com"}).json()["dispatch"]
    wait_for(lambda: status(sent) == "completed", "the login link is sent")
    link = next(
        line.split("Sign in: ")[1]
        for mail in mail_folder.iterdir()
        for line in mail.read_text().splitlines()
        if "Sign in: " in line
    )
    assert client.get("/login/", {"token": link.split("token=")[1]}).json() == {
        "email": "dee@example.com"
    }
    # A secret dispatch still waiting (an hour from now): its ciphertext is in the ledger.
    waiting = questpie.queue["orders.send-login-link"].publish(
        {"email": "eve@example.com", "link": CANARY},
        idempotency_key="login-link:canary",
        secret_payload=True,
        start_after=3600,
    )
    assert waiting is not None
    row = Dispatch.objects.get(pk=waiting)
    assert row.secret
    forbidden = [CANARY, link, "dee@example.com", "eve@example.com"]
    forbidden += [CANARY.encode().hex(), base64.b64encode(CANARY.encode()).decode()]
    order = client.post("/orders/", {"email": "fay@example.com", "item": "tea"}).json()
    wait_for(lambda: confirmed(order["order"]), "the order is confirmed")

    pages = {
        "/admin/": ["Dispatches", "Schedules"],
        "/admin/questpie_celery/dispatch/": [waiting, sent, order["dispatch"]],
        f"/admin/questpie_celery/dispatch/{waiting}/change/": ["login-link:canary"],
        f"/admin/questpie_celery/dispatch/{sent}/change/": ["completed"],
        f"/admin/questpie_celery/dispatch/?job={CONFIRM}": [order["dispatch"]],
        f"/admin/questpie_celery/dispatch/?status={row.status}": [waiting],
        "/admin/questpie_celery/schedule/": ["orders.cancel-stale-orders", "*/15 * * * *"],
        "/admin/questpie_celery/policy/": [],
        f"/admin/orders/order/{order['order']}/change/": [order["dispatch"]],
    }
    for path, shown in pages.items():
        response = admin_client.get(path)
        assert response.status_code == 200, path
        html = response.content.decode()
        for text in shown:
            assert text in html, (path, text)
        if path.startswith("/admin/questpie_celery/"):
            for secret in forbidden:
                assert secret not in html, (path, secret)
