# signup.py: a small project, its Celery app, its Questpie and three jobs
from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, Questpie, job

celery_app = Celery("signup", broker="redis://localhost:6379/0")
outbox: list[str] = []  # stands in for the email provider


class Welcome(BaseModel):
    user_id: str


class MagicLink(BaseModel):
    email: str
    link: str


class Report(BaseModel):
    day: str


@job(name="send-welcome", schema=Welcome, options={"retry_limit": 2})
def send_welcome(payload: Welcome, ctx: JobContext) -> None:
    if payload.user_id.startswith("flaky") and ctx.attempt == 1:
        raise ConnectionError("the provider timed out")
    outbox.append(f"welcome {payload.user_id}")


@job(name="send-magic-link", schema=MagicLink)
def send_magic_link(payload: MagicLink, ctx: JobContext) -> None:
    outbox.append(f"link to {payload.email}")


@job(name="build-report", schema=Report, options={"queue_policy": "stately"})
def build_report(payload: Report, ctx: JobContext) -> None:
    outbox.append(f"report {payload.day}")


questpie = Questpie(
    celery_app,
    ledger_url="postgresql+psycopg://app@localhost/app",
    secret="from your settings: at least 32 bytes",
    jobs=[send_welcome, send_magic_link, build_report],
)


def sign_up(user_id: str, email: str) -> str | None:
    """The project's own code: publishes through its Questpie."""
    questpie.queue.send_magic_link.publish(
        {"email": email, "link": f"https://example.com/login/{user_id}"},
        idempotency_key=f"link:{user_id}",
        secret_payload=True,
    )
    return questpie.queue.send_welcome.publish(
        {"user_id": user_id}, idempotency_key=f"welcome:{user_id}"
    )
