"""examples/fastapi_app driven over HTTP: the app served by uvicorn in the test's event
loop, a real `celery worker` running the example's jobs, PostgreSQL and Redis.

The ledger is migrated and the tables created with the commands the example's README
gives, and the worker is started as it says; each test serves the app for its own event
loop, so the app's lifespan (which closes questpie's and the app's connections) runs
every time.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn
from sqlalchemy import Engine, create_engine, func, inspect, select, text
from sqlalchemy.orm import Session

from questpie_celery import derive_dispatch_id
from questpie_celery.ledger import dispatch_table
from tests.integration.test_secrets import assert_absent, redis_dump
from tests.support.services import ROOT, PostgresServer, RedisServer, Worker
from tests.support.waiting import await_until

T = TypeVar("T")

SECRET = "a FastAPI example secret, 32 bytes or more"
EXAMPLE = "examples.fastapi_app"


@dataclass
class Shop:
    env: dict[str, str]
    app_module: ModuleType
    models: ModuleType
    engine: Engine  # this test's own look at the shop's database
    worker: Worker

    def run(self, body: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
        """Serve the app on a fresh event loop for the length of `body`."""

        async def main() -> T:
            async with serving(self.app_module.app) as client:
                return await body(client)

        return asyncio.run(main())

    def scalar(self, query: Any) -> Any:
        with Session(self.engine) as session:
            return session.scalar(query)

    def events(self, order_id: int) -> list[Any]:
        event = self.models.OrderEvent
        with Session(self.engine) as session:
            return list(session.scalars(select(event).where(event.order_id == order_id)))

    def ledger_rows(self) -> int:
        return int(self.scalar(select(func.count()).select_from(dispatch_table)))

    def dispatch_row(self, dispatch_id: str) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(
                select(dispatch_table).where(dispatch_table.c.id == dispatch_id)
            ).first()

    def database_text(self) -> str:
        """Every row of every table in the shop's database (the ledger's and the app's)."""
        with self.engine.connect() as conn:
            return "\n".join(
                str(value)
                for table in inspect(conn).get_table_names()
                for value in conn.execute(text(f'SELECT t::text FROM "{table}" t')).scalars()
            )


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """uvicorn serving `app` on a free port of 127.0.0.1, lifespan included, and a client."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # log_config=None: uvicorn leaves logging alone, so its access log reaches caplog.
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_config=None))
    task = asyncio.create_task(server.serve(sockets=[sock]))

    async def started() -> bool:
        assert not task.done(), "uvicorn exited before serving"
        return bool(server.started)

    try:
        await await_until(started, "uvicorn to serve", 30, 0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
    finally:
        server.should_exit = True
        await task
        sock.close()


async def poll(
    client: httpx.AsyncClient, path: str, status: str, timeout: float = 30
) -> dict[str, Any]:
    """GET `path` until its JSON says `status`."""
    last: list[httpx.Response] = []

    async def says() -> dict[str, Any] | None:
        last[:] = [response := await client.get(path)]
        if response.status_code == 200 and response.json()["status"] == status:
            return dict(response.json())
        return None

    return await await_until(
        says, f"{path} to say {status}", timeout, 0.05, explain=lambda: f"it is {last[0].text}"
    )


async def wait_taken(client: httpx.AsyncClient) -> None:
    """Wait until the worker has taken every message sent so far: a control order placed
    now has its confirmation completed. Redis's queue is first in, first out, and the
    worker logs each message's receipt ("Task ...[id] received") as it takes it, so a
    message sent before the control one is in its log by then."""
    email = f"control-{uuid.uuid4().hex[:10]}@example.com"
    placed = await client.post("/orders", json={"email": email, "amount_cents": 100})
    assert placed.status_code == 201, placed.text
    await poll(client, f"/dispatches/{placed.json()['dispatch_id']}", "completed")


def _run(*args: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        args, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def shop_stack(postgres: PostgresServer, redis_server: RedisServer) -> Iterator[Shop]:
    env = {
        "DATABASE_URL": postgres.create_database("shop"),
        "BROKER_URL": redis_server.url(redis_server.new_db()),
        "QUESTPIE_SECRET": SECRET,
    }
    # As the example's README says: migrate the ledger, create the tables, start a worker.
    cli = str(Path(sys.executable).parent / "questpie-celery")
    _run(cli, "migrate", "-A", f"{EXAMPLE}.jobs:questpie", env=env)
    _run(sys.executable, "-m", f"{EXAMPLE}.models", env=env)
    worker = Worker(env, app=f"{EXAMPLE}.jobs:celery_app", loglevel="debug").start()
    patch = pytest.MonkeyPatch()
    for name, value in env.items():
        patch.setenv(name, value)  # the example reads its settings when imported
    for name in [m for m in sys.modules if m.startswith(EXAMPLE)]:
        del sys.modules[name]
    app_module = importlib.import_module(f"{EXAMPLE}.app")
    shop = Shop(
        env=env,
        app_module=app_module,
        models=importlib.import_module(f"{EXAMPLE}.models"),
        engine=create_engine(env["DATABASE_URL"]),
        worker=worker,
    )
    try:
        yield shop
    finally:
        worker.stop()
        app_module.questpie.close()
        shop.engine.dispose()
        patch.undo()


def test_an_order_commits_with_its_dispatch_and_runs_once(shop_stack: Shop) -> None:
    email = f"{uuid.uuid4().hex[:10]}@example.com"

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, dict[str, Any]]:
        placed = await client.post("/orders", json={"email": email, "amount_cents": 2500})
        assert placed.status_code == 201, placed.text
        return placed, await poll(
            client, f"/dispatches/{placed.json()['dispatch_id']}", "completed"
        )

    placed, status = shop_stack.run(body)
    order_id, dispatch_id = placed.json()["order_id"], placed.json()["dispatch_id"]
    assert dispatch_id == derive_dispatch_id("confirm-order", f"order:{order_id}")
    assert status["attempt"] == 1
    assert status["idempotency_key"] == f"order:{order_id}"
    assert status["secret"] is False
    order = shop_stack.scalar(
        select(shop_stack.models.Order).where(shop_stack.models.Order.email == email)
    )
    assert (order.id, order.status, order.confirmation_dispatch_id) == (
        order_id,
        "confirmed",
        dispatch_id,
    )
    # Completed at its first attempt, for good (a completed row can be claimed no
    # more): its one event is all there will be.
    assert [e.dispatch_id for e in shop_stack.events(order_id)] == [dispatch_id]


def test_the_same_idempotency_key_gives_the_same_order_and_dispatch(shop_stack: Shop) -> None:
    email = f"{uuid.uuid4().hex[:10]}@example.com"
    headers = {"Idempotency-Key": f"checkout-{uuid.uuid4().hex}"}
    order = {"email": email, "amount_cents": 4200}

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        # Four at once (one wins, three wait on the key and find its order), then one more.
        racing = await asyncio.gather(
            *(client.post("/orders", json=order, headers=headers) for _ in range(4))
        )
        await poll(client, f"/dispatches/{racing[0].json()['dispatch_id']}", "completed")
        return [*racing, await client.post("/orders", json=order, headers=headers)]

    responses = shop_stack.run(body)
    assert [r.status_code for r in responses] == [201] * 5, [r.text for r in responses]
    assert len({r.text for r in responses}) == 1
    order_id, dispatch_id = responses[0].json()["order_id"], responses[0].json()["dispatch_id"]
    Order = shop_stack.models.Order
    assert shop_stack.scalar(select(func.count()).where(Order.email == email)) == 1
    # Completed at its first attempt, for good (a completed row can be claimed no
    # more): its one event is all there will be.
    row = shop_stack.dispatch_row(dispatch_id)
    assert (row.status, row.attempt) == ("completed", 1)
    assert [e.dispatch_id for e in shop_stack.events(order_id)] == [dispatch_id]


def test_a_declined_payment_rolls_back_the_order_and_its_dispatch(
    shop_stack: Shop, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint publishes, then the payment is declined: the HTTPException rolls the
    transaction back, and neither the order, nor its ledger row, nor a run remains."""
    email = f"{uuid.uuid4().hex[:10]}@example.com"
    confirm_order = shop_stack.app_module.questpie.queue.confirm_order
    publish = confirm_order.apublish
    published: list[str | None] = []

    async def spy(*args: Any, **kwargs: Any) -> str | None:
        dispatch_id = await publish(*args, **kwargs)
        published.append(dispatch_id)
        return dispatch_id

    monkeypatch.setattr(confirm_order, "apublish", spy)
    rows_before = shop_stack.ledger_rows()

    async def body(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response, int]:
        declined = await client.post("/orders", json={"email": email, "amount_cents": 250_000})
        assert len(published) == 1  # the publish happened, inside the transaction
        status = await client.get(f"/dispatches/{published[0]}")
        rows_after = shop_stack.ledger_rows()  # before the control order adds its own
        await wait_taken(client)
        return declined, status, rows_after

    declined, status, rows_after = shop_stack.run(body)
    assert declined.status_code == 402
    assert declined.json() == {"detail": "payment declined"}
    assert status.status_code == 404
    dispatch_id = published[0]
    assert dispatch_id is not None
    # Had anything been sent, the worker, having taken every message sent until now,
    # would have logged its receipt (checked last below).
    Order, OrderEvent = shop_stack.models.Order, shop_stack.models.OrderEvent
    assert shop_stack.scalar(select(func.count()).where(Order.email == email)) == 0
    assert shop_stack.dispatch_row(dispatch_id) is None
    assert rows_after == rows_before
    assert shop_stack.scalar(select(func.count()).where(OrderEvent.dispatch_id == dispatch_id)) == 0
    assert shop_stack.worker.log_about(dispatch_id) == []


