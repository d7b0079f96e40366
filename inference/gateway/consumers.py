"""The router's public HTTP API as Channels consumers, off Django's request stack.

POST /generate and /api/generate (the seed's JSON), POST /v1/completions and /v1/chat/completions
(OpenAI, streaming included), GET /v1/models, GET /health, GET /router/status and GET /metrics.
Channels routes these paths straight to the consumers (inference/gateway/routing.py): no Django
middleware, session, CSRF or ORM runs for a generation (API keys that are DRF tokens are looked up
once and cached, inference/gateway/auth.py). The admin and the REST API stay Django views.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import orjson
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings

from inference.gateway import auth
from inference.gateway.client_link import client_gone_probe
from inference.gateway.http_protocol import health_body
from inference.gateway.service import RouterService, get_router
from inference.gateway.tenancy import Tenant, TenantRequest
from inference.router import RouterError
from inference.router.answers import SSE_DONE, SseFormatter, collect, final_body
from inference.router.choices import generate_choices
from inference.router.events import ErrorEvent, Event, TokenEvent
from inference.router.metrics import CONTENT_TYPE
from inference.router.protocol import PARSERS, Kind
from inference.wire import delivery_trace

logger = logging.getLogger(__name__)

_MODELS_CACHE_S = 10.0
# A body over the limit is still read (and dropped) up to this many bytes, so that every client
# gets the 413 answer instead of a connection reset; past it the connection is closed after it.
_DISCARD_BYTES = 16 * 2**20
# How long the end of a finished response may take to be noticed before its task is cancelled.
_FINISH_GRACE_S = 5.0

Headers = list[tuple[bytes, bytes]]
_JSON: Headers = [(b"content-type", b"application/json")]
_SSE: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # nginx: pass events through as they come
]


def _outcome(status: int) -> str:
    if status < 400:
        return "ok"
    if status == 429:
        return "rejected"
    return "client_error" if status < 500 else "failed"


class GatewayConsumer(AsyncHttpConsumer):  # type: ignore[misc]
    """An HTTP consumer whose handler runs as a task while the connection is watched.

    Channels' AsyncHttpConsumer awaits `handle()` inside its message loop, so a client that leaves
    during a long stream is noticed only when the stream ends; and its dispatch closes old database
    connections (a thread hop) for every message. Here `handle()` runs as a task, the loop keeps
    receiving, and `http.disconnect` cancels the task at once (its cleanup aborts the request on
    both workers); no database is touched. Bodies over ROUTER_MAX_BODY_BYTES get 413 after being
    read and dropped (up to a bound), so every client sees the answer.
    """

    # Generation streams straight from the workers: no channel layer (and so no Redis) is needed.
    channel_layer_alias = "inference-router-none"
    methods: tuple[str, ...] = ("GET",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrived = time.monotonic()
        self.size = 0
        self.too_large = False
        self.task: asyncio.Task[None] | None = None
        self.responded = False  # the response has started (its status can no longer change)
        self.complete = False  # its last byte was handed to the server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one connection's request: receive messages in order and dispatch each.

        Channels' own loop wraps every receive in a task and an `asyncio.wait` (it may also
        listen on a channel layer, which the gateway never uses); one plain loop is the same
        behaviour for a consumer without a channel layer, at a fraction of the cost per request.
        """
        self.scope = scope
        self.channel_layer = None
        self.base_send = send
        try:
            while True:  # ends with StopConsumer (response done or client gone)
                await self.dispatch(await receive())
        except StopConsumer:
            pass

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Route a message to its handler (without Channels' per-message database cleanup)."""
        kind = message.get("type")
        if kind == "http.request":
            await self.http_request(message)
        elif kind == "http.disconnect":
            await self.http_disconnect(message)

    async def http_request(self, message: dict[str, Any]) -> None:
        """Collect the body (bounded), then start the handler."""
        chunk = message.get("body", b"")
        self.size += len(chunk)
        if self.size > self.limit():
            self.too_large = True
            self.body.clear()
        elif chunk:
            self.body.append(chunk)
        if message.get("more_body") and self.size <= _DISCARD_BYTES:
            return
        if self.too_large:
            limit = self.limit()
            await self.json(413, RouterError(413, f"request body is larger than {limit} bytes",
                                             error_type="invalid_request_error").to_dict(),
                            close=bool(message.get("more_body")))
            raise StopConsumer()
        self.task = asyncio.ensure_future(self._run(b"".join(self.body)))

    async def http_disconnect(self, message: dict[str, Any]) -> None:
        """The response ended or the client left: let the handler finish, or cancel it."""
        task = self.task
        if task is not None and not task.done():
            if not self.complete:
                task.cancel()  # the client left: the generation's cleanup aborts it on the workers
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=_FINISH_GRACE_S)
        raise StopConsumer()

    async def _run(self, body: bytes) -> None:
        try:
            await self.handle(body)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001  API clients get JSON, never a traceback
            logger.exception("%s failed", self.scope.get("path"))
            if not self.responded:
                await self.error(RouterError(500, "internal router error", error_type="server_error"))

    # ------------------------------------------------------------------ helpers

    async def send_body(self, body: bytes, *, more_body: bool = False) -> None:
        """Send part of the body; the last part (no `more_body`) completes the response."""
        if not more_body:
            self.complete = True
        await super().send_body(body, more_body=more_body)

    def limit(self) -> int:
        """The largest accepted request body (ROUTER_MAX_BODY_BYTES)."""
        return int(settings.ROUTER_MAX_BODY_BYTES)

    async def json(self, status: int, data: Any, headers: Headers | None = None, *, close: bool = False) -> None:
        """Send a whole JSON response."""
        body = orjson.dumps(data)
        extra = [(b"connection", b"close")] if close else []
        await self.send_headers(status=status, headers=_JSON + (headers or []) + extra)
        self.responded = True
        await self.send_body(body)

    async def error(self, exc: RouterError) -> None:
        """The JSON error answer for a RouterError; 429 and 503 carry Retry-After."""
        retry_after = str(getattr(exc, "retry_after_s", 1)).encode()  # a per-key limit says when
        headers = [(b"retry-after", retry_after)] if exc.status in (429, 503) else []
        await self.json(exc.status, exc.to_dict(), headers)

    async def router_or_503(self) -> RouterService | None:
        """This process's router, or None after answering 503 (settings name a bad endpoint/policy)."""
        try:
            return get_router()
        except RouterError as exc:
            await self.error(exc)
            return None

    async def admitted_service(self, *, auth: bool) -> RouterService | None:
        """This process's router once the method (and, with `auth`, the API key) is accepted; None
        after answering 405, 401 or 503."""
        if not await self.method_allowed() or (auth and not await self.authorized()):
            return None
        return await self.router_or_503()

    async def method_allowed(self) -> bool:
        """405 with Allow unless the request uses one of `methods`."""
        if self.scope.get("method") in self.methods:
            return True
        allowed = ", ".join(self.methods)
        error = RouterError(405, f"method not allowed; use {allowed}", error_type="invalid_request_error")
        await self.json(405, error.to_dict(), [(b"allow", allowed.encode())])
        return False

    async def authorized(self) -> Tenant | None:
        """The caller's tenant; None after answering 401 when auth is on and the key is not valid."""
        header = None
        for name, value in self.scope.get("headers") or []:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        key = auth.bearer_key(header)
        if not auth.auth_required():
            auth.warn_open_once()
            return await auth.open_tenant(key)
        tenant = await auth.authenticate(key) if key is not None else None
        if tenant is not None:
            return tenant
        message = auth.MISSING_KEY if key is None else auth.WRONG_KEY
        await self.json(401, auth.error_body(message), [(b"www-authenticate", b'Bearer realm="generation"')])
        return None


