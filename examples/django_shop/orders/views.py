import uuid

from django.core import signing
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from shop.celery import questpie

from .checkout import confirmation_id
from .checkout import place_order as checkout
from .models import Order
from .payments import PaymentDeclined

# The POST views are a small JSON API for scripts and tests; a form-based view would keep
# Django's CSRF protection.


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    """POST email, item, quantity, card: 201 with the order, or 402 when the card is
    declined (and then nothing was kept: no order, no dispatch)."""
    try:
        order, dispatch_id = checkout(
            email=request.POST["email"],
            item=request.POST["item"],
            quantity=int(request.POST.get("quantity", "1")),
            card=request.POST.get("card", "tok_visa"),
        )
    except PaymentDeclined as exc:
        return JsonResponse({"error": str(exc)}, status=402)
    return JsonResponse({"order": order.pk, "dispatch": dispatch_id}, status=201)


@require_GET
def order_detail(request: HttpRequest, order_id: int) -> JsonResponse:
    order = get_object_or_404(Order, pk=order_id)
    confirmation = questpie.queue.get_status(confirmation_id(order.pk))
    return JsonResponse(
        {
            "order": order.pk,
            "status": order.status,
            "confirmation": confirmation.status if confirmation else None,
        }
    )


@csrf_exempt
@require_POST
def request_login_link(request: HttpRequest) -> JsonResponse:
    """POST email: mails a one-time sign-in link through a secret-payload job."""
    email = request.POST["email"]
    nonce = uuid.uuid4().hex
    token = signing.dumps({"email": email, "nonce": nonce}, salt="login-link")
    link = request.build_absolute_uri(reverse("login") + f"?token={token}")
    dispatch_id = questpie.queue["orders.send-login-link"].publish(
        {"email": email, "link": link},
        idempotency_key=f"login-link:{nonce}",  # a secret dispatch needs a key
        secret_payload=True,
    )
    return JsonResponse({"dispatch": dispatch_id}, status=202)


@require_GET
def login(request: HttpRequest) -> JsonResponse:
    """Where the link leads: a valid token for 15 minutes (a real shop would log in)."""
    try:
        signed = signing.loads(request.GET["token"], salt="login-link", max_age=900)
    except (KeyError, signing.BadSignature):
        return JsonResponse({"error": "invalid or expired link"}, status=400)
    return JsonResponse({"email": signed["email"]})
