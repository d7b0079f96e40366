"""Public URLs of the inference app (included at the site root by config/urls.py)."""
from django.urls import URLPattern, URLResolver, path

from inference import router_views
from inference.auth import require_api_key

# The router's public API (docs/internals.md, "Router HTTP API"). Everything but /health needs an
# API key when auth is on (inference/auth.py): /router/status names the internal workers.
router_urlpatterns: list[URLPattern | URLResolver] = [
    path("generate", require_api_key(router_views.generate), name="generate"),
    path("api/generate", require_api_key(router_views.generate), name="api-generate"),
    path("v1/completions", require_api_key(router_views.completions), name="v1-completions"),
    path("v1/chat/completions", require_api_key(router_views.chat_completions), name="v1-chat-completions"),
    path("v1/models", require_api_key(router_views.models), name="v1-models"),
    path("health", router_views.health, name="router-health"),
    path("router/status", require_api_key(router_views.router_status), name="router-status"),
]

urlpatterns: list[URLPattern | URLResolver] = [
    *router_urlpatterns,
    # The REST API goes here, e.g. path("api/", include("inference.api_urls")). It comes after
    # the router's routes so that api/generate above keeps winning.
]
