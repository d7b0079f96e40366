"""ASGI entry point: a Channels ProtocolTypeRouter serving HTTP through Django and ws/generate.

HTTP bodies over ROUTER_MAX_BODY_BYTES are refused before Django buffers them, and ws/generate
needs an API key when the generation API requires one (docs/security.md).
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs Django set up first)
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from inference.auth import WebSocketAuthMiddleware  # noqa: E402
from inference.limits import BodySizeLimitMiddleware  # noqa: E402
from inference.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        # The admin's CSS/JS (and the metric charts) are served by the same process: no web server or
        # CDN needed in front of the router for the console.
        "http": BodySizeLimitMiddleware(ASGIStaticFilesHandler(django_asgi_app)),
        "websocket": WebSocketAuthMiddleware(URLRouter(websocket_urlpatterns)),
    }
)
