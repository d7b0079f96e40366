"""Stand-in prefill and decode workers for router tests.

Small Starlette apps served by uvicorn on 127.0.0.1 ephemeral ports, in threads, following the
worker internal API of docs/internals.md. The "KV transfer" is an in-process handoff (`KVBus`): the
prefill stand-in delivers the first token for a descriptor's token, and the decode stand-in waits
for it before streaming, so a router that skips or botches the prefill call is caught.
Each stand-in's `behavior` can be switched by the test while it runs. Like a real worker, a stand-in
publishes its KV events (`GET /internal/kv-events`: a snapshot of an empty prefix cache, then
keepalives; `kv_events = False` answers 404, as a worker that does not publish them) and has no
tokenizer to share (`GET /internal/tokenizer` answers 404, as a worker whose model has no fast
tokenizer), so a kv-aware router (the default) routes them by load.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.ports import allocator

FIRST_TOKEN = 42
KV_WAIT_S = 5.0
# A real worker's keepalive on a quiet KV event stream (inference/server/kv_events.py).
KV_KEEPALIVE_S = 2.0


class KVBus:
    """Thread-safe handoff from prefill stand-ins to decode stand-ins, keyed by descriptor token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delivered: dict[str, int] = {}

    def deliver(self, token: str, first_token: int) -> None:
        """The prefill side "wrote the KV" for `token`."""
        with self._lock:
            self._delivered[token] = first_token

    def take(self, token: str) -> int | None:
        """The first token delivered for `token`, once; None while nothing arrived."""
        with self._lock:
            return self._delivered.pop(token, None)


def free_port() -> int:
    """A port nothing listens on right now (for a dead endpoint), reserved by this process and outside the
    kernel's range for "any free" binds, so that no worker's listener lands there meanwhile."""
    return allocator().allocate()


