"""Refusals without delay: a generation from a key already known to be over its limit gets its 429 from
what the router process holds in memory, before Channels routes it or a consumer reads its body.

Known means: the key is in the process's snapshot (inference/gateway/api_keys.py, no database) and its
request or token budget of this window is spent (inference/gateway/quotas.py remembers it until the
window ends, so no Redis call). Such a refusal is answered in the ASGI task's first step: no URL
routing, no consumer, no body, no JSON parsing, no handler task, and never the admission queue. Its
Retry-After is the seconds to the next window. Anything the memory cannot say (the key not in the
snapshot, a key out of its scope: 403, a concurrency limit, a router not built yet) goes the usual way.
Such a request's body is not read: its limit is what refuses it, whatever it holds.

`early_answer` is the whole decision as a plain function (headers in, a complete response out), so
the HTTP protocol could call it before it even builds the ASGI scope; `EarlyRefusal` is the ASGI
middleware config/asgi.py puts in front of the HTTP routes.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from inference.gateway import auth
from inference.gateway.api_keys import key_cache
from inference.gateway.quotas import quotas
from inference.gateway.service import built_router
from inference.gateway.tenancy import TenantRequest

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]

# The generation paths and the router's name for each (its per-endpoint series).
GENERATION_PATHS = {"/generate": "generate", "/api/generate": "generate", "/v1/completions": "completion",
                    "/v1/chat/completions": "chat"}


def early_answer(method: str, path: str, headers: list[tuple[bytes, bytes]],
                 arrived: float | None = None) -> Answer | None:
    """The 429 for a generation whose key this process knows to be over its limit, counted as the
    consumer would count it (series, refusal time since `arrived`, usage); None for anything else."""
    kind = GENERATION_PATHS.get(path)
    if kind is None or method != "POST":
        return None
    header = None
    for name, value in headers:
        if name == b"authorization":
            header = value.decode("latin-1")
            break
    key = auth.bearer_key(header)
    if key is None or auth.is_configured_key(key):
        return None
    tenant = key_cache().peek(key)
    if tenant is None or not tenant.limited:
        return None
    refusal = quotas().known_refusal(tenant)
    service = built_router()
    if refusal is None or service is None or not tenant.may_use(service.deployment):
        return None
    tenancy = TenantRequest.for_service(tenant, service, arrived)
    error = tenancy.refuse(refusal)
    tenancy.metrics.requests.labels(tenancy.label, "rejected").inc()
    service.count(kind, "rejected")
    body = orjson.dumps(error.to_dict())
    return 429, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                 (b"retry-after", str(refusal.retry_after_s).encode())], body


class EarlyRefusal:
    """ASGI middleware: `early_answer`'s 429 at once, everything else to `app`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http":
            answer = early_answer(scope.get("method", ""), scope.get("path", ""), scope.get("headers") or [],
                                  time.monotonic())
            if answer is not None:
                status, headers, body = answer
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