def test_a_magic_link_is_sealed_sent_once_and_shown_nowhere(
    shop_stack: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    """The token (a canary) reaches the handler, which proves it by its digest, and
    appears in no HTTP response, no log of the app or the worker, no table and no broker
    data, while queued or after."""
    caplog.set_level(logging.DEBUG)
    canary = f"CANARY-{uuid.uuid4().hex}"
    digest = hashlib.sha256(canary.encode()).hexdigest()
    email = f"{uuid.uuid4().hex[:10]}@example.com"
    app = shop_stack.app_module.app
    app.dependency_overrides[shop_stack.app_module.new_login_token] = lambda: canary
    worker_pid = shop_stack.worker.proc.pid if shop_stack.worker.proc else 0
    seen: dict[str, str] = {}

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        os.killpg(worker_pid, signal.SIGSTOP)  # hold the run, to see the dispatch queued
        try:
            accepted = await client.post("/magic-links", json={"email": email})
            assert accepted.status_code == 202, accepted.text
            path = f"/dispatches/{accepted.json()['dispatch_id']}"
            queued = await poll(client, f"{path}/receipt", "queued")
            seen["database while queued"] = shop_stack.database_text()
            seen["broker while queued"] = redis_dump(shop_stack.env["BROKER_URL"]).decode(
                errors="replace"
            )
            ciphertext = shop_stack.dispatch_row(queued["dispatch_id"]).secret_ciphertext
            assert ciphertext is not None
        finally:
            os.killpg(worker_pid, signal.SIGCONT)
        await poll(client, f"{path}/receipt", "completed")
        return [
            accepted,
            await client.get(f"{path}/receipt"),
            await client.get(path),
            await client.get("/dispatches/no-such-dispatch/receipt"),
        ]

    try:
        accepted, receipt, status, missing = shop_stack.run(body)
    finally:
        app.dependency_overrides.clear()
    dispatch_id = accepted.json()["dispatch_id"]
    assert accepted.json() == {"dispatch_id": dispatch_id}
    assert dispatch_id == derive_dispatch_id("send-magic-link", f"magic-link:{digest}")
    assert receipt.json()["status"] == "completed"
    assert receipt.json()["handled_at"] is not None
    assert status.json()["secret"] is True
    assert status.json()["attempt"] == 1
    assert missing.status_code == 404
    # The handler had the plaintext: it found the token's row by the digest it computed.
    token = shop_stack.scalar(
        select(shop_stack.models.LoginToken).where(
            shop_stack.models.LoginToken.token_sha256 == digest
        )
    )
    assert (token.email, token.emails_sent) == (email, 1)
    assert token.emailed_at is not None
    # Completion erased the ciphertext.
    assert shop_stack.dispatch_row(dispatch_id).secret_ciphertext is None

    seen["database after"] = shop_stack.database_text()
    seen["HTTP responses"] = "\n".join(
        f"{r.status_code} {r.headers!r} {r.text}" for r in (accepted, receipt, status, missing)
    )
    seen["app's log"] = caplog.text
    seen["worker's log"] = shop_stack.worker.log()
    assert digest in seen["database while queued"]  # the search looks where it should
    assert "POST /magic-links" in seen["app's log"]
    assert f"email to {email}: Your sign-in link" in seen["worker's log"]
    for where, blob in seen.items():
        assert_absent(canary, where, blob)