class GenerationConsumer(GatewayConsumer):
    """POST /generate, /api/generate, /v1/completions, /v1/chat/completions (`kind` per route)."""

    methods = ("POST",)
    kind: Kind = "generate"

    async def handle(self, body: bytes) -> None:
        """Parse, run and answer one generation request."""
        if not await self.method_allowed():
            return
        tenant = await self.authorized()
        if tenant is None:
            return
        service = get_router()
        tenancy = TenantRequest.for_service(tenant, service, self.arrived)
        try:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise RouterError(400, f"request body is not valid JSON: {exc}") from exc
            parsed = PARSERS[self.kind](data)
            await tenancy.admit(parsed.request, data)  # 403 out of scope, 429 past a limit: never queued
            await service.ready_for_generation()  # the workers' models and slots known, or 503
            if self.kind != "generate":  # the seed's /generate ignores `model`; OpenAI clients rely on it
                service.check_model(parsed.model)
            model = parsed.model or service.model_hint() or "unknown"
            events = generate_choices(service.client, parsed.request, parsed.choices.n, self.arrived,
                                      parsed.choices.best_of)
            if not parsed.stream:
                async with aclosing(events):
                    result = await collect(events)
                tenancy.outcome, tenancy.usage = "ok", result.done.usage
                await self.json(200, final_body(parsed, result, model))
                service.count(self.kind, "ok")
                return
            # Wait for the first event before answering, so that errors before the first token
            # (400 passthrough, 429, 502...) still get their HTTP status rather than a 200 stream.
            first = await _first_event(events)
            await self.send_headers(status=200, headers=_SSE)
            self.responded = True
            outcome = "ok"
            # The per-token loop: one formatting call and one ASGI send per event, straight to the
            # server (no generator or consumer layers in between; measured per streamed token).
            send = self.base_send
            # Asked after every send: a client gone takes (and credits) no further token.
            gone = client_gone_probe(send)
            formatter = SseFormatter(parsed, model)
            watch = tenancy.watch if tenancy.admitted else None  # counts tokens as they stream
            trace = delivery_trace.TRACE  # DELIVERY_TRACE: each token event once sent (off by default)
            async with aclosing(events):
                preamble = formatter.preamble()
                if preamble:
                    await send({"type": "http.response.body", "body": preamble, "more_body": True})
                event = first
                while event is not None:  # bounded: the client generator's waits all time out
                    chunk, last = formatter.event(event)
                    if watch is not None:
                        await watch(event)
                    if last:
                        if isinstance(event, ErrorEvent):
                            outcome = "failed"
                        self.complete = True
                        await send({"type": "http.response.body", "body": chunk, "more_body": False})
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if trace is not None and isinstance(event, TokenEvent):
                        # An event without text is no event to the benchmark's client: named apart.
                        point = "router_out" if event.text else "router_out_blank"
                        trace.mark(point, parsed.request.request_id, len(event.token_ids))
                    if gone():
                        # Closing the events (aclosing) aborts the request on both workers now,
                        # before the next read would credit the decode worker for a dropped event.
                        outcome = "aborted"
                        break
                    event = await anext(events, None)
                else:
                    await self.send_body(SSE_DONE)
            service.count(self.kind, outcome)
            tenancy.outcome = outcome
        except RouterError as exc:
            tenancy.outcome = _outcome(exc.status)
            service.count(self.kind, tenancy.outcome)
            if not self.responded:
                await self.error(exc)
        except asyncio.CancelledError:
            tenancy.outcome = "aborted"
            service.count(self.kind, "aborted")
            raise
        finally:
            await tenancy.finish()


