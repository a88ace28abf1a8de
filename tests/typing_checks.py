"""Checked by mypy, never run: the user-facing types stay honest."""

from __future__ import annotations

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


def check(questpie: Questpie) -> None:
    assert_type(send_welcome_email, JobDefinition[Welcome])
    client = questpie.client(send_welcome_email)
    assert_type(client.publish(Welcome(user_id="u"), priority=5), str | None)
    assert_type(client.publish({"user_id": "u"}, idempotency_key="k"), str | None)
    assert_type(questpie.queue.send_welcome_email.publish({}), str | None)
    assert_type(questpie.queue.get_receipt("id"), Receipt | None)
    Questpie(Celery("x"), ledger_url="sqlite://", jobs=[send_welcome_email])


async def check_async(questpie: Questpie) -> None:
    client = questpie.client(send_welcome_email)
    assert_type(await client.apublish(Welcome(user_id="u"), idempotency_key="k"), str | None)
    assert_type(await client.apublish_many([{"user_id": "u"}]), list[str | None])
    assert_type(await questpie.queue.aget_receipt("id"), Receipt | None)
    await client.apublish({"user_id": "u"}, idempotency="k")  # type: ignore[arg-type]
