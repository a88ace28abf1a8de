"""A stand-in for a payment provider's client."""


class PaymentDeclined(Exception):
    pass


def charge(card: str, amount_cents: int) -> str:
    """Charge the card; the test token `tok_declined` is always declined."""
    if card == "tok_declined":
        raise PaymentDeclined(f"card declined ({amount_cents} cents)")
    return f"ch_{card}_{amount_cents}"
