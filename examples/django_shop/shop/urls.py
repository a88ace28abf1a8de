from django.contrib import admin
from django.urls import path
from orders import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", views.place_order, name="place-order"),
    path("orders/<int:order_id>/", views.order_detail, name="order-detail"),
    path("login-link/", views.request_login_link, name="login-link"),
    path("login/", views.login, name="login"),
]
