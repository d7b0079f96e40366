"""The router's Channels routes: generation and router endpoints by path, and ws/generate.

config/asgi.py puts `http_urlpatterns` in front of Django: these paths never reach Django's
request handling; every other path (the admin, the REST API, static files) does.
"""
from django.urls import URLPattern, path

from inference.gateway.consumers import (
    ChatCompletionsConsumer,
    CompletionsConsumer,
    GenerateConsumer,
    HealthConsumer,
    MetricsConsumer,
    ModelsConsumer,
    StatusConsumer,
)
from inference.gateway.websocket import GenerateSocketConsumer

http_urlpatterns: list[URLPattern] = [
    path("generate", GenerateConsumer.as_asgi()),
    path("api/generate", GenerateConsumer.as_asgi()),
    path("v1/completions", CompletionsConsumer.as_asgi()),
    path("v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
    path("v1/models", ModelsConsumer.as_asgi()),
    path("health", HealthConsumer.as_asgi()),
    path("router/status", StatusConsumer.as_asgi()),
    path("metrics", MetricsConsumer.as_asgi()),
]

websocket_urlpatterns: list[URLPattern] = [
    path("ws/generate", GenerateSocketConsumer.as_asgi()),
]
