"""The URLs of the Django site the admin tests and bench/django_admin.py render."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
