"""Overload at c400: every request answered, keep-alive closes that never race, a /health that stays fast.

Real processes on loopback (tiny model): one prefill worker, two decode workers, the router. For
``--duration`` the project's load test (``load_test``, its own process) keeps ``--concurrency``
streaming ``/v1/completions`` (``max_tokens`` 64) in flight. Meanwhile a separate process (a
``spawn``-ed child, so the load test's CPU and the router's do not share its event loop):

- polls ``GET /health`` every ``--health-interval`` on a fresh connection each time, as a load
  balancer's probe does: its latency percentiles and failures;
- runs ``--idle-clients`` keep-alive clients (httpx, default keep-alive expiry 5 s) that each send a
  request, stay idle for a random 3-7 s and send the next one on the same connection: a server
  that closes an idle connection just as its client reuses it shows up as a request without an
  answer (``RemoteProtocolError``/``ReadError``).

Counted: the load test's requests by outcome, and **connections closed without an answer** (a
request that got no status line: protocol or network errors) from both the load test and the
idle clients; /health p50/p99/max.

    .venv/bin/python -m bench.overload                      # c400 for 30 s
    .venv/bin/python -m bench.overload --quick              # c20 for 5 s: checks the bench runs
    .venv/bin/python -m bench.overload --router-env ROUTER_KEEPALIVE_S=5   # compare a setting
"""
from __future__ import annotations

import asyncio
import csv
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import base_parser, fmt, log, markdown_table, parse_args, percentile, tiny_model_dir, write_result

# load_test's failure kinds that mean "the connection ended without a status line".
_NO_ANSWER_KINDS = ("protocol", "network", "connect")


def _poll_health(url: str, seconds: float, interval_s: float, idle_clients: int, out: str) -> None:
    """The watcher process: /health on fresh connections, and idle keep-alive clients; JSON to `out`."""
    Path(out).write_text(json.dumps(asyncio.run(_watch(url, seconds, interval_s, idle_clients))))


