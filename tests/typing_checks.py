"""Checked by mypy, never run: the user-facing types stay honest."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import assert_type

from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, JobDefinition, Questpie, Receipt, job


class Welcome(BaseModel):
    user_id: str


@job(name="send-welcome-email", schema=Welcome, options={"retry_limit": 3})
def send_welcome_email(payload: Welcome, ctx: JobContext) -> None:
    assert_type(payload, Welcome)
    assert_type(ctx.attempt, int)
    assert_type(ctx.idempotency_key, str | None)
    assert_type(ctx.cancel_requested, bool)


def check(questpie: Questpie) -> None:
    assert_type(send_welcome_email, JobDefinition[Welcome])
    client = questpie.client(send_welcome_email)
    assert_type(client.publish(Welcome(user_id="u"), priority=5), str | None)
    assert_type(client.publish({"user_id": "u"}, idempotency_key="k"), str | None)
    assert_type(questpie.queue.send_welcome_email.publish({}), str | None)
    assert_type(questpie.queue.get_receipt("id"), Receipt | None)
    assert_type(questpie.queue.cancel("id"), bool)
    assert_type(questpie.queue.send_welcome_email.cancel(idempotency_key="k"), bool)
    Questpie(Celery("x"), ledger_url="sqlite://", jobs=[send_welcome_email])


def check_publish_keywords(questpie: Questpie) -> None:
    # Every publishing call's keywords are checked by name and by type.
    client = questpie.client(send_welcome_email)
    client.publish({}, queue_policy="singleton", secret_payload=True, start_after="5m")
    client.publish({}, priority=None, queue=None, retry_backoff=True, expire_in_seconds=60)
    client.publish({}, countdown=5)  # type: ignore[call-arg]
    client.publish({}, priority="high")  # type: ignore[arg-type]
    client.publish({}, queue_policy="sometimes")  # type: ignore[arg-type]
    client.publish_many([{}], idempotency_keys=["a"], singleton_keys=None, priority=1)
    client.publish_many([{}], idempotency_key="a")  # type: ignore[call-arg]
    client.publish_many([{}], retry_delay="soon")  # type: ignore[arg-type]
    client.publish({}, debounce_seconds=2, debounce_max_seconds=30.0, singleton_key="u")
    client.publish({}, throttle_seconds=60)
    client.publish({}, debounce_seconds="2s")  # type: ignore[arg-type]
    client.publish_many([{}], singleton_keys=["u"], debounce_seconds=1.5)
    client.publish_many([{}], throttle_seconds=None)


async def check_async(questpie: Questpie) -> None:
    client = questpie.client(send_welcome_email)
    assert_type(await client.apublish(Welcome(user_id="u"), idempotency_key="k"), str | None)
    assert_type(await client.apublish_many([{"user_id": "u"}]), list[str | None])
    assert_type(await questpie.queue.aget_receipt("id"), Receipt | None)
    assert_type(await questpie.queue.acancel("id"), bool)
    assert_type(await client.acancel(idempotency_key="k"), bool)
    await client.apublish({"user_id": "u"}, idempotency="k")  # type: ignore[call-arg]
    await client.apublish({"user_id": "u"}, retry_limit="3")  # type: ignore[arg-type]
    await client.apublish_many([{}], countdown=5)  # type: ignore[call-arg]
    await client.apublish({"user_id": "u"}, debounce_seconds=1, singleton_key="u")
    await client.apublish_many([{}], throttle_seconds=10.0, singleton_keys=["a"])


@dataclass
class AppServices:
    db_url: str


@job(name="typed-context", schema=Welcome)
def typed_context(payload: Welcome, ctx: JobContext[AppServices]) -> None:
    assert_type(ctx.app, AppServices)
    assert_type(ctx.app.db_url, str)
    assert_type(ctx.dispatch_id, str)
    _ = ctx.app.no_such_attr  # type: ignore[attr-defined]


@job(name="typed-context-async", schema=Welcome)
async def typed_context_async(payload: Welcome, ctx: JobContext[AppServices]) -> None:
    assert_type(ctx.app, AppServices)


def bare_context(payload: Welcome, ctx: JobContext) -> None:
    # A bare JobContext is JobContext[None], as before `app` existed.
    assert_type(ctx.app, None)
    assert_type(ctx, JobContext[None])


@contextmanager
def services() -> Iterator[AppServices]:
    yield AppServices(db_url="sqlite://")


@asynccontextmanager
async def async_services() -> AsyncIterator[AppServices]:
    yield AppServices(db_url="sqlite://")


def check_context(questpie: Questpie) -> None:
    assert_type(typed_context, JobDefinition[Welcome])
    # A Questpie with a factory takes typed and bare handlers alike.
    app = Questpie(Celery("x"), ledger_url="sqlite://", jobs=[typed_context], context=services)
    app.job(name="bare", schema=Welcome)(bare_context)
    app.job(name="typed", schema=Welcome)(typed_context.handler)
    Questpie(Celery("x"), ledger_url="sqlite://", context=async_services)
    Questpie(Celery("x"), ledger_url="sqlite://", context=lambda: AppServices(db_url="x"))
    with questpie.override_context(lambda: AppServices(db_url="fake")):
        pass
    with questpie.override_context(None):
        pass
    # A context built by hand (a project's unit test calling its handler directly).
    made = JobContext("id", "typed-context", None, 1, 0, app=AppServices(db_url="x"))
    assert_type(made, JobContext[AppServices])
    typed_context(Welcome(user_id="u"), made)
