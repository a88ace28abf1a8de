"""The app's jobs: listed nowhere, found by `app.autodiscover_tasks()`."""

import os

from pydantic import BaseModel

from questpie_celery import JobContext, job

from .models import Run


class Tagged(BaseModel):
    tag: str


class Link(BaseModel):
    tag: str
    link: str


def _record(payload: Tagged | Link, ctx: JobContext) -> None:
    # The handler's own ORM work, on the worker's Django connection.
    Run.objects.create(
        job=ctx.job_name,
        tag=payload.tag,
        dispatch_id=ctx.dispatch_id,
        attempt=ctx.attempt,
        pid=os.getpid(),
    )


@job(name="shop.record", schema=Tagged)
def record(payload: Tagged, ctx: JobContext) -> None:
    _record(payload, ctx)


@job(name="shop.exclusive", schema=Tagged, options={"queue_policy": "exclusive"})
def exclusive(payload: Tagged, ctx: JobContext) -> None:
    _record(payload, ctx)


@job(name="shop.magic-link", schema=Link)
def magic_link(payload: Link, ctx: JobContext) -> None:
    _record(payload, ctx)
