"""WebSocket URLs served by Channels (imported by config/asgi.py)."""
from django.urls import URLPattern, path

from inference.consumers import GenerateConsumer

websocket_urlpatterns: list[URLPattern] = [
    path("ws/generate", GenerateConsumer.as_asgi()),
]
