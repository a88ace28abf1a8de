from django.contrib import admin

from .models import Order, OrderEvent


class OrderEventInline(admin.TabularInline):
    model = OrderEvent
    extra = 0
    readonly_fields = ("kind", "dispatch_id", "at")


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ("id", "email", "item", "quantity", "status", "created_at")
    list_filter = ("status",)
    inlines = (OrderEventInline,)
