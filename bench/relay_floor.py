"""The floor under the router's CPU per streamed token: a bare ASGI relay, no Channels, no router logic.

Two processes on loopback: an NDJSON "worker" (uvicorn) that streams one token line every
``--gap-ms`` (like a decode worker at batch 1), and a relay (uvicorn + uvloop + httptools, the
router's own upstream client and NdjsonReader) that forwards each line as one SSE chunk. The
relay's CPU seconds (psutil) for 64-line against 1-line requests, divided by 63, is what one
forwarded token costs *any* ASGI relay on this machine at that token spacing; compare with the
router's figure from ``bench/router_ab.py`` / ``bench/router_overhead.py``.

    .venv/bin/python -m bench.relay_floor                  # gaps 2, 0.6 ms; ~1 minute
    .venv/bin/python -m bench.relay_floor --gap-ms 1 --rounds 5
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from bench.common import LOOPBACK, base_parser, log, markdown_table, median, parse_args, write_result
from tests.support.processes import die_with_parent

MODULE = "bench.relay_floor"
Scope = dict[str, Any]


def _serve(app: Any, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=LOOPBACK, port=port, log_level="warning", loop="uvloop", http="httptools")


def serve_upstream(port: int, gap_s: float) -> None:
    """The NDJSON worker: POST /s?n=N streams N token lines, one every `gap_s`."""

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        n = int((scope.get("query_string") or b"n=64").split(b"=")[1])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        for i in range(n):
            await asyncio.sleep(gap_s)
            await send({"type": "http.response.body", "more_body": True,
                        "body": b'{"type":"token","token_ids":[%d],"text":" tok"}\n' % i})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    _serve(app, port)


def serve_relay(port: int, upstream_port: int) -> None:
    """The relay: POST /r?n=N → the worker's stream → one SSE chunk per line."""
    import orjson

    from inference.router.ndjson import NdjsonReader
    from inference.router.upstream import UpstreamClient

    clients: list[UpstreamClient] = []

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if not clients:
            clients.append(UpstreamClient())
        query = scope["query_string"].decode()
        response = await clients[0].post(f"http://{LOOPBACK}:{upstream_port}/s?{query}", b"{}", connect_timeout_s=3)
        reader: NdjsonReader[dict[str, Any]] = NdjsonReader(response.content)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        while (line := await reader.next_within(10)) is not None:  # bounded: the worker's n lines
            chunk = orjson.dumps({"text": line["text"], "token_ids": line["token_ids"]})
            await send({"type": "http.response.body", "body": b"data: " + chunk + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        response.close()

    _serve(app, port)


async def _cpu_per_request(relay_pid: int, port: int, n: int, requests: int) -> float:
    import aiohttp
    import psutil

    proc = psutil.Process(relay_pid)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # warm-up (connections)
            async with session.post(f"http://{LOOPBACK}:{port}/r?n={n}", data=b"{}") as r:
                await r.read()
        before = sum(proc.cpu_times()[:2])
        for _ in range(requests):
            async with session.post(f"http://{LOOPBACK}:{port}/r?n={n}", data=b"{}") as r:
                async for _line in r.content:
                    pass
        return (sum(proc.cpu_times()[:2]) - before) / requests


def _wait_port(port: int, deadline: float) -> None:
    import socket

    while time.monotonic() < deadline:  # bounded by the deadline
        with socket.socket() as s:
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {LOOPBACK}:{port}")


def measure(gap_ms: float, rounds: int, requests: int) -> dict[str, Any]:
    """CPU µs per forwarded token of the bare relay, `rounds` times, at one token per `gap_ms`."""
    from tests.support.processes import free_port

    up_port, relay_port = free_port(), free_port()
    me = [sys.executable, "-m", MODULE]
    # Both go with this process however it ends (die_with_parent), not only through the finally below.
    up = subprocess.Popen([*me, "--serve-upstream", str(up_port), "--gap-ms", str(gap_ms)],
                          preexec_fn=die_with_parent())
    relay = subprocess.Popen([*me, "--serve-relay", str(relay_port), "--upstream-port", str(up_port)],
                             preexec_fn=die_with_parent())
    try:
        deadline = time.monotonic() + 30
        _wait_port(up_port, deadline)
        _wait_port(relay_port, deadline)
        per_token = []
        for _ in range(rounds):
            one = asyncio.run(_cpu_per_request(relay.pid, relay_port, 1, requests))
            many = asyncio.run(_cpu_per_request(relay.pid, relay_port, 64, requests))
            per_token.append((many - one) * 1e6 / 63)
            log(f"gap {gap_ms} ms: {per_token[-1]:.1f} µs per token")
        return {"gap_ms": gap_ms, "rounds_us_per_token": per_token, "median_us_per_token": median(per_token)}
    finally:
        for proc in (relay, up):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    """Measure the bare relay at each gap, print the table, write JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--gap-ms", type=float, action="append", help="token spacing (repeatable; default 2 and 0.6)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-relay", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, (args.gap_ms or [2.0])[0] / 1000)
        return 0
    if args.serve_relay:
        serve_relay(args.serve_relay, args.upstream_port)
        return 0
    gaps = args.gap_ms or [2.0, 0.6]
    rounds, requests = (1, 4) if args.quick else (args.rounds, 60)
    results = [measure(gap, rounds, requests) for gap in gaps]
    print(markdown_table(["token gap ms", "bare relay CPU µs per token (median)", "rounds"],
                         [[r["gap_ms"], f"{r['median_us_per_token']:.1f}",
                           " ".join(f"{v:.1f}" for v in r["rounds_us_per_token"])] for r in results]))
    name = "relay_floor_quick" if args.quick else "relay_floor"
    path = write_result(args.out_dir, name, MODULE, argv, {"results": results})
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
