"""Zero lost requests, drilled: streams through a decode worker killed mid-stream, and hang-ups.

Real processes on loopback (tiny model): one prefill worker, two decode workers, the router.

- *kill*: ``--streams`` streaming ``/v1/completions`` (``max_tokens`` 200, greedy, ``ignore_eos``)
  at ``--concurrency``; once a third of them have started, one decode worker is SIGKILLed. Every
  stream must end with a ``finish_reason`` (the router moves the broken ones to the other decode
  worker); the greedy ones are compared token for token with an unbroken run of the same prompt.
  Every ``data:`` line must be strict UTF-8 JSON: one that is not (a torn event) is counted as
  ``unparsable_events`` and its stream as lost; a stream whose connection fails is lost too, and
  the run goes on.
- *hang-up*: ``--hangups`` streams closed by the client right after their first token. Counted on
  the decode worker afterwards: how many still ran to completion (``worker_requests_total
  {outcome="ok"}``) and how many tokens it sent meanwhile; of the completed ones, how many had
  already delivered the end of their answer to the client when it hung up (its process read the
  first token late), the rest ran on after the hang-up.

- *throughput* (``--only throughput``, not part of the default run): ``--streams`` full streams by
  well-behaved clients, tokens per second; compare ``--router-env ROUTER_STREAM_CREDIT=0`` (the
  router's credit off) with the default to see what flow control costs when nobody falls behind.

    .venv/bin/python -m bench.stream_drill                 # about two minutes
    .venv/bin/python -m bench.stream_drill --quick
    .venv/bin/python -m bench.stream_drill --only hangup --router-env ROUTER_STREAM_CREDIT=0
    .venv/bin/python -m bench.stream_drill --only hangup --worker-nice 10   # workers below client/router
    .venv/bin/python -m bench.stream_drill --split-cpus    # client + router on CPU 0, workers on the last

``--split-cpus`` is the layout of separate hosts on one machine: the workers run on the last CPU
(their own ``--base-cpu-id``), the client (this process) and the router on the others, so neither
side can starve the other of CPU time, all at equal priority.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.common import base_parser, log, markdown_table, parse_args, tiny_model_dir, write_result

PROMPTS = [f"Stream number {i} tells the story of disaggregated inference" for i in range(10)]


def _metric(url: str, name: str, label: str = "") -> float:
    """A worker's Prometheus counter value (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _stream(session: aiohttp.ClientSession, router: str, prompt: str, max_tokens: int,
                  hang_up: bool = False) -> dict[str, Any]:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    tokens: list[int] = []
    finish = None
    error = None
    unparsable: list[bytes] = []  # data lines that are not strict UTF-8 JSON (a torn event: issue 26)
    async with session.post(f"{router}/v1/completions", json=body) as response:
        if response.status != 200:
            return {"status": response.status, "finish_reason": None, "tokens": [], "error": await response.text(),
                    "unparsable": []}
        async for raw in response.content:
            if not raw.startswith(b"data: {"):
                continue
            try:
                event = json.loads(raw[6:].decode("utf-8"))
            except ValueError:
                unparsable.append(raw)
                error = f"unparsable event: {raw[:200]!r}"
                continue
            if "error" in event:
                error = event["error"]["message"]
                continue
            choice = event["choices"][0]
            tokens.extend(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
            if hang_up and tokens:
                delivered = _answer_end_received(response)
                break  # leaving the block closes the connection
    return {"status": 200, "finish_reason": finish, "tokens": tokens, "error": error, "unparsable": unparsable,
            "delivered_before_hang_up": hang_up and bool(tokens) and delivered}


_ANSWER_END = b"data: [DONE]"


def _answer_end_received(response: aiohttp.ClientResponse) -> bool:
    """Whether the end of the answer had already reached this client when it hangs up: in aiohttp's
    buffer or unread in the socket (peeked, not consumed). Such a stream was complete, and sent,
    before the hang-up: no abort could have stopped it."""
    buffered = b"".join(getattr(response.content, "_buffer", ()))
    if _ANSWER_END in buffered:
        return True
    connection = response.connection
    transport = connection.transport if connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    peek = socket.socket(fileno=os.dup(sock.fileno()))
    try:
        pending = peek.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, OSError):
        pending = b""
    finally:
        peek.close()
    return _ANSWER_END in buffered + pending


