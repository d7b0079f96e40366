"""The worker's HTTP API (Starlette): health, metrics, info, abort, KV events, the tokenizer (for a
router that tokenizes), and the role's internal call
(`/internal/decode` on a decode worker, `/internal/prefill` on a prefill worker)."""
from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from inference.server import credit
from inference.server.decode import DecodeWorker
from inference.server.errors import WorkerError, bad_request
from inference.server.kv_events import kv_events_handler
from inference.server.local_prefill import open_local
from inference.server.prefill import PrefillWorker
from inference.server.tokenizer_spec import tokenizer_handler
from inference.server.worker import Worker

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 2**20
# An answer given before the whole body was read reaches most HTTP clients only if the rest is read
# too: httpx, for one, is still writing and sees the connection reset instead of the 413. So the
# rest is read and dropped, up to this much; past it the answer goes out with `Connection: close`.
DRAIN_LIMIT_BYTES = 4 * MAX_BODY_BYTES
Handler = Callable[[Request], Awaitable[Response]]


# Seconds a client is told to wait after a 429 (queue or KV pool full); work drains within that.
RETRY_AFTER_S = 1


def _error(exc: WorkerError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


class _ClientGone(Exception):
    """The caller hung up while its body was being read: there is nobody to answer."""


async def _json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, read chunk by chunk under MAX_BODY_BYTES (413 past it)."""
    too_large = WorkerError(413, f"request body over {MAX_BODY_BYTES} bytes", "request_too_large")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    # Read chunk by chunk: a chunked body has no Content-Length, and request.body() would hold all
    # of it in memory before any check.
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
    except ClientDisconnect as exc:
        raise _ClientGone from exc
    request.state.body_read = True
    return _json_object(raw)


def _json_object(raw: bytes | bytearray) -> dict[str, Any]:
    """`raw` parsed as a JSON object (400 otherwise)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep for the parser
        raise bad_request(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body


async def _credited_body(request: Request, header: str) -> tuple[dict[str, Any], credit.StreamCredit]:
    """A credited decode request (inference/server/credit.py): its JSON (the body's first line) and
    its credit, fed with the acknowledgements that came with it. The rest of the body is the credit
    stream: never drained before an answer."""
    try:
        stream_credit = credit.StreamCredit(credit.parse_credit(header))
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    request.state.body_read = True
    try:
        line, more, ended = await credit.read_first_line(request.receive, MAX_BODY_BYTES)
    except ClientDisconnect as exc:
        raise _ClientGone from exc
    except ValueError as exc:
        raise WorkerError(413, f"request body over {MAX_BODY_BYTES} bytes", "request_too_large") from exc
    body = _json_object(line)
    stream_credit.feed(more)
    if ended:  # no acknowledgement can come: the stream must not wait for one
        stream_credit.close()
    return body, stream_credit


async def _drain(request: Request) -> bool:
    """Read and drop what is left of the body (bounded); False when it went past the bound."""
    if getattr(request.state, "body_read", False):
        return True
    if credit.HEADER in request.headers:
        # A credited body ends only after the response: draining first would wait forever.
        return False
    dropped = 0
    try:
        async for chunk in request.stream():
            dropped += len(chunk)
            if dropped > DRAIN_LIMIT_BYTES:
                return False
    except ClientDisconnect:
        return True  # nobody left to answer; nothing to protect
    except RuntimeError:  # "Stream consumed": everything was read already
        return True
    return True


def _internal(worker: Worker, handler: Handler) -> Handler:
    """Internal endpoints accept only callers holding the platform's shared secret (when set)."""

    async def checked(request: Request) -> Response:
        """The secret first (before the body is parsed), then the handler; errors as JSON."""
        secret = worker.args.shared_secret
        if secret:
            given = request.headers.get("x-platform-secret", "")
            # As bytes: compare_digest raises TypeError (a 500) for non-ASCII str, and header
            # values are latin-1 decoded text the caller controls.
            if not hmac.compare_digest(given.encode("latin-1"), secret.encode()):
                return JSONResponse(
                    {"error": {"message": "missing or wrong X-Platform-Secret", "type": "unauthorized"}},
                    status_code=401,
                )
        try:
            return await handler(request)
        except WorkerError as exc:
            return _error(exc)

    async def wrapped(request: Request) -> Response:
        """Every error answer readable by every client; a caller that hung up, a quiet close."""
        try:
            response = await checked(request)
        except _ClientGone:
            # The router gave up on this request (it sends /internal/abort too): not a fault here.
            logger.info("%s: the caller closed the connection while sending its body", request.url.path)
            return Response(status_code=499)  # never sent: the connection is gone
        return await _closing_unread(request, response)

    return wrapped


async def _closing_unread(request: Request, response: Response) -> Response:
    """An error answer given before the body was read: drain the body, or close after answering."""
    if response.status_code >= 400 and not await _drain(request):
        response.headers["Connection"] = "close"
    return response


async def _not_found(request: Request, exc: Exception) -> Response:
    """An unknown path (including the other role's endpoints) as a JSON 404."""
    response = JSONResponse(
        {"error": {"message": f"no {request.method} {request.url.path} on this worker", "type": "not_found"}},
        status_code=404,
    )
    return await _closing_unread(request, response)


def _common_routes(worker: Worker) -> list[Route]:
    """What both roles serve: health, metrics, info, models, abort."""

    async def health(request: Request) -> Response:
        return JSONResponse(worker.health())

    async def metrics(request: Request) -> Response:
        return Response(worker.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def info(request: Request) -> Response:
        return JSONResponse(worker.info())

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": worker.model_name, "object": "model", "owned_by": "platform"}]}
        )

    async def abort(request: Request) -> Response:
        body = await _json_body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("'request_id' must be a non-empty string")
        await worker.abort(request_id)
        return JSONResponse({"aborted": request_id})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/internal/abort", _internal(worker, abort), methods=["POST"]),
        Route("/internal/kv-events", _internal(worker, kv_events_handler(worker.kv_events)), methods=["GET"]),
        Route("/internal/tokenizer", _internal(worker, tokenizer_handler(worker.model_name, worker.engine.tokenizer)),
              methods=["GET"]),
    ]


def _decode_routes(worker: DecodeWorker) -> list[Route]:
    """`POST /internal/decode`: the NDJSON stream (inference.wire.stream's lines), credited when the
    router sends credit."""

    async def decode(request: Request) -> Response:
        credit_header = request.headers.get(credit.HEADER)
        stream_credit = None
        if credit_header is None:
            body = await _json_body(request)
        else:
            body, stream_credit = await _credited_body(request, credit_header)
        server = request.scope.get("server") or ("127.0.0.1", 0)
        # A prompt this worker holds nearly all of, when the router offers it, is prefilled here.
        events = await open_local(worker, body, stream_credit)
        if events is None:
            events = await worker.open_decode(body, str(server[0]), stream_credit)

        if stream_credit is not None:
            return credit.CreditedStreamResponse(events, stream_credit, media_type="application/x-ndjson")
        return StreamingResponse(events, media_type="application/x-ndjson")

    return [Route("/internal/decode", _internal(worker, decode), methods=["POST"])]


def _prefill_routes(worker: PrefillWorker) -> list[Route]:
    """`POST /internal/prefill`: compute, send the KV, answer with the first token."""

    async def prefill(request: Request) -> Response:
        body = await _json_body(request)
        return JSONResponse(await worker.prefill(body))

    return [Route("/internal/prefill", _internal(worker, prefill), methods=["POST"])]


def create_app(worker: Worker) -> Starlette:
    """The Starlette application serving one worker: the common routes and its role's own (the other
    role's endpoints answer 404 like any unknown path)."""
    role_routes = _decode_routes(worker) if isinstance(worker, DecodeWorker) else _prefill_routes(worker)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.stop()

    return Starlette(
        routes=[*_common_routes(worker), *role_routes],
        exception_handlers={404: _not_found},
        lifespan=lifespan,
    )
