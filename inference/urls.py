"""Public URLs of the inference app (included at the site root by config/urls.py)."""
from django.urls import URLPattern, URLResolver, path

from inference import router_views

# The router's public API (docs/internals.md, "Router HTTP API").
router_urlpatterns: list[URLPattern | URLResolver] = [
    path("generate", router_views.generate, name="generate"),
    path("api/generate", router_views.generate, name="api-generate"),
    path("v1/completions", router_views.completions, name="v1-completions"),
    path("v1/chat/completions", router_views.chat_completions, name="v1-chat-completions"),
    path("v1/models", router_views.models, name="v1-models"),
    path("health", router_views.health, name="router-health"),
    path("router/status", router_views.router_status, name="router-status"),
]

urlpatterns: list[URLPattern | URLResolver] = [
    *router_urlpatterns,
    # The REST API goes here, e.g. path("api/", include("inference.api_urls")). It comes after
    # the router's routes so that api/generate above keeps winning.
]
