"""HTTP client of the router: httpx, aiohttp and the router's own upstream client, CPU per request and line.

The router makes two calls per generation (the decode stream and the prefill POST) and reads one
NDJSON line per token; what that costs the router process is mostly its HTTP client. The clients
(httpx, aiohttp, and inference/router/upstream.py, which the router uses now) run the same work
against one local uvicorn server (Starlette, as the workers are), alternating in
rounds so drift of the shared machine hits both alike:

- ``post``: ``POST /json`` with a small JSON body, JSON answer (the prefill call);
- ``stream``: ``POST /stream``, an NDJSON answer of ``--lines`` lines read line by line (a decode
  stream of that many tokens).

Measured: this process's CPU seconds per request and per line (time.process_time), at
``--concurrency`` requests in flight, connections kept alive (one pooled client per library).

    .venv/bin/python -m bench.http_clients            # about 30 s
    .venv/bin/python -m bench.http_clients --quick
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import orjson

from bench.common import LOOPBACK, base_parser, fmt, log, markdown_table, parse_args, write_result
from inference.router.ndjson import NdjsonReader
from inference.router.upstream import UpstreamClient
from tests.support.processes import die_with_parent

_SERVER = """
import json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

LINE = json.dumps({"type": "token", "token_ids": [1234], "text": " word"}).encode() + b"\\n"

async def post(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"first_token": 1, "kv_bytes": 8192, "echo": body.get("request_id")})

async def stream(request: Request) -> StreamingResponse:
    n = int(request.query_params.get("n", "64"))
    async def lines():
        yield b'{"type": "descriptor"}\\n'
        for _ in range(n):
            yield LINE
        yield b'{"type": "done"}\\n'
    return StreamingResponse(lines(), media_type="application/x-ndjson")

app = Starlette(routes=[Route("/json", post, methods=["POST"]), Route("/stream", stream, methods=["POST"])])
uvicorn.run(app, host=sys.argv[1], port=int(sys.argv[2]), log_level="warning")
"""


def _free_port() -> int:
    """A port outside the kernel's ephemeral range, reserved across processes (tests/support/ports.py)."""
    from tests.support.processes import free_port

    return free_port()


async def _run(concurrency: int, total: int, one: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    """Run `total` calls of `one` with `concurrency` in flight; (CPU seconds, lines read)."""
    remaining = total
    lines = 0

    async def loop() -> None:
        nonlocal remaining, lines
        while remaining > 0:
            remaining -= 1
            got = await one()  # awaited first: `lines += await ...` would lose updates
            lines += got

    cpu = time.process_time()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return time.process_time() - cpu, lines


async def _measure(base: str, n_lines: int, concurrency: int, total: int, rounds: int) -> dict[str, Any]:
    body = {"request_id": "req-1", "sampling": {"max_tokens": 16, "temperature": 0.0}, "prompt_token_ids": [1] * 64}
    hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64), trust_env=False)
    ah = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), trust_env=False)
    up = UpstreamClient()
    raw = orjson.dumps(body)

    async def hx_post() -> int:
        r = await hx.post(f"{base}/json", json=body)
        r.json()
        return 0

    async def ah_post() -> int:
        async with ah.post(f"{base}/json", json=body) as r:
            await r.json()
        return 0

    async def hx_stream() -> int:
        n = 0
        async with hx.stream("POST", f"{base}/stream?n={n_lines}", json=body) as r:
            async for _line in r.aiter_lines():
                n += 1
        return n

    async def ah_stream() -> int:
        n = 0
        async with ah.post(f"{base}/stream?n={n_lines}", json=body) as r:
            async for _line in r.content:
                n += 1
        return n

    async def up_post() -> int:
        async with await up.post(f"{base}/json", raw, connect_timeout_s=3) as r:
            orjson.loads(await r.read())
        return 0

    async def up_stream() -> int:
        async with await up.post(f"{base}/stream?n={n_lines}", raw, connect_timeout_s=3) as r:
            reader: NdjsonReader[dict[str, Any]] = NdjsonReader(r.content)
            n = 0
            while await reader.next() is not None:  # bounded by the stream's end
                n += 1
        return n

    cases = {("httpx", "post"): hx_post, ("aiohttp", "post"): ah_post, ("upstream", "post"): up_post,
             ("httpx", "stream"): hx_stream, ("aiohttp", "stream"): ah_stream, ("upstream", "stream"): up_stream}
    cpu: dict[tuple[str, str], float] = {k: 0.0 for k in cases}
    lines: dict[tuple[str, str], int] = {k: 0 for k in cases}
    try:
        for fn in cases.values():  # warm the pools
            await _run(concurrency, concurrency * 2, fn)
        for _ in range(rounds):
            for key, fn in cases.items():
                c, n = await _run(concurrency, total, fn)
                cpu[key] += c
                lines[key] += n
    finally:
        await hx.aclose()
        await ah.close()
        up.close()
    out: dict[str, Any] = {}
    for (lib, kind), seconds in cpu.items():
        requests = total * rounds
        out[f"{lib}/{kind}"] = {
            "cpu_us_per_request": seconds / requests * 1e6,
            "cpu_us_per_line": seconds / lines[(lib, kind)] * 1e6 if lines[(lib, kind)] else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    """Start the local server, measure both clients, print and write the result."""
    p = base_parser(__doc__ or "")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--lines", type=int, default=64)
    args = parse_args(p, sys.argv[1:] if argv is None else argv)
    total, rounds = (40, 1) if args.quick else (400, 3)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, LOOPBACK, str(port)], env=dict(os.environ),
                              preexec_fn=die_with_parent())  # gone with this process however it ends
    try:
        deadline = time.monotonic() + 30
        while True:  # bounded by the deadline
            try:
                httpx.post(f"http://{LOOPBACK}:{port}/json", json={}, timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the local server did not start") from None
                time.sleep(0.1)
        result = asyncio.run(_measure(f"http://{LOOPBACK}:{port}", args.lines, args.concurrency, total, rounds))
    finally:
        server.terminate()
        server.wait(timeout=10)
    rows = [
        [name, fmt(v["cpu_us_per_request"], 0), fmt(v["cpu_us_per_line"], 1)] for name, v in result.items()
    ]
    print(markdown_table(["client/call", "CPU µs per request", "CPU µs per line"], rows))
    for kind in ("post", "stream"):
        ratio = result[f"httpx/{kind}"]["cpu_us_per_request"] / result[f"aiohttp/{kind}"]["cpu_us_per_request"]
        log(f"{kind}: httpx costs {ratio:.2f}x aiohttp's CPU per request")
        ratio = result[f"aiohttp/{kind}"]["cpu_us_per_request"] / result[f"upstream/{kind}"]["cpu_us_per_request"]
        log(f"{kind}: aiohttp costs {ratio:.2f}x the upstream client's CPU per request")
    write_result(args.out_dir, "http_clients", "bench.http_clients", sys.argv[1:] if argv is None else argv,
                 {"concurrency": args.concurrency, "lines": args.lines, "results": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
