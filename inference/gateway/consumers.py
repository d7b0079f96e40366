"""The router's public HTTP API as thin Django async views over `inference.router`.

POST /generate and /api/generate (the seed's JSON), POST /v1/completions and /v1/chat/completions
(OpenAI, streaming included), GET /v1/models, GET /health and GET /router/status. All are exempt
from CSRF: they are an API for programs, not forms.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference.router import RouterError
from inference.router.pd_client import Event
from inference.router.protocol import PARSERS, Kind, collect, final_body, sse_stream
from inference.router_service import RouterService, get_router

logger = logging.getLogger(__name__)

_MODELS_CACHE_S = 10.0

View = Callable[[HttpRequest], Awaitable[HttpResponse]]


class EventStreamResponse(StreamingHttpResponse):
    """A Server-Sent Events response that closes its source when the client goes away.

    Django's ASGI handler cancels the response task when the client disconnects and closes only
    the outermost iterator it made from the response; the generator we passed in would be left
    for the garbage collector. Closing it here runs its cleanup at once, which closes the
    client generator and aborts the request on both workers.
    """

    def __init__(self, source: AsyncIterator[bytes]) -> None:
        super().__init__(source, content_type="text/event-stream")
        self._source = source
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"  # nginx: pass events through as they come

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        try:
            async for part in super().__aiter__():
                yield part
        finally:
            closer = getattr(self._source, "aclose", None)
            if closer is not None:
                await closer()


def error_response(exc: RouterError) -> JsonResponse:
    """The JSON error answer for a RouterError (`{"error": {"message", "type", ...}}`)."""
    response = JsonResponse(exc.to_dict(), status=exc.status)
    if exc.status == 429:
        response["Retry-After"] = "1"
    return response


def _method_not_allowed(allowed: str) -> JsonResponse:
    response = JsonResponse(
        RouterError(405, f"method not allowed; use {allowed}", error_type="invalid_request_error").to_dict(),
        status=405,
    )
    response["Allow"] = allowed
    return response


def read_json(request: HttpRequest) -> Any:
    """The request's JSON body: 413 when over ROUTER_MAX_BODY_BYTES, 400 when not JSON."""
    limit = int(settings.ROUTER_MAX_BODY_BYTES)
    too_big = RouterError(413, f"request body is larger than {limit} bytes", error_type="invalid_request_error")
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        raise too_big
    try:
        body = request.body
    except RequestDataTooBig:
        raise too_big from None
    if len(body) > limit:  # a chunked body has no Content-Length to check up front
        raise too_big
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise RouterError(400, f"request body is not valid JSON: {exc}") from exc


async def _generation(request: HttpRequest, kind: Kind) -> HttpResponse:
    """Parse, run and answer one generation request of the given kind."""
    if request.method != "POST":
        return _method_not_allowed("POST")
    try:
        parsed = PARSERS[kind](read_json(request))
        service = get_router()
        model = parsed.model or service.model_hint() or "unknown"
        events = service.client.generate(parsed.request)
        if not parsed.stream:
            async with aclosing(events):
                result = await collect(events)
            return JsonResponse(final_body(parsed, result, model))
        # Wait for the first event before answering, so that errors before the first token
        # (400 passthrough, 429, 502...) still get their HTTP status rather than a 200 stream.
        first = await _first_event(events)
        return EventStreamResponse(sse_stream(parsed, first, events, model))
    except RouterError as exc:
        return error_response(exc)
    except Exception:  # noqa: BLE001  API clients get JSON, never Django's HTML error page
        logger.exception("%s request failed", kind)
        return error_response(RouterError(500, "internal router error", error_type="server_error"))


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


@csrf_exempt
async def generate(request: HttpRequest) -> HttpResponse:
    """POST /generate and /api/generate: the seed's JSON; SSE with `"stream": true`."""
    return await _generation(request, "generate")


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions (OpenAI)."""
    return await _generation(request, "completion")


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/chat/completions (OpenAI); the decode worker applies the chat template."""
    return await _generation(request, "chat")


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    """GET /v1/models: the model names the workers report on GET /info (cached briefly)."""
    if request.method != "GET":
        return _method_not_allowed("GET")
    try:
        service = get_router()
        if not service.pool.all_endpoints():
            raise RouterError(503, "no endpoints configured")
        infos = await service.pool.worker_info(max_age_s=_MODELS_CACHE_S)
        if not infos:
            raise RouterError(502, "no backend reachable: no worker answered GET /info")
    except RouterError as exc:
        return error_response(exc)
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
    return JsonResponse({"object": "list", "data": data})


def _service_or_error() -> RouterService | JsonResponse:
    try:
        return get_router()
    except RouterError as exc:
        return error_response(exc)


@csrf_exempt
async def health(request: HttpRequest) -> HttpResponse:
    """GET /health: the router is up; `ready` says whether a prefill and a decode worker are in rotation."""
    if request.method != "GET":
        return _method_not_allowed("GET")
    service = _service_or_error()
    if isinstance(service, JsonResponse):
        return service
    pool = service.pool
    if any(endpoint.last_health_at is None for endpoint in pool.all_endpoints()):
        # Right after start (or an endpoint change) nothing was checked yet: check now, so that
        # `ready` is never the optimistic default. Bounded by the health-check timeouts.
        await pool.check_all()

    def brief(role: str) -> list[dict[str, Any]]:
        return [
            {"url": e.url, "healthy": e.healthy, "inflight": e.inflight, "last_error": e.last_error}
            for e in pool.endpoints(role)
        ]

    return JsonResponse(
        {
            "status": "healthy",
            "ready": pool.ready(),
            "policy": pool.policy_name,
            "prefill": brief("prefill"),
            "decode": brief("decode"),
        }
    )


@csrf_exempt
async def router_status(request: HttpRequest) -> HttpResponse:
    """GET /router/status: every endpoint's health, load, failures and last health answer."""
    if request.method != "GET":
        return _method_not_allowed("GET")
    service = _service_or_error()
    if isinstance(service, JsonResponse):
        return service
    return JsonResponse(service.status())
