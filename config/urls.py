"""Root URLs: the admin console, the REST API and OpenAPI schema.

The public generation API is not here: Channels consumers serve it before Django (config/asgi.py,
inference/gateway/routing.py).
"""
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

# The console's lists (workers, nodes) carry many columns: the app list beside every page took
# 280 px of a 1,400 px window and cut the last columns off. The home page and breadcrumbs still
# lead everywhere.
admin.site.enable_nav_sidebar = False

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/", include("inference.api.urls")),
]