async def _kill_drill(router: str, victim: Any, streams: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    migrations_before = _metric(router, "router_migrations_total")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        reference = {p: (await _stream(session, router, p, max_tokens))["tokens"] for p in PROMPTS}
        started = 0
        killed_at: float | None = None
        semaphore = asyncio.Semaphore(concurrency)

        async def one(i: int) -> dict[str, Any]:
            nonlocal started, killed_at
            async with semaphore:
                started += 1
                if killed_at is None and started > streams // 3:
                    victim.kill()
                    killed_at = time.monotonic()
                try:
                    result = await _stream(session, router, PROMPTS[i % len(PROMPTS)], max_tokens)
                except (aiohttp.ClientError, TimeoutError) as exc:  # a lost stream, counted, not the run's end
                    result = {"status": None, "finish_reason": None, "tokens": [], "unparsable": [],
                              "error": f"{type(exc).__name__}: {exc}"}
                result["equal"] = result["tokens"] == reference[PROMPTS[i % len(PROMPTS)]]
                return result

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    return {
        "streams": streams,
        "completed": sum(1 for r in results if r["finish_reason"] is not None and r["error"] is None),
        "lost": sum(1 for r in results if r["finish_reason"] is None or r["error"] is not None),
        "equal_to_unbroken": sum(1 for r in results if r["equal"]),
        "unparsable_events": sum(len(r["unparsable"]) for r in results),
        # Streams the router moved to the other decode worker (the kill's victims), from its /metrics.
        "migrations": int(_metric(router, "router_migrations_total") - migrations_before),
        "errors": sorted({str(r["error"])[:160] for r in results if r["error"]})[:5],
    }


def _client_session(rcvbuf: int, timeout_s: float) -> aiohttp.ClientSession:
    """The drill's HTTP client; with `rcvbuf`, a small socket receive buffer and read buffer (a client
    whose own buffers cannot absorb a whole answer while its application lags)."""
    if not rcvbuf:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    def small_socket(addr_info: Any) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: sets the window
        return sock

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), read_bufsize=2048,
                                 connector=aiohttp.TCPConnector(socket_factory=small_socket))


async def _hangup_drill(router: str, decode_urls: list[str], hangups: int, concurrency: int,
                        client_rcvbuf: int = 0) -> dict[str, Any]:
    ok_before = sum(_metric(u, "worker_requests_total", 'outcome="ok"') for u in decode_urls)
    tokens_before = sum(_metric(u, "worker_generation_tokens_total") for u in decode_urls)
    semaphore = asyncio.Semaphore(concurrency)
    async with _client_session(client_rcvbuf, 120) as session:
        async def one(i: int) -> dict[str, Any]:
            async with semaphore:
                return await _stream(session, router, PROMPTS[i % len(PROMPTS)], 200, hang_up=True)

        results = await asyncio.gather(*(one(i) for i in range(hangups)))
    await asyncio.sleep(3)  # aborts land; a stream still running would finish 200 tokens in this time
    completed = int(sum(_metric(u, "worker_requests_total", 'outcome="ok"') for u in decode_urls) - ok_before)
    delivered = sum(1 for r in results if r.get("delivered_before_hang_up"))
    return {
        "hangups": hangups,
        "ran_to_completion": completed,
        # Complete, and delivered to the client, before it hung up (its process read the first
        # token late): the rest ran on after the hang-up, for nobody.
        "delivered_before_hang_up": delivered,
        "ran_on_after_hang_up": completed - delivered,
        "tokens_generated": int(sum(_metric(u, "worker_generation_tokens_total") for u in decode_urls)
                                - tokens_before),
    }