async def _watch(url: str, seconds: float, interval_s: float, idle_clients: int) -> dict[str, Any]:
    health_s: list[float] = []
    health_at: list[float] = []  # when each answered probe started, seconds into the run
    health_failures: list[str] = []
    idle: dict[str, Any] = {"requests": 0, "answered": 0, "no_answer": 0, "errors": []}

    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()

    async def probe() -> None:
        while time.monotonic() < deadline:  # bounded by the run's length
            started = time.perf_counter()
            try:
                # A fresh connection per probe, as a load balancer's health check makes; a raw
                # socket, so that the probe's own cost (an httpx client builds an SSL context,
                # ~60 ms) is not counted as the router's.
                async with asyncio.timeout(10):
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(request)
                    answer = await reader.read()  # Connection: close: the answer ends with the connection
                    writer.close()
                if answer.startswith(b"HTTP/1.1 200"):
                    health_s.append(time.perf_counter() - started)
                    health_at.append(round(started - run_start, 2))
                else:
                    health_failures.append(repr(answer[:80]))
            except (OSError, TimeoutError) as exc:
                health_failures.append(f"{type(exc).__name__}: {exc}"[:160])
            await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - started)))

    # The idle clients are built before the probes start: each builds an SSL context (~60 ms of this
    # process's loop), which a probe started meanwhile would count as the router's latency.
    clients = [httpx.AsyncClient(timeout=30, trust_env=False,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
               for _ in range(idle_clients)]
    deadline = time.monotonic() + seconds

    async def idle_client(seed: int) -> None:
        rng = random.Random(seed)
        async with clients[seed] as client:
            while time.monotonic() < deadline:  # bounded by the run's length
                idle["requests"] += 1
                try:
                    await client.get(f"{url}/v1/models")
                    idle["answered"] += 1
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                    idle["no_answer"] += 1
                    idle["errors"].append(f"{type(exc).__name__}: {exc}"[:160])
                except httpx.HTTPError as exc:
                    idle["errors"].append(f"{type(exc).__name__}: {exc}"[:160])
                await asyncio.sleep(rng.uniform(3.0, 7.0))

    # The first getaddrinfo starts the loop's executor thread: this process's warm-up, not the router's.
    await asyncio.get_running_loop().getaddrinfo(host, int(port))
    run_start = time.perf_counter()
    await asyncio.gather(probe(), *(idle_client(i) for i in range(idle_clients)))
    return {"health_s": health_s, "health_at": health_at, "health_failures": health_failures, "idle": idle}


def _load_outcomes(csv_path: Path) -> dict[str, Any]:
    """How the load test's requests ended, from its per-request CSV."""
    rows = list(csv.DictReader(csv_path.open()))
    by_status: dict[str, int] = {}
    by_kind: dict[str, int] = {}
    for row in rows:
        status = row["http_status"] or "none"
        by_status[status] = by_status.get(status, 0) + 1
        if row["status"] != "ok":
            by_kind[row["status"]] = by_kind.get(row["status"], 0) + 1
    no_answer = [r for r in rows if not r["http_status"] and r["status"] in _NO_ANSWER_KINDS]
    return {
        "requests": len(rows),
        "completed": sum(1 for r in rows if r["status"] == "ok"),
        "by_http_status": by_status,
        "failures_by_kind": by_kind,
        "no_answer": len(no_answer),
        "no_answer_examples": sorted({r["error"][:160] for r in no_answer})[:5],
    }


def main(argv: list[str] | None = None) -> int:
    """Start the processes, run the load and the watcher, print and write the result."""
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "overload")
    p.add_argument("--concurrency", type=int, default=400)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--health-interval", type=float, default=0.1, help="seconds between /health probes")
    p.add_argument("--idle-clients", type=int, default=20, help="keep-alive clients idle 3-7 s between requests")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment of the router (repeatable)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if args.quick:
        args.concurrency, args.duration, args.idle_clients = 20, 5.0, 2
    from tests.support.processes import Proc, start_router, start_worker

    model = args.model_dir or tiny_model_dir()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--block-size", "8", "--context-length", "1024", "--num-threads", "1"]
    procs: list[Proc] = []
    load_before = os.getloadavg()
    try:
        prefill, prefill_url = start_worker("prefill", model, log_dir, extra=common)
        procs.append(prefill)
        decodes = [start_worker("decode", model, log_dir, extra=common) for _ in range(2)]
        procs += [proc for proc, _ in decodes]
        router_env = dict(item.split("=", 1) for item in args.router_env)
        router, router_url = start_router([prefill_url], [url for _, url in decodes], log_dir, env=router_env or None)
        procs.append(router)
        watch_out = log_dir / "overload_watch.json"
        watcher = multiprocessing.get_context("spawn").Process(
            target=_poll_health,
            args=(router_url, args.duration + 5, args.health_interval, args.idle_clients, str(watch_out)),
        )
        watcher.start()
        csv_path, summary_path = log_dir / "overload.csv", log_dir / "overload_summary.json"
        started = time.monotonic()
        try:
            subprocess.run(
                [str(Path(sys.executable).with_name("load_test")), "--endpoint", f"{router_url}/v1/completions",
                 "--concurrency", str(args.concurrency), "--duration", f"{args.duration:g}s", "--max-tokens",
                 str(args.max_tokens), "--metrics-file", str(csv_path), "--summary-json", str(summary_path),
                 "--no-plot", "--no-progress"],
                check=True, timeout=900,
            )
        finally:
            watcher.join(timeout=args.duration + 120)
            if watcher.is_alive():
                watcher.kill()
        wall_s = time.monotonic() - started
    finally:
        for proc in reversed(procs):
            proc.stop()
    load_after = os.getloadavg()
    watch = json.loads(watch_out.read_text())
    health_s: list[float] = watch["health_s"]
    outcomes = _load_outcomes(csv_path)
    result = {
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "router_env": args.router_env,
        "wall_s": round(wall_s, 1),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "outcomes": outcomes,
        "health": {
            "probes": len(health_s) + len(watch["health_failures"]),
            "failures": watch["health_failures"][:10],
            "p50_ms": round((percentile(health_s, 50) or 0) * 1000, 1),
            "p99_ms": round((percentile(health_s, 99) or 0) * 1000, 1),
            "max_ms": round(max(health_s, default=0) * 1000, 1),
            # The five slowest probes: (seconds into the run, ms), to tell a start-up burst from the load's.
            "slowest": sorted(zip(watch["health_at"], (round(t * 1000, 1) for t in health_s), strict=True),
                              key=lambda pair: -pair[1])[:5],
        },
        "idle_clients": watch["idle"],
        "load_test": json.loads(summary_path.read_text()),
    }
    o, h, idle = outcomes, result["health"], watch["idle"]
    print(markdown_table(
        ["clients", "requests", "completed", "by status", "no answer (load / idle clients)",
         "/health p50 / p99 / max ms", "/health failures"],
        [[args.concurrency, o["requests"], o["completed"], json.dumps(o["by_http_status"]),
          f"{o['no_answer']} / {idle['no_answer']} of {idle['requests']}",
          f"{fmt(h['p50_ms'], 1)} / {fmt(h['p99_ms'], 1)} / {fmt(h['max_ms'], 1)}", len(watch["health_failures"])]],
    ))
    name = "overload_quick" if args.quick else "overload"
    path = write_result(args.out_dir, name, "bench.overload", argv, result)
    log(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
