"""The shop's tables. `python -m examples.fastapi_app.models` creates them."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, String, create_engine, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(320))
    amount_cents: Mapped[int]
    status: Mapped[str] = mapped_column(String(20), default="placed")  # then "confirmed"
    #: The client's Idempotency-Key header: a repeated request finds its order here.
    request_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    confirmation_dispatch_id: Mapped[str | None] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class OrderEvent(Base):
    """What happened to an order, one row per event; the worker writes these."""

    __tablename__ = "order_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"), index=True)
    kind: Mapped[str] = mapped_column(String(40))
    dispatch_id: Mapped[str] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class LoginToken(Base):
    """A sign-in token, kept as its SHA-256 digest: the token itself exists only in the
    email (and, on its way there, in the ledger as ciphertext)."""

    __tablename__ = "login_tokens"

    token_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    email: Mapped[str] = mapped_column(String(320))
    emails_sent: Mapped[int] = mapped_column(default=0)
    emailed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


def create_tables(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()


if __name__ == "__main__":
    from .config import DATABASE_URL

    create_tables(DATABASE_URL)
