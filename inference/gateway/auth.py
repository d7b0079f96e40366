"""API keys for the router's public generation API: the HTTP views and ws/generate.

Auth is on when `settings.ROUTER_API_KEYS` is non-empty or `settings.ROUTER_REQUIRE_AUTH` is set.
A caller then sends `Authorization: Bearer <key>` (what the OpenAI client does with its `api_key`;
DRF's `Token <key>` scheme is accepted too), where the key is an active API key made in the admin or
the REST API (`dpk-...`, checked against the process's snapshot, inference/gateway/api_keys.py), one
of ROUTER_API_KEYS or the DRF authtoken of an active user. Each is a `Tenant`: API keys carry limits
and a priority class, the others are unlimited and interactive. Anything else gets 401 `{"error": {"message", "type":
"authentication_error"}}`; a WebSocket is accepted and closed at once with code 4401 (a close code
is the only thing a browser's WebSocket API shows of a refusal). With auth off the API is open:
the quick start's default, refused at settings import when PLATFORM_PRODUCTION=1.

The HTTP consumers check keys themselves (inference/gateway/consumers.py, `authorized`);
`WebSocketAuthMiddleware` wraps the WebSocket routes (config/asgi.py). GET /health and GET /metrics
stay open for load balancers and Prometheus.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from inference.gateway.api_keys import ENV_TENANT, OPEN_TENANT, TOKEN_TENANT, Tenant, key_cache

logger = logging.getLogger(__name__)

AUTH_ERROR_TYPE = "authentication_error"
WS_CLOSE_UNAUTHORIZED = 4401
# DRF's Token.key is a 40-character hex string: anything else needs no database round trip.
_DRF_TOKEN_LENGTH = 40
_CACHE_MAX_ENTRIES = 4096
# Refused keys are remembered only briefly, so a token created a moment ago works almost at once
# while a client hammering with a bad key still costs no database query per request.
_NEGATIVE_CACHE_S = 2.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def auth_required() -> bool:
    """Whether the generation API needs a key (settings are read per call: tests override them)."""
    return bool(getattr(settings, "ROUTER_API_KEYS", None)) or bool(getattr(settings, "ROUTER_REQUIRE_AUTH", False))


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` (or `Token <key>`) header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() not in ("bearer", "token") or not key:
        return None
    return key


def _equal(a: str, b: str) -> bool:
    # Bytes, not str: compare_digest raises TypeError on non-ASCII str, and headers are
    # attacker-controlled (latin-1 decoded) text.
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def _is_configured_key(key: str, keys: Iterable[str]) -> bool:
    """Constant-time membership in ROUTER_API_KEYS (every key is compared, match or not)."""
    found = False
    for candidate in keys:
        found |= _equal(key, candidate)
    return found


class _TokenCache:
    """Recent DRF token lookups: key -> (valid, expires at); bounded, thread safe."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[bool, float]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bool | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def put(self, key: str, valid: bool, ttl_s: float) -> None:
        with self._lock:
            if len(self._entries) >= _CACHE_MAX_ENTRIES:
                self._entries.clear()  # crude but bounded: random keys cannot grow memory
            self._entries[key] = (valid, time.monotonic() + ttl_s)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


token_cache = _TokenCache()


def _token_is_valid(key: str) -> bool:
    """Whether `key` is the DRF authtoken of an active user (one indexed query)."""
    from rest_framework.authtoken.models import Token  # needs the app registry ready

    token = Token.objects.select_related("user").filter(key=key).first()
    return token is not None and bool(token.user.is_active)


def is_configured_key(key: str) -> bool:
    """Whether `key` is one of ROUTER_API_KEYS (compared in constant time)."""
    return _is_configured_key(key, getattr(settings, "ROUTER_API_KEYS", None) or [])


async def authenticate(key: str | None) -> Tenant | None:
    """The tenant `key` stands for: an active API key, a configured key or an active user's DRF
    token; None when it is none of them."""
    if not key:
        return None
    if is_configured_key(key):
        return ENV_TENANT
    tenant = await key_cache().lookup(key)
    if tenant is not None:
        return tenant
    return TOKEN_TENANT if await _is_valid_token(key) else None


async def open_tenant(key: str | None) -> Tenant:
    """With auth off: the API key's tenant when the caller sent one (its limits and class apply),
    else the open tenant."""
    tenant = await key_cache().lookup(key) if key else None
    return tenant if tenant is not None else OPEN_TENANT


async def is_valid_key(key: str | None) -> bool:
    """Whether `key` opens the generation API."""
    return await authenticate(key) is not None


async def _is_valid_token(key: str) -> bool:
    """Whether `key` is an active user's DRF token (cached both ways)."""
    if len(key) != _DRF_TOKEN_LENGTH or not key.isascii() or not key.isalnum():
        return False
    cached = token_cache.get(key)
    if cached is not None:
        return cached
    try:
        valid = await sync_to_async(_token_is_valid)(key)
    except Exception:  # noqa: BLE001  database down or not migrated: refuse, never 500
        logger.warning("API token lookup failed; refusing the request", exc_info=True)
        return False
    ttl = float(getattr(settings, "ROUTER_AUTH_CACHE_S", 30.0)) if valid else _NEGATIVE_CACHE_S
    token_cache.put(key, valid, ttl)
    return valid


def error_body(message: str) -> dict[str, Any]:
    """The 401 JSON body (`{"error": {"message", "type": "authentication_error"}}`)."""
    return {"error": {"message": message, "type": AUTH_ERROR_TYPE}}


MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"
WRONG_KEY = "invalid API key"
_open_warning_lock = threading.Lock()
_open_warned = False


def warn_open_once() -> None:
    """Say once per process that the generation API is open (fine for the quick start only)."""
    global _open_warned
    with _open_warning_lock:
        if _open_warned:
            return
        _open_warned = True
    logger.warning(
        "the generation API is open: create an API key (admin: API keys, or POST /api/keys/) and set "
        "ROUTER_REQUIRE_AUTH=1 (or ROUTER_API_KEYS) to require keys"
    )


def _scope_authorization(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or []:
        if name.lower() == b"authorization":
            return bytes(value).decode("latin-1")
    return None


class WebSocketAuthMiddleware:
    """ASGI middleware: a WebSocket without a valid key is accepted, told why, and closed with 4401.

    Accepting first is deliberate: refusing the handshake gives the client only an HTTP 403 with no
    reason, while a close code (and the error message before it) reaches browser and CLI clients.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "websocket" or not auth_required():
            await self.app(scope, receive, send)
            return
        key = bearer_key(_scope_authorization(scope))
        if key is not None and await is_valid_key(key):
            await self.app(scope, receive, send)
            return
        message = MISSING_KEY if key is None else WRONG_KEY
        first = await receive()
        if first.get("type") != "websocket.connect":
            return  # the client left before the handshake finished
        await send({"type": "websocket.accept"})
        error = {"type": "error", "status": 401, "message": message, "error_type": AUTH_ERROR_TYPE}
        await send({"type": "websocket.send", "text": json.dumps(error)})
        await send({"type": "websocket.close", "code": WS_CLOSE_UNAUTHORIZED, "reason": "unauthorized"})
