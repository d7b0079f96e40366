"""What the router's acceptor costs per connection and per request: the router with it and without it
(`--no-acceptor`), on the same workers, alternating.

The acceptor (inference/gateway/acceptor.py) reads the start of each new connection and hands it to
a router process, so a new connection pays one more process hop; a keep-alive connection's later
requests go straight to the router process and should pay nothing. Per round and per router, one
client sends ``--requests`` sequential ``GET /v1/models`` (served by a router process, no generation):

- ``new``: each on a fresh connection (``Connection: close``), as a client without a pool does;
- ``keep-alive``: all on one connection;
- ``probe``: ``GET /health`` on fresh connections (the acceptor answers it; without it the router's
  protocol does).

Reported: latency p50/p99 and the router's CPU (its processes, acceptor included) per request,
medians over rounds, and the ratio with/without the acceptor.

    .venv/bin/python -m bench.acceptor_cost                 # 3 rounds of 1,000 requests per mode
    .venv/bin/python -m bench.acceptor_cost --quick
"""
from __future__ import annotations

import http.client
import os
import sys
import time
from typing import Any

from bench.common import (
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    parse_args,
    percentile,
    process_cpu_seconds,
    ratio,
    tiny_model_dir,
    write_result,
)

MODES = {  # path, and whether all requests share one connection
    "new": ("/v1/models", False),
    "keep-alive": ("/v1/models", True),
    "probe": ("/health", False),
}


def _get(conn: http.client.HTTPConnection, path: str, close: bool) -> None:
    conn.request("GET", path, headers={"Connection": "close"} if close else {})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise ConnectionError(f"GET {path}: {answer.status}")


def measure(url: str, pid: int, mode: str, requests: int) -> dict[str, float]:
    """Latency percentiles (ms) and router CPU per request (µs) of `requests` sequential requests."""
    path, keep_alive = MODES[mode]
    host, port = url.removeprefix("http://").split(":")
    seconds: list[float] = []
    cpu_before = process_cpu_seconds(pid)
    kept = http.client.HTTPConnection(host, int(port), timeout=30) if keep_alive else None
    try:
        for _ in range(requests):
            started = time.perf_counter()
            if kept is not None:
                _get(kept, path, close=False)
            else:
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    _get(conn, path, close=True)
                finally:
                    conn.close()
            seconds.append(time.perf_counter() - started)
    finally:
        if kept is not None:
            kept.close()
    cpu = process_cpu_seconds(pid) - cpu_before
    return {"p50_ms": (percentile(seconds, 50) or 0) * 1e3, "p99_ms": (percentile(seconds, 99) or 0) * 1e3,
            "cpu_us": cpu / requests * 1e6}


def main(argv: list[str] | None = None) -> int:
    """Start the workers and both routers, alternate the measurements, print and write the result."""
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "acceptor_cost")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000, help="requests per mode, router and round")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if args.quick:
        args.rounds, args.requests = 1, 30
    from tests.support.processes import Proc, start_router, start_worker

    model = args.model_dir or tiny_model_dir()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    common = ["--block-size", "8", "--context-length", "512"]
    procs: list[Proc] = []
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[dict[str, float]]]] = {r: {m: [] for m in MODES} for r in ("with", "without")}
    try:
        prefill, prefill_url = start_worker("prefill", model, args.log_dir, extra=common)
        procs.append(prefill)
        decode, decode_url = start_worker("decode", model, args.log_dir, extra=common)
        procs.append(decode)
        routers = {}
        for name, env in (("with", None), ("without", {"ROUTER_ACCEPTOR": "0"})):
            proc, url = start_router([prefill_url], [decode_url], args.log_dir, env=env)
            procs.append(proc)
            routers[name] = (url, proc.popen.pid)
        for url, pid in routers.values():  # warm-up: the router's service, snapshot and imports
            measure(url, pid, "new", 20)
        for rnd in range(args.rounds):
            order = ["with", "without"] if rnd % 2 == 0 else ["without", "with"]
            for mode in MODES:
                for name in order:
                    samples[name][mode].append(measure(*routers[name], mode, args.requests))
            log(f"round {rnd + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})")
    finally:
        for proc in reversed(procs):
            proc.stop()
    summary: dict[str, Any] = {}
    rows = []
    for mode in MODES:
        summary[mode] = {}
        for name in ("with", "without"):
            summary[mode][name] = {key: median([s[key] for s in samples[name][mode]]) for key in ("p50_ms", "p99_ms",
                                                                                                  "cpu_us")}
        w, wo = summary[mode]["with"], summary[mode]["without"]
        summary[mode]["ratio"] = {key: ratio(w[key], wo[key]) for key in w}
        rows.append([mode, f"{fmt(w['p50_ms'], 2)} / {fmt(wo['p50_ms'], 2)}", f"{fmt(w['p99_ms'], 2)} / "
                     f"{fmt(wo['p99_ms'], 2)}", f"{fmt(w['cpu_us'], 0)} / {fmt(wo['cpu_us'], 0)}",
                     fmt(summary[mode]["ratio"]["cpu_us"], 2)])
    print(markdown_table(["mode", "p50 ms (with / without)", "p99 ms", "router CPU µs per request", "CPU ratio"],
                         rows))
    result = {"rounds": args.rounds, "requests": args.requests, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "summary": summary, "samples": samples}
    path = write_result(args.out_dir, "acceptor_cost_quick" if args.quick else "acceptor_cost", "bench.acceptor_cost",
                        argv, result)
    log(f"result: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
