"""Request size limits of the router process's Django paths (admin, REST API), enforced before
Django buffers a body (the generation consumers in inference/gateway enforce their own).

Django's ASGI handler reads a whole request body (spooling it to disk when large) before any view
runs, and uvicorn sets no limit of its own, so a check in a view would come after an arbitrarily
large upload. This middleware answers 413 JSON as soon as the declared
Content-Length, or the bytes of a chunked body so far, pass the limit.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _too_large_body(limit: int) -> bytes:
    return json.dumps(
        {"error": {"message": f"request body is larger than {limit} bytes", "type": "invalid_request_error"}}
    ).encode()


class BodySizeLimitMiddleware:
    """ASGI middleware for HTTP: 413 JSON for bodies over `settings.ROUTER_MAX_BODY_BYTES`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        limit = int(settings.ROUTER_MAX_BODY_BYTES)
        declared: int | None = None
        for name, value in scope.get("headers") or []:
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None  # the server (h11/httptools) refuses such a request anyway
        if declared is not None:
            if declared > limit:
                await self._reject(send, limit)
                return
            # The server never delivers more than the declared length: nothing to count.
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read up to the limit here, then replay it to the app.
        buffered: list[Message] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message.get("type") != "http.request":
                break  # a disconnect: let the app see it
            size += len(message.get("body", b""))
            if size > limit:
                await self._reject(send, limit)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _reject(send: Send, limit: int) -> None:
        body = _too_large_body(limit)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the rest of the body is not read
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
