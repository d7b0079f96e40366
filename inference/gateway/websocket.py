"""Channels consumers: ws/generate streams a generation over a WebSocket.

The client sends the /generate JSON; the server answers `{"type": "token", "text", "token_ids"}`
messages and one final `{"type": "done", ...}` (or `{"type": "error", ...}`). A socket runs one
generation at a time and may send the next request after the final message. Closing the socket
cancels the generation, which aborts it on both workers. Each generation counts against the API
key's limits like an HTTP one (inference/gateway/tenancy.py): past one, an error message with status 429.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from contextlib import aclosing
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from inference.gateway import auth
from inference.gateway.api_keys import Tenant
from inference.gateway.service import get_router
from inference.gateway.tenancy import TenantRequest
from inference.router import DoneEvent, ErrorEvent, RouterError, TokenEvent
from inference.router.answers import done_fields
from inference.router.protocol import ParsedRequest, parse_generate

logger = logging.getLogger(__name__)


class GenerateSocketConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]
    """ws/generate: one generation at a time per socket, streamed as JSON messages."""

    # A generation streams straight from the workers to this socket; no channel layer is needed,
    # and naming one that is not configured keeps the router from depending on Redis for it.
    channel_layer_alias = "inference-router-none"

    async def connect(self) -> None:
        """Accept the socket (its key was checked by WebSocketAuthMiddleware; here it names the tenant)."""
        self._task: asyncio.Task[None] | None = None
        header = next((bytes(v).decode("latin-1") for k, v in self.scope.get("headers") or []
                       if k.lower() == b"authorization"), None)
        key = auth.bearer_key(header)
        tenant = await auth.authenticate(key) if auth.auth_required() and key else None
        self._tenant: Tenant = tenant or await auth.open_tenant(key)
        await self.accept()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any) -> None:
        """Decode a JSON message; a malformed one gets an error message, not a dropped socket."""
        limit = int(getattr(settings, "ROUTER_MAX_WS_MESSAGE_BYTES", 1_000_000))
        size = len(text_data.encode("utf-8", "surrogatepass")) if text_data is not None else len(bytes_data or b"")
        if size > limit:
            # Same limit as an HTTP body; 1009 is the WebSocket close code for "message too big".
            await self._send_error(RouterError(413, f"message is larger than {limit} bytes"))
            await self.close(code=1009)
            return
        raw = text_data if text_data is not None else (bytes_data or b"").decode("utf-8", errors="replace")
        try:
            content = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            await self._send_error(RouterError(400, f"message is not valid JSON: {exc}"))
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Start a generation for a /generate JSON message."""
        if self._task is not None and not self._task.done():
            await self._send_error(RouterError(409, "a generation is already running on this socket"))
            return
        try:
            if isinstance(content, dict):
                content = {k: v for k, v in content.items() if k != "stream"}  # always streamed here
            parsed = parse_generate(content)
        except RouterError as exc:
            await self._send_error(exc)
            return
        self._task = asyncio.create_task(self._run(parsed, content))

    async def _run(self, parsed: ParsedRequest, content: Any) -> None:
        parts: list[str] = []
        tenancy: TenantRequest | None = None
        try:
            service = get_router()
            tenancy = TenantRequest.for_service(self._tenant, service)
            await tenancy.admit(parsed.request, content)  # 403 out of scope, 429 past a limit
            await service.ready_for_generation()  # the workers' models and slots known, or an error
            events = service.client.generate(parsed.request)
            tenancy.outcome = "ok"
            async with aclosing(events):
                async for event in events:
                    await tenancy.watch(event)
                    if isinstance(event, TokenEvent):
                        parts.append(event.text)
                        await self.send_json({"type": "token", "text": event.text, "token_ids": event.token_ids})
                    elif isinstance(event, DoneEvent):
                        await self.send_json({"type": "done", "text": "".join(parts), **done_fields(event)})
                    elif isinstance(event, ErrorEvent):
                        tenancy.outcome = "failed"
                        await self._send_error(RouterError(event.status, event.message))
        except RouterError as exc:
            if tenancy is not None:
                tenancy.outcome = "rejected" if exc.status == 429 else "client_error" if exc.status < 500 else "failed"
            await self._send_error(exc)
        except asyncio.CancelledError:
            if tenancy is not None:
                tenancy.outcome = "aborted"
            raise
        except Exception as exc:  # noqa: BLE001  a send to a socket that just closed, mostly
            logger.info("ws/generate ended: %s", exc)
        finally:
            if tenancy is not None:
                await tenancy.finish()

    async def _send_error(self, exc: RouterError) -> None:
        with contextlib.suppress(Exception):  # the socket may be gone already
            message: dict[str, Any] = {
                "type": "error",
                "status": exc.status,
                "message": exc.message,
                "error_type": exc.error_type,
            }
            if exc.backends:
                message["backends"] = exc.backends
            await self.send_json(message)

    async def disconnect(self, code: int) -> None:
        """The client left: cancel the generation (its cleanup aborts it on both workers)."""
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            task.cancel()
            # Bounded: the cleanup's abort posts have their own short timeouts.
            await asyncio.wait({task}, timeout=10.0)