async def _throughput_drill(router: str, streams: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Well-behaved clients (read every token): completed streams and generated tokens per second, to
    check that flow control costs nothing when nobody falls behind."""
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one(i: int) -> dict[str, Any]:
            async with semaphore:
                return await _stream(session, router, PROMPTS[i % len(PROMPTS)], max_tokens)

        await one(0)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(streams)))
        elapsed = time.perf_counter() - started
    tokens = sum(len(r["tokens"]) for r in results)
    return {
        "streams": streams,
        "completed": sum(1 for r in results if r["finish_reason"] == "length" and r["error"] is None),
        "tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Start the processes, run both drills, print and write the result."""
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "stream drill")
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--hangups", type=int, default=1000)
    p.add_argument("--stream-window", type=int, default=None,
                   help="decode workers' --stream-window (default: theirs; 0: flow control off)")
    p.add_argument("--only", choices=["kill", "hangup", "throughput"], default=None,
                   help="run one drill only (throughput: --streams full streams, no kill; not run otherwise)")
    p.add_argument("--client-rcvbuf", type=int, default=0,
                   help="hang-up drill: SO_RCVBUF of the client's sockets (0: the kernel's default)")
    p.add_argument("--decode-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the decode workers (experiments; repeatable)")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the router (experiments; repeatable)")
    p.add_argument("--worker-nice", type=int, default=0,
                   help="the workers' --nice: their CPU priority below the client's and the router's, as if "
                   "those ran on hosts of their own (default 0: all equal)")
    p.add_argument("--split-cpus", action="store_true",
                   help="workers on the last CPU (--base-cpu-id), client and router on the others: separate "
                   "hosts' CPUs on one machine")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    cpus = sorted(os.sched_getaffinity(0))
    if args.split_cpus and len(cpus) < 2:
        p.error(f"--split-cpus needs at least 2 CPUs; this process may use {len(cpus)}")
    if args.quick:
        args.streams, args.concurrency, args.hangups = 12, 4, 20
    from tests.support.processes import Proc, start_router, start_worker

    model = args.model_dir or tiny_model_dir()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--block-size", "8", "--context-length", "1024", "--num-threads", "1", "--nice", str(args.worker_nice)]
    if args.split_cpus:
        common += ["--base-cpu-id", str(cpus[-1])]
    window = [] if args.stream_window is None else ["--stream-window", str(args.stream_window)]
    procs: list[Proc] = []
    try:
        prefill, prefill_url = start_worker("prefill", model, log_dir, extra=common)
        procs.append(prefill)
        decode_env = dict(item.split("=", 1) for item in args.decode_env)
        decodes = [start_worker("decode", model, log_dir, extra=common + window, env=decode_env) for _ in range(2)]
        procs += [proc for proc, _ in decodes]
        router_env = dict(item.split("=", 1) for item in args.router_env)
        if args.split_cpus:  # the router inherits this process's CPUs; the client runs here
            os.sched_setaffinity(0, cpus[:-1])
        router, router_url = start_router([prefill_url], [url for _, url in decodes], log_dir, env=router_env or None)
        procs.append(router)
        hangup: dict[str, Any] | None = None
        kill: dict[str, Any] | None = None
        throughput: dict[str, Any] | None = None
        if args.only == "throughput":
            throughput = asyncio.run(_throughput_drill(router_url, args.streams, args.concurrency, 200))
            log(f"throughput: {throughput}")
        if args.only in (None, "hangup"):
            hangup = asyncio.run(
                _hangup_drill(router_url, [url for _, url in decodes], args.hangups, args.concurrency,
                              args.client_rcvbuf)
            )
            log(f"hang-ups: {hangup}")
        if args.only in (None, "kill"):
            kill = asyncio.run(_kill_drill(router_url, decodes[0][0], args.streams, args.concurrency, 200))
            log(f"kill: {kill}")
    finally:
        for proc in reversed(procs):
            proc.stop()
        os.sched_setaffinity(0, cpus)  # main() may run inside a longer process (the bench smoke tests)
    if kill is not None:
        print(markdown_table(
            ["drill", "streams", "completed", "lost", "equal to an unbroken run", "unparsable events", "migrations"],
            [["decode worker SIGKILLed", kill["streams"], kill["completed"], kill["lost"],
              kill["equal_to_unbroken"], kill["unparsable_events"], kill["migrations"]]],
        ))
    if hangup is not None:
        print(markdown_table(
            ["drill", "streams", "ran to completion", "of them delivered before the hang-up",
             "ran on after the hang-up", "tokens sent"],
            [["client hangs up after the first token", hangup["hangups"], hangup["ran_to_completion"],
              hangup["delivered_before_hang_up"], hangup["ran_on_after_hang_up"], hangup["tokens_generated"]]],
        ))
    name = "stream_drill_quick" if args.quick else "stream_drill"
    if throughput is not None:
        print(markdown_table(
            ["drill", "streams", "completed", "tokens", "seconds", "tokens/s"],
            [["well-behaved clients", throughput["streams"], throughput["completed"], throughput["tokens"],
              throughput["seconds"], throughput["tokens_per_s"]]],
        ))
    result = {"kill": kill, "hangup": hangup, "throughput": throughput, "stream_window": args.stream_window,
              "client_rcvbuf": args.client_rcvbuf, "worker_nice": args.worker_nice, "split_cpus": args.split_cpus,
              "decode_env": args.decode_env, "router_env": args.router_env}
    path = write_result(args.out_dir, name, "bench.stream_drill", argv, result)
    log(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
