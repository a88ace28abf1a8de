"""The web app: orders, sign-in links, and what became of a dispatch.

Run it from the repository's root with `uvicorn examples.fastapi_app.app:app`.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, status
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from questpie_celery import DispatchStatus, Receipt

from .config import DATABASE_URL
from .jobs import questpie
from .models import LoginToken, Order

engine = create_async_engine(DATABASE_URL, pool_pre_ping=True)
new_session = async_sessionmaker(engine, expire_on_commit=False)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    # Writes what questpie still batches and closes its connections of this event loop.
    await questpie.aclose()
    await engine.dispose()


app = FastAPI(title="shop", lifespan=lifespan)


async def get_session() -> AsyncIterator[AsyncSession]:
    async with new_session() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


class OrderIn(BaseModel):
    email: str = Field(max_length=320)
    amount_cents: int = Field(gt=0)


class OrderOut(BaseModel):
    order_id: int
    dispatch_id: str


PAYMENT_LIMIT_CENTS = 100_000


async def authorize_payment(order: Order) -> None:
    """A stand-in for your payment provider: it declines orders over a limit."""
    if order.amount_cents > PAYMENT_LIMIT_CENTS:
        raise HTTPException(status.HTTP_402_PAYMENT_REQUIRED, "payment declined")


@app.post("/orders", status_code=status.HTTP_201_CREATED)
async def place_order(
    order_in: OrderIn,
    session: SessionDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> OrderOut:
    """Write the order and publish its confirmation in one transaction."""
    try:
        async with session.begin():
            if idempotency_key is not None and (done := await _order_for(session, idempotency_key)):
                return done  # a repeated request: the same order, the same dispatch
            order = Order(
                email=order_in.email,
                amount_cents=order_in.amount_cents,
                request_key=idempotency_key,
            )
            session.add(order)
            await session.flush()  # assigns order.id; a rival with the same key waits here
            order.confirmation_dispatch_id = await questpie.queue.confirm_order.apublish(
                {"order_id": order.id},
                idempotency_key=f"order:{order.id}",
                session=session,  # the ledger row rides in this transaction; sent after commit
            )
            # Authorized last: when it declines, the HTTPException leaves session.begin(),
            # which rolls back the order and its dispatch together. Nothing is sent.
            await authorize_payment(order)
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key committed its order first.
        if idempotency_key is None:
            raise
        async with session.begin():
            done = await _order_for(session, idempotency_key)
        if done is None:
            raise
        return done
    return _order_out(order)


async def _order_for(session: AsyncSession, request_key: str) -> OrderOut | None:
    order = await session.scalar(select(Order).where(Order.request_key == request_key))
    return None if order is None else _order_out(order)


def _order_out(order: Order) -> OrderOut:
    # confirm-order has no queue policy, so its publish is never suppressed.
    assert order.confirmation_dispatch_id is not None
    return OrderOut(order_id=order.id, dispatch_id=order.confirmation_dispatch_id)


class MagicLinkIn(BaseModel):
    email: str = Field(max_length=320)


class Accepted(BaseModel):
    dispatch_id: str


def new_login_token() -> str:
    """A dependency, so a test can choose the token."""
    return secrets.token_urlsafe(32)


@app.post("/magic-links", status_code=status.HTTP_202_ACCEPTED)
async def request_magic_link(
    body: MagicLinkIn, session: SessionDep, token: Annotated[str, Depends(new_login_token)]
) -> Accepted:
    """Email a sign-in link. The token is sealed in the ledger, absent from the broker
    message, and erased once the email went out; this database keeps only its digest."""
    digest = hashlib.sha256(token.encode()).hexdigest()
    async with session.begin():
        session.add(LoginToken(token_sha256=digest, email=body.email))
        dispatch_id = await questpie.queue.send_magic_link.apublish(
            {"email": body.email, "token": token},
            secret_payload=True,
            # A secret dispatch needs a key, and keys are stored in clear: name the token
            # by its digest, never by itself.
            idempotency_key=f"magic-link:{digest}",
            session=session,
        )
    assert dispatch_id is not None  # send-magic-link has no queue policy either
    return Accepted(dispatch_id=dispatch_id)


# Receipts and statuses carry no payload, but they apply no authorization: in a real app,
# check that the caller may see the dispatch (keep its id with the order or the user).


@app.get("/dispatches/{dispatch_id}/receipt")
async def get_receipt(dispatch_id: str) -> Receipt:
    """A secret dispatch's receipt: queued, then completed or failed."""
    receipt = await questpie.queue.aget_receipt(dispatch_id)
    if receipt is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no secret dispatch with this id")
    return receipt


@app.get("/dispatches/{dispatch_id}")
async def get_status(dispatch_id: str) -> DispatchStatus:
    """Where a ledgered dispatch stands: pending, queued, active, completed, failed, ..."""
    found = await questpie.queue.aget_status(dispatch_id)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no dispatch with this id")
    return found