class GenerateConsumer(GenerationConsumer):
    """POST /generate and /api/generate: the seed's JSON; SSE with `"stream": true`."""

    kind = "generate"


class CompletionsConsumer(GenerationConsumer):
    """POST /v1/completions (OpenAI)."""

    kind = "completion"


class ChatCompletionsConsumer(GenerationConsumer):
    """POST /v1/chat/completions (OpenAI); the decode worker applies the chat template."""

    kind = "chat"


async def _first_event(events: AsyncIterator[Event]) -> Event | None:
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except BaseException:
        # The generator already ran its cleanup as the exception left it; this is for safety.
        closer = getattr(events, "aclose", None)
        if closer is not None:
            await closer()
        raise


class ModelsConsumer(GatewayConsumer):
    """GET /v1/models: the model names the workers report on GET /info (cached briefly)."""

    async def handle(self, body: bytes) -> None:
        """List the served models."""
        if not await self.method_allowed() or not await self.authorized():
            return
        try:
            service = get_router()
            if not service.pool.all_endpoints():
                raise RouterError(503, "no endpoints configured")
            infos = await service.pool.worker_info(max_age_s=_MODELS_CACHE_S)
            if not infos:
                raise RouterError(502, "no backend reachable: no worker answered GET /info")
        except RouterError as exc:
            await self.error(exc)
            return
        data: list[dict[str, Any]] = []
        seen: set[str] = set()
        for info in infos:
            name = info.get("model")
            if isinstance(name, str) and name and name not in seen:
                seen.add(name)
                entry: dict[str, Any] = {
                    "id": name,
                    "object": "model",
                    "created": int(service.started_at),
                    "owned_by": "disagg-platform",
                }
                if isinstance(info.get("context_length"), int):
                    entry["max_model_len"] = info["context_length"]
                data.append(entry)
        for alias, served in sorted(service.model_aliases.items()):
            if served in seen and alias not in seen:
                seen.add(alias)
                data.append({"id": alias, "object": "model", "created": int(service.started_at),
                             "owned_by": "disagg-platform", "root": served})
        await self.json(200, {"object": "list", "data": data})


class HealthConsumer(GatewayConsumer):
    """GET /health: the router is up; `ready` says whether a prefill and a decode worker are in rotation.

    Open without an API key (load balancers call it). It reads state only: the checks themselves
    run in their own thread. Once every worker was checked, the router's HTTP protocol answers
    a plain probe before it reaches this consumer (inference/gateway/http_protocol.py).
    """

    async def handle(self, body: bytes) -> None:
        """Answer from the pool's state."""
        service = await self.admitted_service(auth=False)
        if service is None:
            return
        pool = service.pool
        if any(endpoint.last_health_at is None for endpoint in pool.all_endpoints()):
            # Right after start (or an endpoint change) nothing was checked yet: check now, so that
            # `ready` is never the optimistic default. Bounded by the health-check timeouts.
            await pool.check_all()
        await self.json(200, health_body(service))


class StatusConsumer(GatewayConsumer):
    """GET /router/status: every endpoint's health, load, failures and last health answer."""

    async def handle(self, body: bytes) -> None:
        """Answer the full status."""
        service = await self.admitted_service(auth=True)
        if service is None:
            return
        await self.json(200, service.status())


class MetricsConsumer(GatewayConsumer):
    """GET /metrics: the router's Prometheus series (open like the workers' /metrics)."""

    async def handle(self, body: bytes) -> None:
        """Render the registry."""
        service = await self.admitted_service(auth=False)
        if service is None:
            return
        await self.send_headers(status=200, headers=[(b"content-type", CONTENT_TYPE.encode())])
        self.responded = True
        await self.send_body(service.metrics.render())
