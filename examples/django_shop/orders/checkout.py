"""Placing an order: the order, its charge and its confirmation job are one transaction."""

from django.db import transaction
from shop.celery import questpie

from questpie_celery import derive_dispatch_id

from .models import Order
from .payments import charge

PRICE_CENTS = 1250
CONFIRM = "orders.confirm-order"


def confirmation_key(order_id: int) -> str:
    return f"order:{order_id}:confirm"


def confirmation_id(order_id: int) -> str:
    """The dispatch id of the order's confirmation, derived from job and key."""
    return derive_dispatch_id(CONFIRM, confirmation_key(order_id))


def place_order(*, email: str, item: str, quantity: int, card: str) -> tuple[Order, str]:
    """Create the order, publish its confirmation, charge the card, all or nothing.

    Inside `transaction.atomic()`, `publish()` writes the dispatch into the ledger in this
    transaction and sends the Celery message only after the commit. If the charge fails
    after the publish, the block rolls back: no order, no dispatch, no message, no run.
    If the process dies between the commit and the send, the relay in the workers sends
    it. The idempotency key makes a replay of the publish return the same dispatch.
    """
    with transaction.atomic():
        order = Order.objects.create(email=email, item=item, quantity=quantity)
        dispatch_id = questpie.queue[CONFIRM].publish(
            {"order_id": order.pk}, idempotency_key=confirmation_key(order.pk)
        )
        charge(card, PRICE_CENTS * quantity)  # may raise PaymentDeclined: all rolls back
    assert dispatch_id is not None  # a keyed publish always has its dispatch
    return order, dispatch_id
