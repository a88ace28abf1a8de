from django.db import models


class Order(models.Model):
    class Status(models.TextChoices):
        PLACED = "placed"
        CONFIRMED = "confirmed"
        CANCELLED = "cancelled"

    email = models.EmailField()
    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PLACED)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}: {self.quantity} x {self.item} ({self.status})"


class OrderEvent(models.Model):
    """The order's history, one row per thing that happened to it (written by the jobs)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=32)
    dispatch_id = models.CharField(max_length=36)  # the questpie dispatch that wrote it
    at = models.DateTimeField(auto_now_add=True)
