"""The shop's jobs. Listed nowhere: `app.autodiscover_tasks()` imports this module."""

from datetime import timedelta

from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone
from pydantic import BaseModel

from questpie_celery import JobContext, job

from .models import Order, OrderEvent


class OrderPlaced(BaseModel):
    order_id: int


class LoginLink(BaseModel):
    email: str
    link: str


class Nothing(BaseModel):
    pass


@job(name="orders.confirm-order", schema=OrderPlaced)
def confirm_order(payload: OrderPlaced, ctx: JobContext) -> None:
    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=payload.order_id)
        order.status = Order.Status.CONFIRMED
        order.save(update_fields=["status"])
        OrderEvent.objects.create(order=order, kind="confirmed", dispatch_id=ctx.dispatch_id)
    send_mail(
        f"Order {order.pk} confirmed",
        f"{order.quantity} x {order.item} are on their way.",
        None,
        [order.email],
    )


# A secret payload: published with `secret_payload=True`, the link is encrypted in the
# ledger, never in the broker, and erased once this has run. Only this handler sees it.
@job(name="orders.send-login-link", schema=LoginLink)
def send_login_link(payload: LoginLink, ctx: JobContext) -> None:
    send_mail("Your sign-in link", f"Sign in: {payload.link}", None, [payload.email])


# A schedule: every worker and beat stores it as it starts; `celery -A shop beat` fires it.
@job(name="orders.cancel-stale-orders", schema=Nothing, options={"cron": "*/15 * * * *"})
def cancel_stale_orders(payload: Nothing, ctx: JobContext) -> None:
    stale = timezone.now() - timedelta(days=1)
    Order.objects.filter(status=Order.Status.PLACED, created_at__lt=stale).update(
        status=Order.Status.CANCELLED
    )
