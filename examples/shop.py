"""A small Celery project using questpie_celery: the app a `celery worker` runs.

Configuration comes from the environment so the worker process and the publisher
agree: QUESTPIE_DEMO_DIR holds the SQLite ledger and the filesystem broker's folder.
Run `python examples/demo.py` to see it work end to end.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from celery import Celery
from pydantic import BaseModel

from questpie_celery import JobContext, PermanentFailure, Questpie, job

log = logging.getLogger("shop")

DEMO_DIR = Path(os.environ.get("QUESTPIE_DEMO_DIR", "var/demo")).resolve()
BROKER_DIR = DEMO_DIR / "broker"
BROKER_DIR.mkdir(parents=True, exist_ok=True)  # filesystem:// needs existing folders

celery_app = Celery("shop", broker="filesystem://")
celery_app.conf.update(
    broker_transport_options={
        "data_folder_in": str(BROKER_DIR),
        "data_folder_out": str(BROKER_DIR),
        # Absolute, like the rest: kombu's default is "control" in the working directory.
        "control_folder": str(DEMO_DIR / "control"),
        "polling_interval": 0.1,
    },
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
)


class WelcomePayload(BaseModel):
    user_id: str


class ChargePayload(BaseModel):
    order_id: str
    amount_cents: int


@job(name="send-welcome-email", schema=WelcomePayload, options={"retry_limit": 3})
def send_welcome_email(payload: WelcomePayload, ctx: JobContext) -> None:
    log.warning(
        "HANDLER send-welcome-email user=%s dispatch=%s attempt=%d",
        payload.user_id,
        ctx.dispatch_id,
        ctx.attempt,
    )


@job(name="charge-card", schema=ChargePayload, options={"retry_limit": 2, "retry_delay": 1})
async def charge_card(payload: ChargePayload, ctx: JobContext) -> None:
    log.warning("HANDLER charge-card order=%s attempt=%d", payload.order_id, ctx.attempt)
    if payload.amount_cents <= 0:
        raise PermanentFailure("nothing to charge")
    if ctx.attempt == 1:
        raise ConnectionError("payment gateway timed out")  # the retry succeeds


class MagicLinkPayload(BaseModel):
    email: str
    link: str


@job(name="send-magic-link", schema=MagicLinkPayload)
def send_magic_link(payload: MagicLinkPayload, ctx: JobContext) -> None:
    # The plaintext is here and nowhere else; this demo logs only its length.
    log.warning(
        "HANDLER send-magic-link to=%s link_length=%d attempt=%d",
        payload.email,
        len(payload.link),
        ctx.attempt,
    )


questpie = Questpie(
    celery_app,
    ledger_url=f"sqlite:///{DEMO_DIR / 'ledger.sqlite3'}",
    # Secret payloads need a secret of at least 32 bytes, shared by publisher and worker.
    secret=os.environ.get("QUESTPIE_SECRET"),
    jobs=[send_welcome_email, charge_card, send_magic_link],
)
