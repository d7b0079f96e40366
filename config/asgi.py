"""ASGI entry point: a Channels ProtocolTypeRouter in front of Django.

HTTP: the router's generation and status paths go straight to Channels consumers
(inference/gateway/routing.py) and never pass Django's request stack; everything else (the admin,
the REST API, static files) is Django, with bodies over ROUTER_MAX_BODY_BYTES refused before Django
buffers them. WebSocket: ws/generate, which needs an API key when the generation API requires one
(docs/security.md).
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import re_path  # noqa: E402

from config.web_gc import tune_web_gc  # noqa: E402
from inference.gateway.auth import WebSocketAuthMiddleware  # noqa: E402
from inference.gateway.early_refusal import EarlyRefusal  # noqa: E402
from inference.gateway.limits import BodySizeLimitMiddleware  # noqa: E402
from inference.gateway.routing import http_urlpatterns, websocket_urlpatterns  # noqa: E402

# The admin's CSS/JS (and the metric charts) are served by the same process: no web server or CDN
# needed in front of the router for the console.
django_http = BodySizeLimitMiddleware(ASGIStaticFilesHandler(django_asgi_app))

# Garbage collection set once the app is loaded (config/web_gc.py): a full collection during an admin page
# cost +100-300 ms of CPU in about one request in eight at 1,000 workers (its p95); frozen, the objects
# alive after setup are not walked again (docs/benchmarks.md, issue 25's third pass).
tune_web_gc()

application = ProtocolTypeRouter(
    {
        # A key known to be over its limit is refused before routing (inference/gateway/early_refusal.py).
        "http": EarlyRefusal(URLRouter([*http_urlpatterns, re_path(r"", django_http)])),
        "websocket": WebSocketAuthMiddleware(URLRouter(websocket_urlpatterns)),
    }
)
