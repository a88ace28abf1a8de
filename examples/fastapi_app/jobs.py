"""The Celery app, its questpie jobs, and what a worker does with them.

The web app imports `questpie` from here to publish; a worker runs the handlers:
`celery -A examples.fastapi_app.jobs worker` from the repository's root.
"""

from __future__ import annotations

import hashlib
import logging

from celery import Celery
from celery.signals import worker_process_init
from pydantic import BaseModel, SecretStr
from sqlalchemy import create_engine, func, update
from sqlalchemy.orm import Session

from questpie_celery import JobContext, Questpie, job

from .config import BROKER_URL, DATABASE_URL, PUBLIC_URL, QUESTPIE_SECRET
from .models import LoginToken, Order, OrderEvent

log = logging.getLogger(__name__)

celery_app = Celery("shop", broker=BROKER_URL)

# The handlers' own connections to the shop's database (sync: each prefork child runs
# one job at a time).
engine = create_engine(DATABASE_URL, pool_pre_ping=True)


def _fresh_pool_in_child(**_: object) -> None:
    engine.dispose(close=False)  # a forked child never shares its parent's connections


worker_process_init.connect(_fresh_pool_in_child)


class ConfirmOrder(BaseModel):
    order_id: int


@job(name="confirm-order", schema=ConfirmOrder, options={"retry_limit": 3, "retry_delay": 5})
def confirm_order(payload: ConfirmOrder, ctx: JobContext) -> None:
    with Session(engine) as session, session.begin():
        # Published in the order's own transaction and sent after its commit: it exists.
        order = session.get_one(Order, payload.order_id)
        order.status = "confirmed"
        session.add(OrderEvent(order_id=order.id, kind="confirmed", dispatch_id=ctx.dispatch_id))
        # Inside the transaction: if the email fails, the event is not kept and the retry
        # starts afresh.
        deliver_email(order.email, f"Order {order.id} confirmed", "Thank you for your order.")


class MagicLink(BaseModel):
    email: str
    token: SecretStr  # masked in reprs; the handler gets the value


@job(name="send-magic-link", schema=MagicLink, options={"retry_limit": 3, "retry_delay": 10})
def send_magic_link(payload: MagicLink, ctx: JobContext) -> None:
    token = payload.token.get_secret_value()
    deliver_email(payload.email, "Your sign-in link", f"{PUBLIC_URL}/login?token={token}")
    digest = hashlib.sha256(token.encode()).hexdigest()
    with Session(engine) as session, session.begin():
        session.execute(
            update(LoginToken)
            .where(LoginToken.token_sha256 == digest)
            .values(emails_sent=LoginToken.emails_sent + 1, emailed_at=func.now())
        )


def deliver_email(to: str, subject: str, body: str) -> None:
    """A stand-in for your mail provider. It logs the recipient and the subject, never the
    body: a sign-in link in a log is a sign-in link for whoever reads the log."""
    log.info("email to %s: %s (%d characters)", to, subject, len(body))


questpie = Questpie(
    celery_app,
    ledger_url=DATABASE_URL,
    secret=QUESTPIE_SECRET,
    jobs=[confirm_order, send_magic_link],
)
