"""What the router's health checks cost, in process: the real checks on the real WorkerPool against
a running simulated fleet, CPU per check, and a cProfile of where it goes.

The router's health-check thread (inference/router/health.py) checks each endpoint once per
`health_interval_s` with its lean `HealthClient` (`check_endpoint_lean`: a kept connection per
endpoint, httptools, orjson); `cpu_us_per_check` times that. `aiohttp_cpu_us_per_check` times
`check_endpoint` on one aiohttp session, which the pool still uses for its on-demand checks
(`check_all`, `check_health`) and the health thread used before. Timing a few rounds here, in a
process that does nothing else, isolates that cost from the router's other work; the router-process
figure (bench/sim/router_scale.py) is the one the target is about.

    .venv/bin/python -m bench.sim.fleet --prefill 64 --decode 256 --ready-file /tmp/fleet.json &
    .venv/bin/python -m bench.sim.health_cost --fleet /tmp/fleet.json
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from inference.router import Endpoint, WorkerPool
from inference.router.health import HealthClient, check_endpoint, check_endpoint_lean, new_session

Check = Callable[[WorkerPool, Endpoint], Awaitable[bool]]


async def _rounds(pool: WorkerPool, check: Check, rounds: int, pause_s: float,
                  profiler: cProfile.Profile | None) -> list[float]:
    """CPU seconds of each round of `check` on every endpoint after the first (which opens the
    connections)."""
    out = []
    for i in range(rounds + 1):
        endpoints = pool.all_endpoints()
        t0 = time.thread_time()
        if profiler is not None and i > 0:
            profiler.enable()
        results = await asyncio.gather(*(check(pool, e) for e in endpoints))
        if profiler is not None:
            profiler.disable()
        if i > 0:
            out.append(time.thread_time() - t0)
        if not all(results):
            raise RuntimeError(f"{results.count(False)} of {len(results)} health checks failed")
        await asyncio.sleep(pause_s)  # as the checker waits between checks (connections stay alive)
    return out


async def _lean(pool: WorkerPool, rounds: int, pause_s: float, profiler: cProfile.Profile | None) -> list[float]:
    client = HealthClient(pool.headers)
    try:
        return await _rounds(pool, lambda p, e: check_endpoint_lean(p, client, e), rounds, pause_s, profiler)
    finally:
        client.close()


async def _aiohttp(pool: WorkerPool, rounds: int, pause_s: float) -> list[float]:
    session = new_session(pool.headers)
    try:
        return await _rounds(pool, lambda p, e: check_endpoint(p, session, e), rounds, pause_s, None)
    finally:
        await session.close()


def measure(prefill_urls: list[str], decode_urls: list[str], rounds: int, pause_s: float = 2.0,
            top: int = 12) -> dict[str, Any]:
    """CPU per health check over `rounds` rounds of every endpoint, and the profile of those rounds."""
    pool = WorkerPool(prefill_urls, decode_urls, health_interval_s=0)
    n = len(prefill_urls) + len(decode_urls)
    lean = asyncio.run(_lean(pool, rounds, pause_s, None))
    profiler = cProfile.Profile()
    asyncio.run(_lean(pool, max(1, rounds // 2), pause_s, profiler))
    stats = pstats.Stats(profiler, stream=io.StringIO())
    checks = n * max(1, rounds // 2)
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{'/'.join(filename.rsplit('/', 2)[-2:])}:{line}({name})",
                     "calls_per_check": calls / checks, "own_us_per_check": tottime * 1e6 / checks,
                     "cum_us_per_check": cumtime * 1e6 / checks})
    rows.sort(key=lambda r: r["own_us_per_check"], reverse=True)
    cpu_per_check_us = sum(lean) * 1e6 / (n * len(lean))
    plain = asyncio.run(_aiohttp(pool, rounds, pause_s))
    return {
        "endpoints": n, "rounds": len(lean), "cpu_us_per_check": cpu_per_check_us,
        "aiohttp_cpu_us_per_check": sum(plain) * 1e6 / (n * len(plain)),
        "cpu_ms_per_round": sum(lean) * 1000 / len(lean),
        "core_share_at_interval": cpu_per_check_us * n / 1e6 / pause_s,
        "profile_top_own_time": rows[:top],
    }


def main(argv: list[str] | None = None) -> int:
    """Measure against a running fleet (its --ready-file) and print the result as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.sim.health_cost", description=__doc__.splitlines()[0])
    p.add_argument("--fleet", type=Path, required=True, help="the fleet's --ready-file (bench.sim.fleet)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds of every endpoint (default 6)")
    p.add_argument("--pause-s", type=float, default=2.0, help="pause between rounds (default 2, the interval)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1 or args.pause_s < 0:
        p.error("--rounds must be >= 1 and --pause-s >= 0")
    try:
        fleet = json.loads(args.fleet.read_text())
    except (OSError, ValueError) as exc:
        p.error(f"--fleet: cannot read {args.fleet}: {exc}")
    print(json.dumps(measure(fleet["prefill"], fleet["decode"], args.rounds, args.pause_s), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
