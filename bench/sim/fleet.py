"""Many simulated workers in one asyncio process, each on its own port on 127.0.0.1.

    .venv/bin/python -m bench.sim.fleet --prefill 64 --decode 256 --ready-file /tmp/fleet.json

One aiohttp application serves every port (a listening socket per worker); a request finds its
worker by the local port it came in on. Once every socket listens, the URLs are written to
`--ready-file` (JSON: pid, prefill and decode URLs), atomically, so a starter can wait for the
file. SIGTERM or SIGINT stops the process. Besides the real worker API, each port answers
`POST /sim/kv` (the stand-in for the KV transfer from a prefill worker), `GET /sim/stats`
(requests served by path, for the whole process), `POST /sim/workers` (start workers of a role,
or stop some by URL) and `POST /sim/fault` (a worker's health checks answer unhealthy or not at
all); the POSTs need the shared secret when one is set, as the internal endpoints do.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.sim.config import SimConfig, add_arguments, from_arguments
from bench.sim.worker import SimWorker
from inference.server import credit as credit_protocol
from inference.server.errors import WorkerError, bad_request

LOOPBACK = "127.0.0.1"
# Workers one control call may start.
MAX_START = 1000
# What `POST /sim/fault` can make a worker's health check see (None: answer normally).
FAULTS = (None, "unhealthy", "silent")
# How long a `silent` worker holds a health check (past the router's 4 s timeout; bounded).
SILENT_S = 30.0
MAX_BODY_BYTES = 8 * 2**20
# Below the router's 3 s client keep-alive, as uvicorn's 5 s default on the real workers.
KEEPALIVE_S = 5.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_loopback(host: str) -> bool:
    """Whether `host` is an IPv4 loopback address (every 127.x.y.z is local on Linux)."""
    try:
        return ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        return False


def _error(exc: WorkerError) -> web.Response:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return web.json_response(exc.to_json(), status=exc.status, headers=headers)


def _object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except ValueError as exc:
        raise bad_request(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object")
    return body


class Fleet:
    """The workers of this process by port, their HTTP application, and request counters."""

    def __init__(self, config: SimConfig, secret: str = "", host: str = LOOPBACK) -> None:
        self.config = config
        self.secret = secret
        self.host = host
        self.workers: dict[int, SimWorker] = {}
        self._sites: dict[int, web.SockSite] = {}
        self.runner: web.AppRunner | None = None
        self.hits: collections.Counter[str] = collections.Counter()
        self.started_at = time.time()
        self._client: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ workers
    async def start_worker(self, role: str, port: int = 0) -> SimWorker:
        """A new worker of `role`, listening on `port` of this fleet's host (0: a free one; after `setup`)."""
        if role not in ("prefill", "decode"):
            raise bad_request(f"role must be prefill or decode, not {role!r}")
        assert self.runner is not None, "setup() first"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, port))
        except OSError:
            sock.close()
            raise
        port = int(sock.getsockname()[1])
        worker = SimWorker(role, port, self.config, self.deliver_kv, host=self.host)
        site = web.SockSite(self.runner, sock, shutdown_timeout=1.0)
        await site.start()
        self.workers[port] = worker
        self._sites[port] = site
        return worker

    async def stop_worker(self, port: int) -> bool:
        """Stop listening on `port` and forget its worker (streams in progress end); False if unknown."""
        site = self._sites.pop(port, None)
        self.workers.pop(port, None)
        if site is None:
            return False
        await site.stop()
        return True

    def url(self, worker: SimWorker) -> str:
        """The base URL of `worker`."""
        return f"http://{self.host}:{worker.port}"

    async def setup(self) -> None:
        """Prepare the application runner that every port's site shares."""
        self.runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=KEEPALIVE_S,
                                    handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()

    def _worker(self, request: web.Request) -> SimWorker:
        transport = request.transport
        port = transport.get_extra_info("sockname")[1] if transport is not None else None
        worker = self.workers.get(port) if port is not None else None
        if worker is None:
            raise web.HTTPServiceUnavailable(text="connection gone")
        return worker

    async def deliver_kv(self, descriptor: dict[str, Any], first_token: int) -> int:
        """Hand a prefill's first token to the decode worker the descriptor names (the KV transfer):
        directly when it lives in this process, else over HTTP; the bytes a real transfer moves."""
        nbytes = len(descriptor.get("block_ids") or []) * self.config.block_nbytes
        request_id, token = str(descriptor["request_id"]), str(descriptor["token"])
        local = self.workers.get(int(descriptor["port"])) if descriptor["host"] == self.host else None
        if local is not None:
            if self.config.kv_transfer_s:
                await asyncio.sleep(self.config.kv_transfer_s)
            ok = local.kv_received(request_id, token, first_token, nbytes)
        else:
            if self._client is None:
                self._client = aiohttp.ClientSession(trust_env=False)
            url = f"http://{descriptor['host']}:{descriptor['port']}/sim/kv"
            try:
                async with self._client.post(url, json={"request_id": request_id, "token": token,
                                                        "first_token": first_token, "nbytes": nbytes},
                                             timeout=aiohttp.ClientTimeout(total=10)) as response:
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise WorkerError(502, f"KV transfer failed: {exc}", "kv_transfer_error") from exc
        if not ok:
            raise WorkerError(409, f"the decode lease of {request_id} was lost: nothing waits for its KV",
                              "lease_expired")
        return nbytes

    # ------------------------------------------------------------------ HTTP
    def internal(self, handler: Handler) -> Handler:
        """The shared secret first (when set), then the handler; WorkerErrors as JSON answers."""

        async def checked(request: web.Request) -> web.StreamResponse:
            if self.secret and not hmac.compare_digest(
                    request.headers.get("x-platform-secret", "").encode("latin-1"), self.secret.encode()):
                return web.json_response(
                    {"error": {"message": "missing or wrong X-Platform-Secret", "type": "unauthorized"}}, status=401)
            try:
                return await handler(request)
            except WorkerError as exc:
                return _error(exc)

        return checked

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise WorkerError(413, f"request body over {MAX_BODY_BYTES} bytes", "request_too_large")
        return _object(await request.read())

    async def health(self, request: web.Request) -> web.StreamResponse:
        self.hits["health"] += 1
        worker = self._worker(request)
        if worker.fault == "silent":  # a wedged process: no answer within any health timeout
            await asyncio.sleep(SILENT_S)
        if worker.fault == "unhealthy":
            return web.json_response({**worker.health(), "status": "unhealthy"}, status=503)
        return web.json_response(worker.health(), dumps=lambda o: orjson.dumps(o).decode())

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.hits["metrics"] += 1
        return web.Response(body=self._worker(request).render_metrics(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def info(self, request: web.Request) -> web.StreamResponse:
        self.hits["info"] += 1
        return web.json_response(self._worker(request).info())

    async def models(self, request: web.Request) -> web.StreamResponse:
        self.hits["models"] += 1
        return web.json_response({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "owned_by": "platform"}]})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        self.hits["decode"] += 1
        worker = self._worker(request)
        if worker.role != "decode":
            raise WorkerError(404, "this is a prefill worker: /internal/decode lives on decode workers")
        header = request.headers.get(credit_protocol.HEADER)
        credit: credit_protocol.StreamCredit | None = None
        if header is None:
            body = await self._body(request)
        else:
            try:
                credit = credit_protocol.StreamCredit(credit_protocol.parse_credit(header))
            except ValueError as exc:
                raise bad_request(str(exc)) from exc
            try:
                line = await request.content.readuntil(b"\n")
            except ValueError as exc:  # past the reader's limit
                raise WorkerError(413, "first line too long", "request_too_large") from exc
            body = _object(line)
        events = await worker.open_decode(body, credit)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        listener = asyncio.ensure_future(self._acks(request, credit)) if credit is not None else None
        try:
            await response.prepare(request)
            async for line in events:
                await response.write(line)
            await response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the router hung up: the stream ends here (its generator frees the blocks)
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            if listener is not None:
                listener.cancel()
        return response

    @staticmethod
    async def _acks(request: web.Request, credit: credit_protocol.StreamCredit) -> None:
        """Feed the request body's acknowledgement lines to `credit` until the body ends."""
        try:
            while True:  # ends with the body (or the handler cancels it)
                data = await request.content.readany()
                if not data:
                    break
                credit.feed(data)
        finally:
            credit.close()

    async def kv_events(self, request: web.Request) -> web.StreamResponse:
        """The worker's KV event stream (the real `KVEventSource` over its simulated prefix cache)."""
        self.hits["kv_events"] += 1
        lines = self._worker(request).kv_events.lines()
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await response.prepare(request)
            async for line in lines:  # until the router hangs up or the fleet stops
                await response.write(line)
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            pass  # the router left: its subscription ends here
        finally:
            await lines.aclose()  # type: ignore[attr-defined]
        return response

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        self.hits["prefill"] += 1
        worker = self._worker(request)
        if worker.role != "prefill":
            raise WorkerError(404, "this is a decode worker: /internal/prefill lives on prefill workers")
        return web.json_response(await worker.prefill(await self._body(request)))

    async def abort(self, request: web.Request) -> web.StreamResponse:
        self.hits["abort"] += 1
        body = await self._body(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("'request_id' must be a non-empty string")
        self._worker(request).abort(request_id)
        return web.json_response({"aborted": request_id})

    async def kv(self, request: web.Request) -> web.StreamResponse:
        self.hits["kv"] += 1
        body = await self._body(request)
        try:
            ok = self._worker(request).kv_received(str(body["request_id"]), str(body["token"]),
                                                   int(body["first_token"]), int(body.get("nbytes", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise bad_request(f"bad KV message: {exc}") from exc
        return web.json_response({"ok": ok}, status=200 if ok else 409)

    async def control_workers(self, request: web.Request) -> web.StreamResponse:
        """`POST /sim/workers {"role", "count"}`: start workers; `{"stop": [urls]}`: stop those."""
        body = await self._body(request)
        if "stop" in body:
            urls = body["stop"]
            if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise bad_request("'stop' must be a list of worker URLs")
            stopped = [u for u in urls if await self.stop_worker(int(u.rsplit(":", 1)[-1].rstrip("/")))]
            return web.json_response({"stopped": stopped})
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_START:
            raise bad_request(f"'count' must be an integer in [1, {MAX_START}]")
        started = [self.url(await self.start_worker(str(body.get("role")))) for _ in range(count)]
        return web.json_response({"started": started})

    async def control_fault(self, request: web.Request) -> web.StreamResponse:
        """`POST /sim/fault {"url", "fault"}`: make a worker's /health answer `unhealthy`, stay `silent`,
        or (null) answer normally again."""
        body = await self._body(request)
        fault = body.get("fault")
        if fault not in FAULTS:
            raise bad_request(f"'fault' must be one of {', '.join(map(str, FAULTS))}")
        port = str(body.get("url", "")).rsplit(":", 1)[-1].rstrip("/")
        worker = self.workers.get(int(port)) if port.isdigit() else None
        if worker is None:
            raise WorkerError(404, f"no simulated worker at {body.get('url')!r} in this process", "not_found")
        worker.fault = fault
        return web.json_response({"url": self.url(worker), "fault": fault})

    async def stats(self, request: web.Request) -> web.StreamResponse:
        roles = collections.Counter(w.role for w in self.workers.values())
        return web.json_response({"pid": os.getpid(), "workers": dict(roles), "hits": dict(self.hits),
                                  "uptime_s": round(time.time() - self.started_at, 3)})

    def app(self) -> web.Application:
        """The application every port serves."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/info", self.info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/internal/decode", self.internal(self.decode))
        app.router.add_post("/internal/prefill", self.internal(self.prefill))
        app.router.add_post("/internal/abort", self.internal(self.abort))
        app.router.add_get("/internal/kv-events", self.internal(self.kv_events))
        app.router.add_post("/sim/kv", self.internal(self.kv))
        app.router.add_get("/sim/stats", self.stats)
        app.router.add_post("/sim/workers", self.internal(self.control_workers))
        app.router.add_post("/sim/fault", self.internal(self.control_fault))
        return app

    async def close(self) -> None:
        """Close the KV client (if one was opened)."""
        if self._client is not None:
            await self._client.close()


def write_ready(path: Path, fleet: Fleet) -> None:
    """The URLs of every worker, written atomically (a starter waits for this file)."""
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for worker in fleet.workers.values():
        urls[worker.role].append(fleet.url(worker))
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **urls}))
    tmp.replace(path)


async def serve(config: SimConfig, prefill: int, decode: int, ready_file: Path | None, secret: str = "",
                stop: asyncio.Event | None = None, host: str = LOOPBACK) -> None:
    """Run `prefill` + `decode` simulated workers until `stop` is set (SIGTERM/SIGINT set it)."""
    fleet = Fleet(config, secret, host)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: the caller stops us
            loop.add_signal_handler(sig, stop.set)
    await fleet.setup()
    assert fleet.runner is not None
    try:
        for role, count in (("prefill", prefill), ("decode", decode)):
            for _ in range(count):
                await fleet.start_worker(role)
        if ready_file is not None:
            write_ready(ready_file, fleet)
        await stop.wait()
    finally:
        await fleet.runner.cleanup()
        await fleet.close()


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and serve until stopped."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=1, help="simulated prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="simulated decode workers (default 1)")
    p.add_argument("--ready-file", type=Path, default=None, help="where to write the URLs once listening")
    p.add_argument("--host", default=LOOPBACK,
                   help="loopback address to listen on, e.g. 127.0.0.12 for simulated node 12 (default 127.0.0.1)")
    p.add_argument("--secret", default=os.environ.get("PLATFORM_SHARED_SECRET", ""),
                   help="X-Platform-Secret the internal endpoints require (default: PLATFORM_SHARED_SECRET)")
    add_arguments(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.prefill < 0 or args.decode < 0 or args.prefill + args.decode < 1:
        p.error("--prefill and --decode must be >= 0, and at least one worker")
    if not is_loopback(args.host):
        p.error(f"--host {args.host}: simulated workers listen on loopback addresses only (127.0.0.0/8)")
    try:
        config = from_arguments(args)
    except ValueError as exc:
        p.error(str(exc))
    asyncio.run(serve(config, args.prefill, args.decode, args.ready_file, args.secret, host=args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