def dead_url() -> str:
    """The URL of an endpoint that refuses connections."""
    return f"http://127.0.0.1:{free_port()}"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class StandIn:
    """One stand-in worker (role "prefill" or "decode") on its own uvicorn thread.

    Decode behaviors: ok, http400, http401, http429, http500, no_descriptor (hangs before its first line),
    error_line (error line instead of the first token), die_after_first_token. Prefill behaviors:
    ok, http400, http429, http500, hang, lease_expired_once (409 `lease_expired`, then ok),
    kv_transfer_error_once (502 `kv_transfer_error`, then ok).
    Health: "healthy", "unhealthy" (status field) or "http500". A decode stand-in's lease is
    `kv_wait_s`: without KV by then it sends the worker's `reason: kv_timeout` error line.
    """

    def __init__(self, role: str, bus: KVBus, model: str = "stub-model") -> None:
        self.role = role
        self.bus = bus
        self.model = model
        self.behavior = "ok"
        self.health = "healthy"
        self.token_delay_s = 0.0
        self.kv_wait_s = KV_WAIT_S
        self.requests: list[dict[str, Any]] = []
        self.secrets: list[str | None] = []  # X-Platform-Secret of each internal request
        self.aborts: list[str] = []
        self.closed_early: list[str] = []  # decode streams the client closed before the end
        self.health_calls = 0
        self.kv_events = True  # serve GET /internal/kv-events (False: 404)
        self.kv_subscriptions = 0
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -------------------------------------------------------------------------------- control

    def reset(self) -> None:
        """Back to a healthy, well-behaved worker with empty logs."""
        self.behavior = "ok"
        self.health = "healthy"
        self.token_delay_s = 0.0
        self.kv_wait_s = KV_WAIT_S
        self.kv_events = True
        with self._lock:
            self.requests.clear()
            self.secrets.clear()
            self.aborts.clear()
            self.closed_early.clear()
            self.health_calls = 0

    def start(self) -> StandIn:
        """Serve on an ephemeral port; returns self once it accepts connections."""
        app = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/info", self._info),
                Route("/internal/abort", self._abort, methods=["POST"]),
                Route("/internal/decode", self._decode, methods=["POST"]),
                Route("/internal/prefill", self._prefill, methods=["POST"]),
                Route("/internal/kv-events", self._kv_events),
                Route("/internal/tokenizer", self._tokenizer),
            ]
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"stand-in-{self.role}"
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        """Stop serving (bounded)."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait_for(self, what: str, count: int = 1, timeout: float = 5.0, request_id: str | None = None) -> list[Any]:
        """Poll until the log `what` ("aborts", "requests", "closed_early") holds `count` entries.

        With `request_id`, only the ids of that request (and its retries, `<id>-rN`) count: an abort an
        earlier test posted may still land after this test's reset on a loaded machine."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                items = list(getattr(self, what))
            if request_id is not None:
                items = [i for i in items if i == request_id or str(i).startswith(f"{request_id}-")]
            if len(items) >= count or time.monotonic() > deadline:
                return items
            time.sleep(0.01)

    # -------------------------------------------------------------------------------- routes

    async def _health(self, request: Request) -> Response:
        self.health_calls += 1
        if self.health == "http500":
            return _error(500, "health broken", "server_error")
        status = "healthy" if self.health == "healthy" else "unhealthy"
        return JSONResponse(
            {"status": status, "cpu_utilization": 0.1, "role": self.role, "model": self.model,
             "queue_depth": 0, "running": 0, "kv_usage": 0.0}
        )

    async def _info(self, request: Request) -> Response:
        return JSONResponse(
            {"role": self.role, "model": self.model, "model_path": "/models/stub", "context_length": 2048,
             "block_size": 16, "max_tokens_limit": 4096}
        )

    async def _kv_events(self, request: Request) -> Response:
        if not self.kv_events:
            return _error(404, "Not Found", "not_found")
        with self._lock:
            self.kv_subscriptions += 1

        async def lines() -> AsyncIterator[bytes]:
            yield _line({"type": "snapshot", "role": self.role, "block_size": 16, "epoch": f"stand-in-{id(self)}",
                         "seq": 0, "hashes": []})
            for _ in range(3600):  # an hour of keepalives at most; the router hangs up first
                await asyncio.sleep(KV_KEEPALIVE_S)
                if not self.kv_events:
                    return  # as a worker restarting into one that does not publish
                yield _line({"type": "keepalive"})

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _tokenizer(self, request: Request) -> Response:
        return _error(404, "this worker's model has no fast (Rust) tokenizer to share", "not_found")

    async def _abort(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.aborts.append(body.get("request_id"))
        return JSONResponse({"ok": True})

    async def _decode(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
            self.secrets.append(request.headers.get("x-platform-secret"))
        behavior = self.behavior
        if behavior == "http401":
            return _error(401, "missing or wrong X-Platform-Secret", "unauthorized")
        if behavior == "http400":
            return _error(400, "prompt is longer than the context length (2048 tokens)")
        if behavior == "http429":
            return _error(429, "KV pool full", "overloaded")
        if behavior == "http500":
            return _error(500, "decode worker exploded", "server_error")
        request_id = body["request_id"]
        if "input_ids" in body:
            prompt_ids = list(body["input_ids"])
        elif "messages" in body:
            prompt_ids = list(range(3 * len(body["messages"])))
        else:
            prompt_ids = list(range(len(str(body.get("prompt", "")).split()) or 1))
        max_tokens = int(body.get("sampling", {}).get("max_tokens", 16))
        token = uuid.uuid4().hex
        descriptor = {
            "request_id": request_id, "transport": "tcp", "host": "127.0.0.1", "port": 1,
            "block_ids": [0], "num_tokens": len(prompt_ids),
            "layout": {"num_layers": 1, "block_size": 16, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"},
            "lease_expires_at": time.time() + 30, "token": token,
        }

        async def lines() -> AsyncIterator[bytes]:
            finished = False
            try:
                if behavior == "no_descriptor":
                    await asyncio.sleep(30)
                yield _line({"type": "descriptor", "descriptor": descriptor, "prompt_token_ids": prompt_ids})
                started = time.monotonic()
                first = None
                while first is None:  # wait for the "KV" (bounded)
                    first = self.bus.take(token)
                    if first is None:
                        if time.monotonic() - started > self.kv_wait_s:
                            yield _line({"type": "error", "reason": "kv_timeout", "message": "KV never arrived"})
                            finished = True
                            return
                        await asyncio.sleep(0.005)
                if behavior == "error_line":
                    yield _line({"type": "error", "message": "lease expired"})
                    finished = True
                    return
                for i in range(max_tokens):
                    token_id = first if i == 0 else 100 + i
                    yield _line({"type": "token", "token_ids": [token_id], "text": f" t{i}"})
                    if behavior == "die_after_first_token":
                        finished = True  # ends the response without a done line
                        return
                    if self.token_delay_s:
                        await asyncio.sleep(self.token_delay_s)
                yield _line(
                    {"type": "done", "finish_reason": "length",
                     "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": max_tokens},
                     "timings": {"kv_wait_s": 0.001, "decode_s": 0.01}}
                )
                finished = True
            finally:
                if not finished:
                    with self._lock:
                        self.closed_early.append(request_id)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _prefill(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.requests.append(body)
        behavior = self.behavior
        if behavior == "http400":
            return _error(400, "bad prompt for prefill")
        if behavior == "http429":
            return _error(429, "prefill queue full", "overloaded")
        if behavior == "http500":
            return _error(500, "prefill worker exploded", "server_error")
        if behavior == "hang":
            await asyncio.sleep(30)
        if behavior == "lease_expired_once":
            self.behavior = "ok"
            return _error(409, "the decode lease has expired", "lease_expired")
        if behavior == "kv_transfer_error_once":  # the decode worker vanished during the KV send
            self.behavior = "ok"
            return _error(502, "KV transfer failed: peer closed after 0 of 4 bytes", "kv_transfer_error")
        descriptor = body.get("descriptor") or {}
        if descriptor.get("request_id") != body.get("request_id") or not isinstance(body.get("prompt_token_ids"), list):
            return _error(400, "descriptor does not match the request")
        self.bus.deliver(descriptor["token"], FIRST_TOKEN)
        return JSONResponse({"first_token": FIRST_TOKEN, "kv_bytes": 4096, "prefill_s": 0.01, "transfer_s": 0.002})


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"


class Cluster:
    """Two prefill and two decode stand-ins sharing one KV bus."""

    def __init__(self) -> None:
        self.bus = KVBus()
        self.prefill = [StandIn("prefill", self.bus).start() for _ in range(2)]
        self.decode = [StandIn("decode", self.bus).start() for _ in range(2)]

    @property
    def prefill_urls(self) -> list[str]:
        """URLs of the prefill stand-ins."""
        return [s.url for s in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        """URLs of the decode stand-ins."""
        return [s.url for s in self.decode]

    def all(self) -> list[StandIn]:
        """Every stand-in."""
        return self.prefill + self.decode

    def reset(self) -> None:
        """Reset every stand-in."""
        for stand_in in self.all():
            stand_in.reset()

    def stop(self) -> None:
        """Stop every stand-in."""
        for stand_in in self.all():
            stand_in.stop()
